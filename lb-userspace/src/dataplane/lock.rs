//! One lock per install, shared by `run`, `uninstall` and `drain`, so that
//! exactly one process changes an install at a time.
//!
//! The lock is an open-file-description lock (F_OFD_SETLK) on a regular
//! file under /run/socklb, named after the pin directory. It is not a lock
//! on the pin directory itself: that directory can be removed (by
//! uninstall, or by someone else) and re-created, and a lock on the old
//! inode would then guard nothing. Unlike a classic POSIX lock, closing
//! another descriptor of the file never releases it. The holder writes its
//! pid into the file, so a refusal can say which process runs. The daemon's
//! control socket lives beside the lock.

use std::{
    fs::{DirBuilder, File, OpenOptions},
    io::{self, Seek, Write},
    os::{
        fd::AsRawFd,
        unix::fs::{DirBuilderExt, OpenOptionsExt},
    },
    path::{Path, PathBuf},
};

use super::{KernelError, PinPaths};
use crate::trust::{self, Owner};

/// Where socklb keeps its lock files and control sockets, unless
/// `SOCKLB_RUN_DIR` names another directory (a daemon that runs as a user
/// other than root keeps them in a directory of its own).
pub const RUN_DIR: &str = "/run/socklb";

/// The environment variable that overrides [`RUN_DIR`].
pub const RUN_DIR_ENV: &str = "SOCKLB_RUN_DIR";

/// [`RUN_DIR`], or the directory `SOCKLB_RUN_DIR` names.
pub fn run_dir() -> PathBuf {
    std::env::var_os(RUN_DIR_ENV)
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| PathBuf::from(RUN_DIR), PathBuf::from)
}

/// The file name that stands for a pin directory: its path with `/` as `-`
/// and `-` as `\x2d`, as systemd escapes paths, so that two pin
/// directories never share a name.
pub fn escaped(pin_dir: &Path) -> String {
    let text = pin_dir.to_string_lossy();
    let mut out = String::new();
    for character in text.trim_start_matches('/').chars() {
        match character {
            '/' => out.push('-'),
            '-' => out.push_str("\\x2d"),
            other => out.push(other),
        }
    }
    out
}

/// The lock file and control socket of one install.
#[derive(Debug, Clone)]
pub struct RunPaths {
    pub lock: PathBuf,
    pub control: PathBuf,
}

impl RunPaths {
    pub fn of(paths: &PinPaths) -> Self {
        let name = escaped(&paths.dir);
        let dir = run_dir();
        Self {
            lock: dir.join(format!("{name}.lock")),
            control: dir.join(format!("{name}.sock")),
        }
    }
}

/// The held lock; released when dropped (or when the process dies).
#[derive(Debug)]
pub struct InstallLock {
    _file: File,
}

/// Who holds the lock, if anyone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    Nobody,
    /// The pid the holder wrote (in its own pid namespace); 0 when it has
    /// not written it yet.
    Process(u32),
}

fn prepare_run_dir() -> Result<(), KernelError> {
    let dir = run_dir();
    let dir = dir.as_path();
    let io_error = |source| KernelError::Io {
        path: dir.to_path_buf(),
        source,
    };
    if !dir.exists() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_error)?;
    }
    let metadata = std::fs::symlink_metadata(dir).map_err(io_error)?;
    let refuse = |problem: String| KernelError::UnsafePinDir {
        path: dir.to_path_buf(),
        problem,
    };
    if !metadata.is_dir() {
        return Err(refuse("is not a directory".into()));
    }
    trust::check(&metadata, Owner::Me).map_err(refuse)
}

fn lock_request(kind: libc::c_short) -> libc::flock {
    // SAFETY: flock is plain data; all-zero is a valid start.
    let mut request: libc::flock = unsafe { std::mem::zeroed() };
    request.l_type = kind;
    request.l_whence = libc::SEEK_SET as libc::c_short;
    request
}

fn open_lock_file(path: &Path) -> Result<File, KernelError> {
    prepare_run_dir()?;
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|source| KernelError::Io {
            path: path.to_path_buf(),
            source,
        })
}

/// Who holds the lock of `paths`, without taking it.
pub fn holder(paths: &PinPaths) -> Result<Holder, KernelError> {
    let run = RunPaths::of(paths);
    if !run.lock.exists() {
        return Ok(Holder::Nobody);
    }
    let file = open_lock_file(&run.lock)?;
    let mut request = lock_request(libc::F_WRLCK as libc::c_short);
    // SAFETY: F_OFD_GETLK fills the flock struct we own.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut request) } != 0 {
        return Err(KernelError::Io {
            path: run.lock,
            source: io::Error::last_os_error(),
        });
    }
    if request.l_type == libc::F_UNLCK as libc::c_short {
        return Ok(Holder::Nobody);
    }
    let pid = std::fs::read_to_string(&run.lock)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(0);
    Ok(Holder::Process(pid))
}

/// Takes the lock of `paths` without waiting. `Err(Locked)` names the
/// holder when another process has it.
pub fn lock(paths: &PinPaths) -> Result<InstallLock, KernelError> {
    let run = RunPaths::of(paths);
    let mut file = open_lock_file(&run.lock)?;
    let request = lock_request(libc::F_WRLCK as libc::c_short);
    // SAFETY: F_OFD_SETLK reads the flock struct we own.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &request) } != 0 {
        let pid = match holder(paths)? {
            Holder::Process(pid) => pid,
            Holder::Nobody => 0,
        };
        return Err(KernelError::Locked {
            dir: paths.dir.clone(),
            pid,
        });
    }
    let _ = file.set_len(0);
    let _ = file.rewind();
    let _ = writeln!(file, "{}", std::process::id());
    Ok(InstallLock { _file: file })
}

/// Waits until the lock can be taken, at most `limit`.
pub fn lock_within(
    paths: &PinPaths,
    limit: std::time::Duration,
) -> Result<InstallLock, KernelError> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        match lock(paths) {
            Err(KernelError::Locked { .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_never_collide() {
        assert_eq!(
            escaped(Path::new("/sys/fs/bpf/socklb")),
            "sys-fs-bpf-socklb"
        );
        assert_ne!(
            escaped(Path::new("/sys/fs/bpf/a-b")),
            escaped(Path::new("/sys/fs/bpf/a/b"))
        );
    }
}
