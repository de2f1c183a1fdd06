//! The k3s/rke2 agent load-balancer state file, for example
//! `/var/lib/rancher/k3s/agent/etc/k3s-api-server-agent-load-balancer.json`:
//!
//! ```json
//! {"ServerURL": "https://10.0.0.1:6443",
//!  "ServerAddresses": ["10.0.0.1:6443", "10.0.0.2:6443"],
//!  "Listener": null}
//! ```
//!
//! `ServerAddresses` are the servers. `ServerURL` is the agent's `--server`,
//! its default server: a normal backend when it is also listed, a standby
//! when it is not (what the agent itself does with it). The agent rewrites
//! the file whole; the watcher follows its directory with inotify (through
//! `notify`) and reads the file again on every change, and every few
//! seconds in case an event was missed. A file that another user owns or
//! can write (or that is reached through such a directory or link) is
//! refused, saying why, and the last known set stays.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use notify::{RecursiveMode, Watcher};
use serde::Deserialize;
use tokio::sync::mpsc;
use tracing::debug;

use super::{BackendSet, Found, Report, Source, SourceEvent};
use crate::trust::{self, Owner};

/// A state file larger than this is not one.
const MAX_BYTES: u64 = 1 << 20;
/// How often the file is read even without an event.
const POLL: Duration = Duration::from_secs(5);
/// Events come in bursts (write, then rename): wait this long for quiet.
const SETTLE: Duration = Duration::from_millis(50);

#[derive(Debug, Deserialize)]
struct StateFile {
    #[serde(rename = "ServerURL", default)]
    server_url: Option<String>,
    #[serde(rename = "ServerAddresses", default)]
    server_addresses: Option<Vec<String>>,
}

/// An address as k3s writes it: `host:port`, host an IP (IPv6 in
/// brackets) or a name, which is resolved.
async fn resolve(text: &str) -> Result<Vec<SocketAddr>, String> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(vec![addr]);
    }
    let resolved = tokio::time::timeout(Duration::from_secs(5), tokio::net::lookup_host(text))
        .await
        .map_err(|_| format!("{text}: name lookup timed out"))?
        .map_err(|error| format!("{text}: {error}"))?;
    Ok(resolved.collect())
}

/// `https://host:port[/…]` → `host:port` (443 when the port is left out).
fn url_authority(url: &str) -> Option<String> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))?;
    let authority = rest.split('/').next()?;
    if authority.is_empty() {
        return None;
    }
    let has_port = match authority.rfind(']') {
        Some(close) => authority[close..].contains(':'),
        None => authority.contains(':'),
    };
    Some(if has_port {
        authority.to_string()
    } else {
        format!("{authority}:443")
    })
}

/// Parses the file's text into the backends it names.
pub async fn parse(text: &str) -> Result<BackendSet, String> {
    let state: StateFile =
        serde_json::from_str(text).map_err(|error| format!("not a k3s state file: {error}"))?;
    let mut set = BackendSet::new();
    let mut unresolved = Vec::new();
    for address in state.server_addresses.iter().flatten() {
        // One name that does not resolve leaves the others in the set.
        match resolve(address).await {
            Ok(addrs) => set.extend(addrs.into_iter().map(|addr| Found {
                addr,
                standby: false,
            })),
            Err(error) => unresolved.push(error),
        }
    }
    if !unresolved.is_empty() {
        if set.is_empty() {
            return Err(unresolved.join("; "));
        }
        tracing::warn!("k3s state file: left out: {}", unresolved.join("; "));
    }
    if let Some(url) = state.server_url.as_deref().filter(|url| !url.is_empty()) {
        let authority =
            url_authority(url).ok_or_else(|| format!("ServerURL {url:?} is not an https URL"))?;
        for addr in resolve(&authority).await? {
            if !set.iter().any(|found| found.addr == addr) {
                set.insert(Found {
                    addr,
                    standby: true,
                });
            }
        }
    }
    Ok(set)
}

/// Reads and parses the file once.
pub async fn read(path: &Path) -> Report {
    let text = match read_trusted(path) {
        Ok(text) => text,
        Err(error) => return Report::Failed(format!("{}: {error}", path.display())),
    };
    match parse(&text).await {
        Ok(set) => Report::Set(set),
        Err(error) => Report::Failed(format!("{}: {error}", path.display())),
    }
}

