//! A command run in the background in the idle scheduling class
//! (SCHED_IDLE), in the CPU that the builds and the suites, which mostly
//! wait on timers, leave. `cargo xtask test` runs its fuzz pass and the
//! build of upgrade.rs's old versions this way, and with
//! `--release-in-background` the image's release build.
//!
//! Why the idle class and not only nice 19: a nice-19 task still takes a
//! share, and in 4f91edd's CI run two of them (a fuzz pass and a build)
//! beside the 2-minute soak left probes of servers with no fault
//! unanswered within 500 ms. A woken task of the normal class preempts an
//! idle-class one at once.

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
    /// Starts `command` in the idle scheduling class (and at nice 19), in
    /// its own process group, with its output in `log`. `what` names it
    /// in messages. What it starts inherits the class.
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
        // SAFETY: sched_setscheduler, setpriority and prctl are
        // async-signal-safe, and the closure touches nothing else between
        // fork and exec. The death signal stops the command if xtask is
        // killed before its Drop can.
        unsafe {
            command.pre_exec(|| {
                let idle = libc::sched_param { sched_priority: 0 };
                if libc::sched_setscheduler(0, libc::SCHED_IDLE, &raw const idle) != 0
                    || libc::setpriority(libc::PRIO_PROCESS, 0, 19) != 0
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
            "xtask: {what}: started in the background (idle class; {})",
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
