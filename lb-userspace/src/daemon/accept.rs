//! What an accept loop does when `accept()` fails. An error of one
//! connection (it was reset before it was taken, a firewall refused it) is
//! skipped at once. Any other (out of descriptors, EMFILE; out of memory)
//! is said once and retried after a pause that doubles from 50 ms to 1 s,
//! instead of at once: the connection waits in the backlog and `accept()`
//! fails again immediately, so a loop that only continues spins a core
//! until descriptors free up.

use std::{io, time::Duration};

use tracing::{debug, info, warn};

const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// The state of one accept loop's failures.
#[derive(Debug)]
pub struct AcceptErrors {
    /// What accepts, for the log ("metrics", "control socket").
    what: &'static str,
    pause: Duration,
    /// A failure was said and no accept has succeeded since.
    failing: bool,
}

impl AcceptErrors {
    pub fn new(what: &'static str) -> Self {
        Self {
            what,
            pause: FIRST_PAUSE,
            failing: false,
        }
    }

    /// The connection `accept()` gave, or None once the pause its error
    /// asks for is over.
    pub async fn take<T>(&mut self, accepted: io::Result<T>) -> Option<T> {
        match accepted {
            Ok(connection) => {
                self.accepted();
                Some(connection)
            }
            Err(error) => {
                tokio::time::sleep(self.pause_after(&error)).await;
                None
            }
        }
    }

    /// After a failed `accept()`: how long to wait before the next one.
    pub fn pause_after(&mut self, error: &io::Error) -> Duration {
        if is_one_connections(error) {
            debug!("{}: accept: {error} (that connection only)", self.what);
            return Duration::ZERO;
        }
        if !self.failing {
            warn!(
                "{}: accept failed: {error}; trying again every {:?} or less until it succeeds",
                self.what, MAX_PAUSE
            );
            self.failing = true;
        }
        let pause = self.pause;
        self.pause = (self.pause * 2).min(MAX_PAUSE);
        pause
    }

    /// After an `accept()` that succeeded.
    pub fn accepted(&mut self) {
        if self.failing {
            info!("{}: accepting connections again", self.what);
            self.failing = false;
        }
        self.pause = FIRST_PAUSE;
    }
}

/// Errors that concern the connection being accepted, not the listener or
/// the process (accept(2): the pending network errors to retry at once).
fn is_one_connections(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(
            libc::ECONNABORTED
                | libc::EPROTO
                | libc::EPERM
                | libc::EINTR
                | libc::ENETDOWN
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_descriptors_pauses_and_doubles_one_connections_errors_do_not() {
        let mut errors = AcceptErrors::new("test");
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        let pauses: Vec<u128> = (0..7)
            .map(|_| errors.pause_after(&emfile).as_millis())
            .collect();
        assert_eq!(pauses, [50, 100, 200, 400, 800, 1000, 1000]);
        assert!(errors.failing);
        let aborted = io::Error::from_raw_os_error(libc::ECONNABORTED);
        assert_eq!(errors.pause_after(&aborted), Duration::ZERO);
        errors.accepted();
        assert!(!errors.failing);
        assert_eq!(errors.pause_after(&emfile), FIRST_PAUSE);
    }
}
