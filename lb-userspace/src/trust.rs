//! Which files and directories socklb trusts: those that only root or
//! socklb's own user can change. The one home of that check, used for the
//! pin directory, the run directory (lock and control socket), the state
//! directory and the k3s state file.
//!
//! Whoever can write a file socklb reads, or rename entries in a directory
//! on its path, decides where connections go (a planted backend set) or
//! removes what socklb owns (its pins). So a trusted object:
//! - is owned by socklb's user ([`Owner::Me`], for what socklb creates) or
//!   by root or socklb's user ([`Owner::RootOrMe`], for what another root
//!   service writes, and for the directories above);
//! - cannot be written by group or others; a directory above may be, only
//!   when it is sticky (as /tmp and /sys/fs/bpf with mode 1777 are), since
//!   then nobody else can rename or remove an entry they do not own;
//! - is reached through symbolic links only when root or socklb's user
//!   owns each of them (the link's owner decides where it points).

use std::{
    ffi::OsString,
    fs::Metadata,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Component, Path, PathBuf},
};

/// Who may own an object socklb trusts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// socklb's own user (its effective uid): what socklb creates.
    Me,
    /// root or socklb's own user: what another root service writes (the
    /// k3s state file), and the directories on the way.
    RootOrMe,
}

/// Why socklb does not trust a path. `why` reads after "it": "is owned by
/// uid 65534, …", "mode 666 lets group or others write it".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} {why}", path.display())]
pub struct Untrusted {
    pub path: PathBuf,
    pub why: String,
}

/// Symbolic links followed on one path at most (as the kernel's ELOOP).
const MAX_LINKS: usize = 40;

/// socklb's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn owner_problem(metadata: &Metadata, owner: Owner) -> Option<String> {
    let uid = metadata.uid();
    let euid = euid();
    match owner {
        Owner::Me if uid != euid => Some(format!(
            "is owned by uid {uid}, not by this process (uid {euid})"
        )),
        Owner::RootOrMe if uid != 0 && uid != euid => Some(format!(
            "is owned by uid {uid}, neither root nor this process (uid {euid})"
        )),
        _ => None,
    }
}

