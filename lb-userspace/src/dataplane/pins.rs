//! Where socklb pins its objects, and the checks that keep another user
//! out of that directory.
//!
//! Every path derives from one pin directory: a map is pinned under its
//! name, a link as `link_<program>`. socklb creates the directory 0700 and
//! refuses one that another user owns or that others can write: /sys/fs/bpf
//! is often mode 1777, so any user could otherwise pre-create the directory
//! and later unlink our pins.

use std::{
    fs::DirBuilder,
    os::unix::fs::DirBuilderExt,
    path::{Path, PathBuf},
};

use lb_common::names;

use super::KernelError;
use crate::trust::{self, Owner};

/// Where socklb pins its objects unless told otherwise.
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/socklb";

/// Every path socklb pins, derived from one directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinPaths {
    pub dir: PathBuf,
}

/// The file name of a program's link pin.
pub fn link_file_name(program: &str) -> String {
    format!("link_{program}")
}

impl PinPaths {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn link(&self, program: &str) -> PathBuf {
        self.dir.join(link_file_name(program))
    }

    /// Where a new link is pinned before it is renamed over the old pin, so
    /// that the pin path never stands empty. (bpffs refuses dots in names.)
    pub fn link_staging(&self, program: &str) -> PathBuf {
        self.staging(&link_file_name(program))
    }

    /// Where a pin named `name` is made before it is renamed into place.
    pub fn staging(&self, name: &str) -> PathBuf {
        self.dir.join(format!("new_{name}"))
    }

    /// Whether the install here keeps the array layout's socket table: a
    /// fresh one does (on Linux 5.12 and later), an install of the hash
    /// layout has only the hash pinned.
    pub fn has_slots(&self) -> bool {
        self.map(names::SOCKET_SLOTS).exists() || !self.map(names::SOCKET_TABLE).exists()
    }

    /// The maps socklb pins here.
    pub fn maps(&self) -> impl Iterator<Item = (&'static str, PathBuf)> + '_ {
        let slots = self.has_slots().then_some(names::SOCKET_SLOTS);
        names::MAPS
            .iter()
            .copied()
            .chain(slots)
            .map(|name| (name, self.map(name)))
    }

    /// The link pins socklb owns here.
    pub fn links(&self) -> impl Iterator<Item = (&'static str, PathBuf)> + '_ {
        names::PROGRAMS
            .iter()
            .map(|program| (*program, self.link(program)))
    }

    /// Every pin socklb may own here, links first (removing them detaches),
    /// in the opposite order of attaching: the connect programs stop
    /// redirecting before the programs that follow sockets go.
    pub fn all(&self) -> Vec<PathBuf> {
        let staging = names::PROGRAMS
            .iter()
            .rev()
            .map(|program| self.link_staging(program));
        let links = names::PROGRAMS
            .iter()
            .rev()
            .map(|program| self.link(program));
        // The live counts go just before the socket table whose records
        // count in them, the array right after the hash: a table left
        // without its counts by an uninstall cut short is unpinned by the
        // next start, where counts left without their table would be
        // adopted.
        let own = names::MAPS
            .iter()
            .copied()
            .filter(|name| *name != names::BACKEND_CONNS)
            .flat_map(|name| {
                let table = name == names::SOCKET_TABLE;
                table
                    .then_some(names::BACKEND_CONNS)
                    .into_iter()
                    .chain([name])
                    .chain(table.then_some(names::SOCKET_SLOTS))
            });
        // Maps of the first layout, which an upgrade cut short may leave.
        let legacy = lb_common::names::v0::MAPS
            .iter()
            .copied()
            .filter(|name| *name != names::LEGACY_REDIRECTS);
        let map_names: Vec<&str> = own
            .chain([names::LEGACY_REDIRECTS, names::SOCKETS])
            .chain(legacy)
            .collect();
        let maps = map_names.iter().map(|name| self.map(name));
        // A map pinned again by a daemon killed before the rename.
        let map_staging = map_names.iter().map(|name| self.staging(name));
        staging
            .chain(links)
            .chain(maps)
            .chain(map_staging)
            .collect()
    }

    /// Whether anything of socklb is pinned here.
    pub fn any_pinned(&self) -> bool {
        self.all().iter().any(|path| path.exists())
    }
}

/// `statfs` magic of bpffs.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// Where bpffs lives by convention.
const BPFFS_MOUNT: &str = "/sys/fs/bpf";

fn fs_magic(path: &Path) -> Option<i64> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } == 0).then_some(stat.f_type as i64)
}

