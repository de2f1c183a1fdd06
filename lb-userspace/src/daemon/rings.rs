//! The kernel's ring buffers: the failed connects that sock_ops reports,
//! which the event loop reads, and the programs' logs (aya-log), which a
//! task of their own forwards. Each is optional: a failure to open one
//! costs that feature only, and is said once.

use std::os::fd::AsRawFd;

use lb_common::{ConnectFailure, names};
use tokio::io::{Interest, unix::AsyncFd};
use tracing::warn;

use super::passive::parse_connect_failure;
use crate::{
    dataplane::{KernelError, PinPaths, Running, install},
    errors,
};

/// Why a ring buffer cannot be read.
#[derive(Debug, thiserror::Error)]
enum RingError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("the log map is found by program id, which needs CAP_SYS_ADMIN")]
    NoProgramId,
    #[error("opening the log map")]
    Log(#[source] aya_log::Error),
    #[error("registering it with the event loop")]
    Register(#[source] std::io::Error),
}

/// Registers a ring buffer (or its reader) for readiness.
fn readable<T: AsRawFd>(inner: T) -> Result<AsyncFd<T>, RingError> {
    // SAFETY: `inner` owns its descriptor and keeps it open and unchanged
    // until the AsyncFd drops it.
    unsafe { AsyncFd::register_with_interest(inner, Interest::READABLE) }
        .map_err(|error| RingError::Register(error.into()))
}

/// The ring the loop reads, if it could be opened.
pub struct Rings {
    failed_connects: Option<AsyncFd<aya::maps::RingBuf<aya::maps::MapData>>>,
}

impl Rings {
    pub fn open(paths: &PinPaths, running: &Running) -> Self {
        let failed_connects = install::open_connect_failures(paths)
            .map_err(RingError::from)
            .and_then(readable);
        // aya-log finds the log map through the program's id, which needs
        // CAP_SYS_ADMIN; without it the kernel's (debug) logs stay unread.
        let logs = running
            .ebpf
            .program(names::CONNECT4)
            .and_then(|program| program.info().ok())
            .map(|info| info.id())
            .ok_or(RingError::NoProgramId)
            .and_then(|id| aya_log::EbpfLogger::init_from_id(id).map_err(log_error))
            .and_then(readable);
        if let Some(mut logs) = without(logs, "kernel program logs will not be forwarded") {
            tokio::spawn(async move {
                while let Ok(mut guard) = logs.readable_mut().await {
                    guard.get_inner_mut().flush();
                    guard.clear_ready();
                }
            });
        }
        Self {
            failed_connects: without(
                failed_connects,
                "failed connects seen by the kernel will not be acted on",
            ),
        }
    }

    /// The next failed connects; pending forever without the ring.
    pub async fn failed_connects(&mut self) -> Vec<ConnectFailure> {
        let Some(ring) = self.failed_connects.as_mut() else {
            return std::future::pending().await;
        };
        let Ok(mut guard) = ring.readable_mut().await else {
            return Vec::new();
        };
        let mut records = Vec::new();
        while let Some(record) = guard.get_inner_mut().next() {
            records.extend(parse_connect_failure(&record));
        }
        guard.clear_ready();
        records
    }
}

fn log_error(error: aya_log::Error) -> RingError {
    match error {
        aya_log::Error::ProgramNotFound => RingError::NoProgramId,
        other => RingError::Log(other),
    }
}

/// The ring, or nothing, said once with what is lost.
fn without<T>(ring: Result<T, RingError>, lost: &str) -> Option<T> {
    ring.map_err(|error| warn!("{lost}: {}", errors::chain(&error)))
        .ok()
}
