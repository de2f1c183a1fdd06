use std::time::Duration;

use anyhow::bail;
use socklb::{
    dataplane::{
        KernelError, PinPaths,
        lock::{self, InstallLock},
        pins, remove_pins,
    },
    privileges,
};

/// Detach socklb's programs and remove every pin it owns, and nothing else.
/// Refuses while a daemon runs on the pin path, unless --force, which stops
/// that daemon first (SIGTERM, then SIGKILL after 10 s).
///
/// Example: socklb uninstall --pin-path /sys/fs/bpf/socklb
#[derive(Debug, clap::Args)]
pub struct UninstallArgs {
    /// Stop the daemon that runs on this pin path first.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    pin: super::PinPathArg,
}

/// Takes the install lock, stopping its holder first if asked to.
fn take_lock(paths: &PinPaths, force: bool) -> anyhow::Result<InstallLock> {
    match lock::lock(paths) {
        Err(KernelError::Locked { pid, .. }) if force && pid != 0 => {
            super::print(&format!("stopping the socklb daemon (pid {pid})\n"));
            // SAFETY: kill(2) on the pid the lock holder wrote; the lock
            // is held, so that process is alive and is the daemon.
            unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            match lock::lock_within(paths, Duration::from_secs(10)) {
                Err(KernelError::Locked { .. }) => {
                    // SAFETY: as above.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                    Ok(lock::lock_within(paths, Duration::from_secs(5))?)
                }
                other => Ok(other?),
            }
        }
        Err(KernelError::Locked { pid, dir }) => bail!(
            "a socklb daemon (pid {pid}) runs on {}; stop it first, or use --force",
            dir.display()
        ),
        other => Ok(other?),
    }
}

pub fn uninstall(args: UninstallArgs) -> super::Outcome {
    privileges::require("uninstall", &privileges::ALL)?;
    let paths = PinPaths::new(&args.pin.pin_path);
    pins::check_pin_dir(&paths)?;
    let _lock = take_lock(&paths, args.force)?;
    if !paths.any_pinned() {
        // An uninstall cut short after its last unpin leaves the directory.
        let _ = std::fs::remove_dir(&paths.dir);
        super::print(&format!(
            "nothing of socklb is pinned under {}; nothing to do\n",
            paths.dir.display()
        ));
        return Ok(0);
    }
    let removal = remove_pins(&paths);
    let mut lines: String = removal
        .removed
        .iter()
        .map(|path| format!("removed {}\n", path.display()))
        .collect();
    if removal.accelerated_open > 0 {
        lines.push_str(&format!(
            "kept {}: {} accelerated sockets are still open; they carry on over the normal path, and removing it now would drop bytes queued for their readers. Run socklb uninstall again once they closed.\n",
            paths.map(lb_common::names::SOCKHASH).display(),
            removal.accelerated_open
        ));
    }
    super::print(&lines);
    Ok(0)
}