/// Makes sure the pin directory can live on bpffs. Some hosts boot without
/// bpffs mounted; as Cilium and bpftool do, socklb then mounts it at
/// /sys/fs/bpf (and only there), mode 0700. Returns whether it mounted it.
pub fn ensure_bpffs(paths: &PinPaths) -> Result<bool, KernelError> {
    let existing = paths
        .dir
        .ancestors()
        .find(|dir| dir.exists())
        .unwrap_or(Path::new("/"));
    if fs_magic(existing) == Some(BPF_FS_MAGIC) {
        return Ok(false);
    }
    let mount_point = Path::new(BPFFS_MOUNT);
    if !paths.dir.starts_with(mount_point) || existing != mount_point {
        return Err(KernelError::NotBpffs(paths.dir.clone()));
    }
    let source = c"bpf";
    let target = c"/sys/fs/bpf";
    let options = c"mode=0700";
    // SAFETY: plain mount(2) with static NUL-terminated strings.
    let result = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            source.as_ptr(),
            0,
            options.as_ptr().cast(),
        )
    };
    if result != 0 {
        return Err(KernelError::Mount {
            path: mount_point.to_path_buf(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(true)
}

/// Why a directory on the way to the pins is not safe to use: the pin
/// directory itself must be socklb's own and writable by it alone; a parent
/// may be root's, and shared only when sticky (as /sys/fs/bpf with mode 1777
/// is), so that nobody can rename our directory away.
fn unsafe_dir(path: &Path, final_dir: bool) -> Option<String> {
    let metadata = match std::fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(error) => return Some(error.to_string()),
    };
    if metadata.file_type().is_symlink() {
        return Some("is a symbolic link".into());
    }
    if !metadata.is_dir() {
        return Some("is not a directory".into());
    }
    let checked = if final_dir {
        trust::check(&metadata, Owner::Me)
            .map_err(|problem| format!("{problem} (socklb needs 0700)"))
    } else {
        trust::check_parent(&metadata)
    };
    checked.err()
}

/// Checks the pin directory and its parents, creating it (0700) when it is
/// missing. Refuses a directory another user owns or can write.
pub fn prepare_pin_dir(paths: &PinPaths) -> Result<(), KernelError> {
    let refuse = |path: &Path, problem: String| KernelError::UnsafePinDir {
        path: path.to_path_buf(),
        problem,
    };
    if let Some(parent) = paths.dir.parent() {
        for ancestor in parent.ancestors().filter(|dir| dir.exists()) {
            if let Some(problem) = unsafe_dir(ancestor, false) {
                return Err(refuse(ancestor, problem));
            }
        }
    }
    if std::fs::symlink_metadata(&paths.dir).is_err() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&paths.dir)
            .map_err(|source| KernelError::Io {
                path: paths.dir.clone(),
                source,
            })?;
    }
    match unsafe_dir(&paths.dir, true) {
        Some(problem) => Err(refuse(&paths.dir, problem)),
        None => Ok(()),
    }
}

/// Checks an existing pin directory without creating anything (for the
/// commands that only read or remove).
pub fn check_pin_dir(paths: &PinPaths) -> Result<(), KernelError> {
    match unsafe_dir(&paths.dir, true) {
        Some(problem) if paths.dir.exists() => Err(KernelError::UnsafePinDir {
            path: paths.dir.clone(),
            problem,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn link_and_map_paths() {
        let paths = PinPaths::new("/sys/fs/bpf/socklb");
        assert_eq!(
            paths.link(names::CONNECT4),
            PathBuf::from("/sys/fs/bpf/socklb/link_socklb_connect4")
        );
        assert_eq!(
            paths.map(names::SLOTS),
            PathBuf::from("/sys/fs/bpf/socklb/lb_slots_v1")
        );
        let all = paths.all();
        let first_map = all
            .iter()
            .position(|path| path.ends_with(names::SERVICES))
            .unwrap();
        assert!(
            all[..first_map]
                .iter()
                .all(|path| path.to_string_lossy().contains("link_")),
            "links come before maps"
        );
    }

    #[test]
    fn a_directory_others_can_write_is_refused() {
        let dir = std::env::temp_dir().join(format!("socklb-pins-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let paths = PinPaths::new(&dir);
        prepare_pin_dir(&paths).expect("creates it 0700");
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = prepare_pin_dir(&paths).unwrap_err().to_string();
        assert!(error.contains("lets group or others write"), "{error}");
        std::fs::remove_dir(&dir).unwrap();
        std::os::unix::fs::symlink("/tmp", &dir).unwrap();
        let error = prepare_pin_dir(&paths).unwrap_err().to_string();
        assert!(error.contains("symbolic link"), "{error}");
        std::fs::remove_file(&dir).unwrap();
    }
}
