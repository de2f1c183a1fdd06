//! A command run in the background at the lowest CPU priority (nice 19),
//! in the CPU that the suites, which mostly wait on timers, leave idle.
//! `cargo xtask test` runs its fuzz pass this way, and with
//! `--release-in-background` the image's release build.

use std::{
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result, bail};

/// A running background command; see [`Background::start`].
pub struct Background {
    what: String,
    child: Child,
    log: PathBuf,
    started: Instant,
    waited: bool,
}

impl Drop for Background {
    /// A run that ends before [`Background::finish`] (a failed test)
    /// stops the command and everything it started.
    fn drop(&mut self) {
        if self.waited {
            return;
        }
        if let Ok(group) = i32::try_from(self.child.id()) {
            // SAFETY: a signal to the process group this command started.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
        let _ = self.child.wait();
    }
}

impl Background {
    /// Starts `command` at nice 19 in its own process group, with its
    /// output in `log`. `what` names it in messages.
    pub fn start(what: &str, mut command: Command, log: PathBuf) -> Result<Background> {
        let output =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        command
            .stdin(Stdio::null())
            .stdout(output.try_clone()?)
            .stderr(output)
            // Its own process group, so that an early end stops the command
            // and its children together (Drop).
            .process_group(0);
        // SAFETY: setpriority and prctl are async-signal-safe, and the
        // closure touches nothing else between fork and exec. The death
        // signal stops the command if xtask is killed before its Drop can.
        unsafe {
            command.pre_exec(|| {
                if libc::setpriority(libc::PRIO_PROCESS, 0, 19) != 0
                    || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {what} in the background"))?;
        println!(
            "xtask: {what}: started in the background (nice 19; {})",
            log.display()
        );
        Ok(Background {
            what: what.to_string(),
            child,
            log,
            started: Instant::now(),
            waited: false,
        })
    }

    /// Waits for the command; prints the end of its log, and fails with
    /// it if the command failed.
    pub fn finish(mut self) -> Result<()> {
        // Only a wait that had to wait knows when the command ended.
        let (status, when) = match self.child.try_wait()? {
            Some(status) => (status, "ended before it was waited for".to_string()),
            None => {
                let status = self.child.wait()?;
                let took = self.started.elapsed().as_secs();
                (status, format!("ended {took} s after its start"))
            }
        };
        self.waited = true;
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let what = &self.what;
        if !status.success() {
            bail!(
                "{what} failed ({status}; {when}):\n{}",
                crate::last_lines(&text, 40)
            );
        }
        println!(
            "xtask: {what}: {when}; its log ends:\n{}",
            crate::last_lines(&text, 6)
        );
        Ok(())
    }
}
