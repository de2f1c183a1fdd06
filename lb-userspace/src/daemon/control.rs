//! The daemon's control socket: how `socklb drain` reaches a running
//! daemon, which alone writes the maps while it runs.
//!
//! One JSON request per connection, one JSON reply. The socket lives in
//! /run/socklb (mode 0700) with mode 0600, and the daemon answers only a
//! peer with its own uid or root.

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt},
    net::{UnixListener, UnixStream},
    sync::{mpsc, oneshot},
};
use tracing::{debug, warn};

use super::accept::AcceptErrors;
pub use crate::protocol::{DaemonInfo, FleetInfo, ServiceSourcesInfo};

/// Longest request line the daemon reads.
const MAX_REQUEST_BYTES: u64 = 4096;
/// How long a client has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Request {
    /// Drain a backend (or, with `undo`, take it back).
    Drain { backend: String, undo: bool },
    /// What only the daemon knows, for `socklb status`.
    Info,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    /// What was done, or what is wrong (naming the field).
    pub message: String,
    /// The answer to `Info`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info: Option<DaemonInfo>,
}

impl Reply {
    pub fn text(ok: bool, message: impl Into<String>) -> Self {
        Self {
            ok,
            message: message.into(),
            info: None,
        }
    }
}

/// A request for the event loop, with the way back to its client.
pub struct Incoming {
    pub request: Request,
    pub reply: oneshot::Sender<Reply>,
}

/// Listens on `path` and hands each valid request to `requests`. Runs until
/// the receiver is gone.
pub fn serve(path: &Path, requests: mpsc::Sender<Incoming>) -> std::io::Result<()> {
    // A socket file left by a daemon that was killed refuses connections;
    // the install lock says nobody else serves this path.
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    tokio::spawn(async move {
        let mut errors = AcceptErrors::new("control socket");
        // Runs until the daemon's loop drops `requests`.
        loop {
            let Some((stream, _)) = errors.take(listener.accept().await).await else {
                continue;
            };
            let allowed = stream
                .peer_cred()
                .is_ok_and(|cred| cred.uid() == 0 || cred.uid() == euid);
            if !allowed {
                debug!("control socket: refused a peer of another user");
                continue;
            }
            if requests.is_closed() {
                return;
            }
            tokio::spawn(handle(stream, requests.clone()));
        }
    });
    Ok(())
}

async fn handle(stream: UnixStream, requests: mpsc::Sender<Incoming>) {
    let (reader, mut writer) = stream.into_split();
    let mut line = String::new();
    let mut limited =
        tokio::io::BufReader::new(tokio::io::AsyncReadExt::take(reader, MAX_REQUEST_BYTES));
    let read = tokio::time::timeout(REQUEST_TIMEOUT, limited.read_line(&mut line)).await;
    let reply = match read {
        Ok(Ok(_)) => match serde_json::from_str::<Request>(line.trim()) {
            Ok(request) => {
                let (reply, answer) = oneshot::channel();
                if requests.send(Incoming { request, reply }).await.is_err() {
                    return;
                }
                match answer.await {
                    Ok(reply) => reply,
                    Err(_) => return,
                }
            }
            Err(error) => Reply::text(false, format!("request: {error}")),
        },
        _ => return,
    };
    let mut text = serde_json::to_string(&reply).unwrap_or_default();
    text.push('\n');
    if let Err(error) = writer.write_all(text.as_bytes()).await {
        warn!("control socket: answering failed: {error}");
    }
}

/// Sends one request to the daemon at `path` and waits for its reply.
/// Blocking; for the CLI.
pub fn ask(path: &PathBuf, request: &Request) -> std::io::Result<Reply> {
    let mut stream = std::os::unix::net::UnixStream::connect(path)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let mut text = serde_json::to_string(request)?;
    text.push('\n');
    stream.write_all(text.as_bytes())?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    serde_json::from_str(line.trim()).map_err(std::io::Error::other)
}
