//! Finding and checking cgroup v2 directories.

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

/// `statfs` magic of cgroup2.
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup2 file system is mounted (nothing of type cgroup2 in /proc/self/mounts)")]
    NoV2Mount,
    #[error("cannot read /proc/self/mounts: {0}")]
    Mounts(std::io::Error),
    #[error("--cgroup {path}: {problem}")]
    Invalid { path: PathBuf, problem: String },
}

/// The mount point of the cgroup v2 hierarchy, from /proc/self/mounts. On a
/// hybrid host that is usually /sys/fs/cgroup/unified, on a unified one
/// /sys/fs/cgroup.
pub fn v2_root() -> Result<PathBuf, CgroupError> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(CgroupError::Mounts)?;
    v2_root_from_mounts(&mounts).ok_or(CgroupError::NoV2Mount)
}

fn v2_root_from_mounts(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_source, target, fstype) = (fields.next()?, fields.next()?, fields.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(unescape_mount_path(target)))
    })
}

/// /proc/self/mounts writes space, tab, newline and backslash as octal.
fn unescape_mount_path(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let digits: String = chars.clone().take(3).collect();
            if let Ok(value) = u8::from_str_radix(&digits, 8) {
                out.push(value as char);
                for _ in 0..3 {
                    chars.next();
                }
                continue;
            }
        }
        out.push(c);
    }
    out
}

/// Checks that `path` is a directory of a cgroup v2 hierarchy and returns
/// its cgroup id (the directory's inode number).
pub fn check_v2_dir(path: &Path) -> Result<u64, CgroupError> {
    let invalid = |problem: String| CgroupError::Invalid {
        path: path.to_path_buf(),
        problem,
    };
    let metadata = std::fs::metadata(path).map_err(|error| invalid(error.to_string()))?;
    if !metadata.is_dir() {
        return Err(invalid("is not a directory".into()));
    }
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| invalid("contains a NUL byte".into()))?;
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(invalid(std::io::Error::last_os_error().to_string()));
    }
    if stat.f_type as i64 != CGROUP2_SUPER_MAGIC {
        return Err(invalid(
            "is not on a cgroup v2 file system (a v1 controller hierarchy cannot take socket programs)"
                .into(),
        ));
    }
    Ok(metadata.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_v2_mount_in_hybrid_and_unified_layouts() {
        let hybrid = "tmpfs /sys/fs/cgroup tmpfs ro 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n";
        assert_eq!(
            v2_root_from_mounts(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n";
        assert_eq!(
            v2_root_from_mounts(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(v2_root_from_mounts("proc /proc proc rw 0 0\n"), None);
        let escaped = "cgroup2 /mnt/my\\040cg cgroup2 rw 0 0\n";
        assert_eq!(
            v2_root_from_mounts(escaped),
            Some(PathBuf::from("/mnt/my cg"))
        );
    }

    #[test]
    fn rejects_a_plain_directory() {
        let error = check_v2_dir(Path::new("/tmp")).unwrap_err();
        assert!(error.to_string().contains("not on a cgroup v2"), "{error}");
    }
}