/// Why an object (file or directory, its metadata read without following a
/// link) is not trusted: another owner, or group or others may write it.
pub fn check(metadata: &Metadata, owner: Owner) -> Result<(), String> {
    if let Some(problem) = owner_problem(metadata, owner) {
        return Err(problem);
    }
    let mode = metadata.permissions().mode();
    if mode & 0o022 != 0 {
        return Err(format!(
            "mode {:o} lets group or others write it",
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Like [`check`] for a directory above a trusted object: owned by root or
/// socklb's user, and writable by others only when sticky.
pub fn check_parent(metadata: &Metadata) -> Result<(), String> {
    if let Some(problem) = owner_problem(metadata, Owner::RootOrMe) {
        return Err(problem);
    }
    let mode = metadata.permissions().mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(format!(
            "mode {:o} lets others replace what is in it",
            mode & 0o7777
        ));
    }
    Ok(())
}

fn untrusted(path: &Path, why: impl Into<String>) -> Untrusted {
    Untrusted {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

fn lstat(path: &Path) -> Result<Metadata, Untrusted> {
    std::fs::symlink_metadata(path).map_err(|error| untrusted(path, error.to_string()))
}

/// The real path of the absolute `path`, every step to which is trusted:
/// each directory passes [`check_parent`], each symbolic link is owned by
/// root or socklb's user. The final object itself is the caller's to check
/// (after opening it with `O_NOFOLLOW`, on the descriptor).
pub fn resolve(path: &Path) -> Result<PathBuf, Untrusted> {
    if !path.is_absolute() {
        return Err(untrusted(path, "is not an absolute path"));
    }
    let root = Path::new("/");
    check_parent(&lstat(root)?).map_err(|why| untrusted(root, why))?;
    // Components still to walk, the next one last.
    let mut pending: Vec<OsString> = Vec::new();
    push_components(&mut pending, path);
    let mut resolved = PathBuf::from("/");
    let mut links = 0;
    while let Some(name) = pending.pop() {
        if name == ".." {
            resolved.pop();
            continue;
        }
        let candidate = resolved.join(&name);
        let metadata = lstat(&candidate)?;
        if metadata.file_type().is_symlink() {
            if let Some(problem) = owner_problem(&metadata, Owner::RootOrMe) {
                // "is owned by uid N, …" → "is a symbolic link owned by uid N, …"
                let problem = problem.replacen("is owned", "is a symbolic link owned", 1);
                return Err(untrusted(&candidate, problem));
            }
            links += 1;
            if links > MAX_LINKS {
                return Err(untrusted(path, "has too many levels of symbolic links"));
            }
            let target = std::fs::read_link(&candidate)
                .map_err(|error| untrusted(&candidate, error.to_string()))?;
            if target.is_absolute() {
                resolved = PathBuf::from("/");
            }
            push_components(&mut pending, &target);
            continue;
        }
        if pending.is_empty() {
            return Ok(candidate);
        }
        if !metadata.is_dir() {
            return Err(untrusted(&candidate, "is not a directory"));
        }
        check_parent(&metadata).map_err(|why| untrusted(&candidate, why))?;
        resolved = candidate;
    }
    Ok(resolved)
}

/// Pushes the named components of `path` (and `..`) so that its first one
/// is popped first.
fn push_components(pending: &mut Vec<OsString>, path: &Path) {
    let names: Vec<OsString> = path
        .components()
        .filter_map(|component| match component {
            Component::Normal(name) => Some(name.to_os_string()),
            Component::ParentDir => Some(OsString::from("..")),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    pending.extend(names.into_iter().rev());
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("socklb-trust-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    #[test]
    fn modes_that_let_others_write_are_refused() {
        let dir = temp_dir("modes");
        let file = dir.join("file");
        std::fs::write(&file, "x").unwrap();
        for (mode, trusted) in [(0o600, true), (0o644, true), (0o664, false), (0o666, false)] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
            let metadata = std::fs::symlink_metadata(&file).unwrap();
            assert_eq!(check(&metadata, Owner::Me).is_ok(), trusted, "{mode:o}");
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let open = check_parent(&std::fs::symlink_metadata(&dir).unwrap()).unwrap_err();
        assert!(open.contains("lets others replace"), "{open}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(check_parent(&std::fs::symlink_metadata(&dir).unwrap()).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn links_are_followed_and_dot_dot_walks_up() {
        let dir = temp_dir("links");
        std::fs::create_dir(dir.join("real")).unwrap();
        std::fs::write(dir.join("real/state.json"), "{}").unwrap();
        symlink("real", dir.join("alias")).unwrap();
        symlink(dir.join("alias/state.json"), dir.join("absolute")).unwrap();
        let real = dir.join("real/state.json");
        assert_eq!(resolve(&dir.join("alias/state.json")).unwrap(), real);
        assert_eq!(resolve(&dir.join("absolute")).unwrap(), real);
        assert_eq!(
            resolve(&dir.join("real/../alias/./state.json")).unwrap(),
            real
        );
        symlink("loop", dir.join("loop")).unwrap();
        let looped = resolve(&dir.join("loop")).unwrap_err();
        assert!(looped.why.contains("too many levels"), "{looped}");
        assert!(resolve(Path::new("relative/path")).is_err());
        let missing = resolve(&dir.join("missing/state.json")).unwrap_err();
        assert_eq!(missing.path, dir.join("missing"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_others_can_write_on_the_way_is_refused() {
        let dir = temp_dir("open-dir");
        std::fs::create_dir(dir.join("open")).unwrap();
        std::fs::write(dir.join("open/state.json"), "{}").unwrap();
        std::fs::set_permissions(dir.join("open"), std::fs::Permissions::from_mode(0o777)).unwrap();
        let refused = resolve(&dir.join("open/state.json")).unwrap_err();
        assert_eq!(refused.path, dir.join("open"));
        assert!(refused.why.contains("mode 777"), "{refused}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