/// The file's text, if socklb may trust it: whoever can write it decides
/// where connections go. It must be root's (or socklb's user's) and
/// writable by nobody else, as must every directory on its path (or be
/// sticky) and every symbolic link to it (see [`crate::trust`]).
fn read_trusted(path: &Path) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let real = trust::resolve(path).map_err(|untrusted| format!("refused: {untrusted}"))?;
    // Not through a link swapped in since, never blocking on a FIFO.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&real)
        .map_err(|error| error.to_string())?;
    let metadata = file.metadata().map_err(|error| error.to_string())?;
    if !metadata.is_file() {
        return Err("not a regular file".into());
    }
    trust::check(&metadata, Owner::RootOrMe).map_err(|why| {
        format!(
            "refused: {} {why}; a state file must be root's (or socklb's user's) and writable by its owner alone",
            real.display()
        )
    })?;
    let mut text = String::new();
    file.take(MAX_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|error| error.to_string())?;
    if text.len() as u64 > MAX_BYTES {
        return Err("larger than 1 MiB".into());
    }
    Ok(text)
}

/// Follows the file until `events` is closed, reporting every change of
/// what it says (and the first reading).
pub async fn follow(service: String, path: PathBuf, events: mpsc::Sender<SourceEvent>) {
    let (changed_tx, mut changed) = mpsc::unbounded_channel::<()>();
    let file_name = path.file_name().map(ToOwned::to_owned);
    let mut watcher: Option<notify::RecommendedWatcher> = None;
    let mut last: Option<Report> = None;
    loop {
        if watcher.is_none() {
            watcher = watch_directory(&path, file_name.clone(), changed_tx.clone());
        }
        let report = read(&path).await;
        if last.as_ref() != Some(&report) {
            let event = SourceEvent {
                service: service.clone(),
                source: Source::K3sState,
                report: report.clone(),
            };
            if events.send(event).await.is_err() {
                return;
            }
            last = Some(report);
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            Some(()) = changed.recv() => {
                tokio::time::sleep(SETTLE).await;
                while changed.try_recv().is_ok() {}
            }
        }
        if events.is_closed() {
            return;
        }
    }
}

/// Watches the file's directory (the agent replaces the file, so a watch
/// on the file itself would end with the first rewrite). None while the
/// directory does not exist; the poll tries again.
fn watch_directory(
    path: &Path,
    file_name: Option<std::ffi::OsString>,
    changed: mpsc::UnboundedSender<()>,
) -> Option<notify::RecommendedWatcher> {
    let directory = path.parent()?;
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let ours = match &event {
            Ok(event) => {
                super::is_content_change(event)
                    && event
                        .paths
                        .iter()
                        .any(|changed| changed.file_name() == file_name.as_deref())
            }
            Err(_) => true,
        };
        if ours {
            let _ = changed.send(());
        }
    })
    .map_err(|error| debug!("k3s state: cannot watch: {error}"))
    .ok()?;
    watcher
        .watch(directory, RecursiveMode::NonRecursive)
        .map_err(|error| debug!("k3s state: cannot watch {}: {error}", directory.display()))
        .ok()?;
    Some(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(addr: &str, standby: bool) -> Found {
        Found {
            addr: addr.parse().unwrap(),
            standby,
        }
    }

    #[tokio::test]
    async fn default_server_listed_is_normal_unlisted_is_standby() {
        let listed = r#"{"ServerURL":"https://10.0.0.1:6443","ServerAddresses":["10.0.0.1:6443","10.0.0.2:6443"],"Listener":null}"#;
        assert_eq!(
            parse(listed).await.unwrap(),
            [found("10.0.0.1:6443", false), found("10.0.0.2:6443", false)].into()
        );
        let unlisted =
            r#"{"ServerURL":"https://10.0.0.9:6443","ServerAddresses":["10.0.0.2:6443"]}"#;
        assert_eq!(
            parse(unlisted).await.unwrap(),
            [found("10.0.0.2:6443", false), found("10.0.0.9:6443", true)].into()
        );
    }

    #[tokio::test]
    async fn ipv6_and_default_port() {
        let text = r#"{"ServerURL":"https://[fd00::1]","ServerAddresses":["[fd00::2]:9345"]}"#;
        assert_eq!(
            parse(text).await.unwrap(),
            [found("[fd00::1]:443", true), found("[fd00::2]:9345", false)].into()
        );
    }

    #[tokio::test]
    async fn empty_and_broken_files() {
        assert_eq!(
            parse(r#"{"ServerAddresses":null}"#).await.unwrap(),
            BackendSet::new()
        );
        assert!(
            parse("{")
                .await
                .unwrap_err()
                .contains("not a k3s state file")
        );
        assert!(
            parse(r#"{"ServerURL":"ftp://x"}"#)
                .await
                .unwrap_err()
                .contains("ServerURL")
        );
        assert!(parse(r#"{"ServerAddresses":["10.0.0.1"]}"#).await.is_err());
    }
}
