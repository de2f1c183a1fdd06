//! Reading what socklb and the kernel say, each from its own source:
//! `socklb status --json`, `/metrics`, the pinned maps through bpftool,
//! the kernel's sockets through sock_diag, the daemon's log, and /proc.

use std::{
    collections::BTreeMap,
    io::{Read, Seek, SeekFrom},
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use lb_common::names;
use socklb_tests::{sockdiag, try_scrape_metrics};

use super::record::{LogLine, parse_log_line};

/// The daemon's log, read as it grows.
#[derive(Debug, Default)]
pub struct LogTail {
    path: PathBuf,
    offset: u64,
    partial: String,
    pub lines: Vec<LogLine>,
    /// Lines that are not tracing's (a panic's message goes to stderr).
    pub other: Vec<String>,
}

impl LogTail {
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            ..Self::default()
        }
    }

    /// Reads what was appended since the last call.
    pub fn poll(&mut self) {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return;
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut fresh = Vec::new();
        // Bounded per call; the next call reads on.
        let Ok(read) = file.by_ref().take(16 << 20).read_to_end(&mut fresh) else {
            return;
        };
        self.offset += read as u64;
        self.partial.push_str(&String::from_utf8_lossy(&fresh));
        let Some(end) = self.partial.rfind('\n') else {
            return;
        };
        let complete: String = self.partial.drain(..=end).collect();
        for line in complete.lines() {
            match parse_log_line(line) {
                Some(parsed) => self.lines.push(parsed),
                None if !line.trim().is_empty() => self.other.push(line.to_string()),
                None => {}
            }
        }
    }

    /// Lines that show a panic.
    pub fn panics(&self) -> Vec<String> {
        self.other
            .iter()
            .chain(self.lines.iter().map(|line| &line.text))
            .filter(|line| line.contains("panicked at"))
            .cloned()
            .collect()
    }
}

/// One backend's numbers, from one source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Numbers {
    pub live: i64,
    pub redirects: u64,
    pub failed_connects: u64,
}

/// `socklb status --json`: per backend address, and the whole report.
pub fn status_numbers(status: &serde_json::Value) -> BTreeMap<SocketAddr, (Numbers, bool)> {
    let mut numbers = BTreeMap::new();
    for service in status["services"].as_array().into_iter().flatten() {
        for backend in service["backends"].as_array().into_iter().flatten() {
            let Some(addr) = backend["addr"].as_str().and_then(|addr| addr.parse().ok()) else {
                continue;
            };
            numbers.insert(
                addr,
                (
                    Numbers {
                        live: backend["live"].as_i64().unwrap_or(i64::MIN),
                        redirects: backend["redirects"].as_u64().unwrap_or(u64::MAX),
                        failed_connects: backend["failed_connects"].as_u64().unwrap_or(u64::MAX),
                    },
                    backend["healthy"] == true && backend["probed"] == true,
                ),
            );
        }
    }
    numbers
}

/// The value of one label in a sample key like
/// `name{service="api",backend="1.2.3.4:5"}`.
pub fn label<'a>(key: &'a str, name: &str) -> Option<&'a str> {
    let start = key.find(&format!("{name}=\""))? + name.len() + 2;
    let end = key[start..].find('"')? + start;
    Some(&key[start..end])
}

/// `/metrics`, per backend address.
pub fn metrics_numbers(samples: &BTreeMap<String, f64>) -> BTreeMap<SocketAddr, Numbers> {
    let mut numbers: BTreeMap<SocketAddr, Numbers> = BTreeMap::new();
    for (key, value) in samples {
        let Some(addr) = label(key, "backend").and_then(|addr| addr.parse().ok()) else {
            continue;
        };
        let entry = numbers.entry(addr).or_default();
        if key.starts_with("socklb_backend_live_connections{") {
            entry.live = *value as i64;
        } else if key.starts_with("socklb_backend_redirects_total{") {
            entry.redirects = *value as u64;
        } else if key.starts_with("socklb_backend_failed_connects_total{") {
            entry.failed_connects = *value as u64;
        }
    }
    numbers
}

pub fn scrape(addr: SocketAddr) -> Result<BTreeMap<String, f64>> {
    try_scrape_metrics(addr, Duration::from_secs(3)).map_err(anyhow::Error::msg)
}

/// `bpftool -j map dump pinned PATH`.
pub fn bpftool_dump(path: &Path) -> Result<Vec<serde_json::Value>> {
    let output = Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(path)
        .output()
        .context("running bpftool (Debian package bpftool)")?;
    if !output.status.success() {
        bail!(
            "bpftool map dump {}: {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let value: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("bpftool's JSON")?;
    Ok(value.as_array().cloned().unwrap_or_default())
}

/// `bpftool -j map show pinned PATH`: type, entries the map can hold.
pub fn bpftool_show(path: &Path) -> Result<serde_json::Value> {
    let output = Command::new("bpftool")
        .args(["-j", "map", "show", "pinned"])
        .arg(path)
        .output()
        .context("running bpftool (Debian package bpftool)")?;
    if !output.status.success() {
        bail!(
            "bpftool map show {}: {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    serde_json::from_slice(&output.stdout).context("bpftool's JSON")
}

/// An Endpoint as bpftool prints it with BTF.
fn endpoint(value: &serde_json::Value) -> Option<SocketAddr> {
    let word = value["addr_be"][0].as_u64()? as u32;
    let port = value["port_be"].as_u64()? as u16;
    // The fields hold network-order bytes; bpftool prints them as native
    // integers.
    Some(SocketAddr::from((
        Ipv4Addr::from(word.to_ne_bytes()),
        u16::from_be(port),
    )))
}

/// The numbers of every backend in the pinned maps, read with bpftool.
pub fn map_numbers(pin_path: &Path) -> Result<BTreeMap<SocketAddr, Numbers>> {
    let backends = bpftool_dump(&pin_path.join(names::BACKENDS))?;
    let conns = bpftool_dump(&pin_path.join(names::BACKEND_CONNS))?;
    let stats = bpftool_dump(&pin_path.join(names::BACKEND_STATS))?;
    let by_id = |entries: &[serde_json::Value]| -> BTreeMap<u64, serde_json::Value> {
        entries
            .iter()
            .filter_map(|entry| {
                let formatted = &entry["formatted"];
                Some((formatted["key"].as_u64()?, formatted.clone()))
            })
            .collect()
    };
    let (conns, stats) = (by_id(&conns), by_id(&stats));
    let mut numbers = BTreeMap::new();
    for entry in &backends {
        let formatted = &entry["formatted"];
        let (Some(id), Some(addr)) = (
            formatted["key"].as_u64(),
            endpoint(&formatted["value"]["target"]),
        ) else {
            continue;
        };
        let conn = &conns
            .get(&id)
            .map(|c| c["value"].clone())
            .unwrap_or_default();
        let redirects: u64 = stats
            .get(&id)
            .and_then(|s| s["values"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|cpu| cpu["value"]["redirects"].as_u64())
            .sum();
        numbers.insert(
            addr,
            Numbers {
                live: conn["live"].as_i64().unwrap_or(i64::MIN),
                redirects,
                failed_connects: conn["failed_connects"].as_u64().unwrap_or(u64::MAX),
            },
        );
    }
    Ok(numbers)
}

/// Sockets of the clients' cgroup that are live (as sock_ops counts
/// them), per destination.
pub fn open_sockets(cgroup: &Path) -> Result<BTreeMap<SocketAddr, i64>> {
    use std::os::unix::fs::MetadataExt;
    let cgroup_id = std::fs::metadata(cgroup)?.ino();
    let mut counts = BTreeMap::new();
    for socket in sockdiag::dump_v4()? {
        if socket.cgroup_id == Some(cgroup_id) && socket.is_live() {
            *counts.entry(socket.peer).or_default() += 1;
        }
    }
    Ok(counts)
}

/// Every socket of the root namespace to `peer`, for the report of a
/// disagreement: state, and whose cgroup.
pub fn sockets_to(peer: SocketAddr, cgroup: &Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let ours = std::fs::metadata(cgroup).map(|meta| meta.ino()).ok();
    let Ok(sockets) = sockdiag::dump_v4() else {
        return vec!["sock_diag failed".into()];
    };
    sockets
        .iter()
        .filter(|socket| socket.peer == peer)
        .map(|socket| {
            let owner = match socket.cgroup_id {
                None => "timewait",
                Some(id) if Some(id) == ours => "clients",
                Some(_) => "another cgroup",
            };
            format!("{} state {} ({owner})", socket.local, socket.state)
        })
        .collect()
}

/// What the leak check samples.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub t_ms: u64,
    pub life: u32,
    /// Name → value.
    pub values: BTreeMap<String, f64>,
}

/// The daemon's resident memory (VmRSS), shown, not judged: it is the sum
/// of the two below.
pub const RSS: &str = "daemon RSS (KiB)";
/// The daemon's anonymous resident memory (RssAnon): what it allocated.
/// The memory a leak would grow.
pub const RSS_ANON: &str = "daemon anonymous memory (KiB)";
/// The daemon's file-backed resident memory (RssFile): pages of its binary
/// and libraries. Shown, not judged: bounded by the files mapped, and paged
/// in and out by the kernel.
pub const RSS_FILE: &str = "daemon file-backed memory (KiB)";

/// Where the anonymous memory is, shown, not judged (their sum is
/// [`RSS_ANON`]): the main heap (`[heap]`, malloc's first arena), the main
/// thread's stack, and the unnamed mappings (malloc's other arena, the
/// runtime's thread stacks, what the runtime maps itself).
pub const ANON_HEAP: &str = "daemon anonymous: [heap] (KiB)";
pub const ANON_STACK: &str = "daemon anonymous: [stack] (KiB)";
pub const ANON_UNNAMED: &str = "daemon anonymous: unnamed mappings (KiB)";

/// What the daemon holds in its malloc heap (`socklb_heap_bytes`, kind
/// `in_use`): judged. A leak of socklb's own state grows it, whatever the
/// allocator does with the pages.
pub const HEAP_IN_USE: &str = "daemon heap in use (KiB)";
/// What malloc keeps of what the daemon freed (kind `free`): shown.
pub const HEAP_FREE: &str = "daemon heap kept free (KiB)";

/// The daemon's own count of its heap, from /metrics. A daemon that does
/// not answer within half a second (stopped, starved) gives no sample.
pub fn heap_sample(metrics: SocketAddr, values: &mut BTreeMap<String, f64>) {
    let Ok(samples) = try_scrape_metrics(metrics, Duration::from_millis(500)) else {
        return;
    };
    for (kind, name) in [("in_use", HEAP_IN_USE), ("free", HEAP_FREE)] {
        if let Some(bytes) = samples.get(&format!("socklb_heap_bytes{{kind=\"{kind}\"}}")) {
            values.insert(name.into(), bytes / 1024.0);
        }
    }
}

/// The anonymous memory of /proc/PID/smaps by [`ANON_HEAP`],
/// [`ANON_STACK`] and [`ANON_UNNAMED`]; what is mapped from a file (a
/// binary's written data) is left out.
fn anonymous_by_mapping(pid: u32, values: &mut BTreeMap<String, f64>) {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) else {
        return;
    };
    let (mut heap, mut stack, mut unnamed) = (0.0, 0.0, 0.0);
    let mut current: Option<&str> = None;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: range, perms, offset, dev, inode, [name].
            current = Some(words.nth(4).unwrap_or(""));
        } else if first == "Anonymous:"
            && let Some(kib) = words.next().and_then(|value| value.parse::<f64>().ok())
        {
            match current {
                Some("[heap]") => heap += kib,
                Some("[stack]") => stack += kib,
                Some("") => unnamed += kib,
                _ => {}
            }
        }
    }
    values.insert(ANON_HEAP.into(), heap);
    values.insert(ANON_STACK.into(), stack);
    values.insert(ANON_UNNAMED.into(), unnamed);
}

/// A number from /proc/PID/status (`VmRSS:  1234 kB`).
fn proc_status(pid: u32, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|value| value.parse().ok())
}

/// The daemon's own resources: RSS, descriptors, threads, and the tasks of
/// its cgroup.
pub fn process_sample(pid: u32, cpu_cgroup: &Path, values: &mut BTreeMap<String, f64>) {
    if let Some(rss) = proc_status(pid, "VmRSS:") {
        values.insert(RSS.into(), rss);
    }
    // RSS is the memory the daemon allocated (anonymous) plus the pages
    // of its binary and libraries in memory (file-backed). Only the first
    // can leak; the second grows as code runs for the first time, and
    // shrinks when the kernel reclaims it under memory pressure.
    if let Some(anon) = proc_status(pid, "RssAnon:") {
        values.insert(RSS_ANON.into(), anon);
    }
    if let Some(file) = proc_status(pid, "RssFile:") {
        values.insert(RSS_FILE.into(), file);
    }
    anonymous_by_mapping(pid, values);
    if let Some(threads) = proc_status(pid, "Threads:") {
        values.insert("daemon threads".into(), threads);
    }
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        values.insert("daemon fds".into(), fds.count() as f64);
    }
    if let Ok(tasks) = std::fs::read_to_string(cpu_cgroup.join("tasks")) {
        values.insert("daemon cgroup tasks".into(), tasks.lines().count() as f64);
    }
}

/// Entries of every pinned map that has a count of entries (hash maps,
/// LRU maps, sockhashes); arrays and ring buffers are fixed.
pub fn map_sample(pin_path: &Path, values: &mut BTreeMap<String, f64>) {
    for name in names::MAPS.into_iter().chain([names::SOCKET_SLOTS]) {
        let path = pin_path.join(name);
        if !path.exists() {
            continue;
        }
        let Ok(show) = bpftool_show(&path) else {
            continue;
        };
        let kind = show["type"].as_str().unwrap_or_default().to_string();
        if kind == "sk_storage" {
            // Socket-local storage cannot be listed: count the sockets
            // that hold a record.
            use std::os::fd::AsFd;
            let records = socklb::dataplane::sys::open_pinned(&path)
                .and_then(|map| sockdiag::dump_v4_with_storage(map.as_fd()));
            if let Ok(sockets) = records {
                let count = sockets.iter().filter(|socket| socket.has_storage).count();
                values.insert(format!("map {name} records"), count as f64);
                // At a quiet checkpoint every record belongs to a live
                // connection: one that outlives its socket's life is a leak.
                let stale = sockets
                    .iter()
                    .filter(|socket| socket.has_storage && !socket.is_live())
                    .count();
                values.insert(
                    format!("map {name} records of sockets not live"),
                    stale as f64,
                );
            }
            continue;
        }
        if kind.contains("array") || kind == "ringbuf" {
            continue;
        }
        if let Ok(entries) = bpftool_dump(&path) {
            values.insert(format!("map {name} entries"), entries.len() as f64);
        }
    }
}

/// CPU time (user + system, in clock ticks) of a process and its threads.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime), counted from the state (field 3).
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_memory_by_mapping_sums_to_at_most_rss_anon() {
        // Memory this process surely holds in its heap or an arena.
        let held: Vec<u8> = vec![1; 4 << 20];
        let pid = std::process::id();
        let mut values = BTreeMap::new();
        anonymous_by_mapping(pid, &mut values);
        let parts = values[ANON_HEAP] + values[ANON_STACK] + values[ANON_UNNAMED];
        let anon = proc_status(pid, "RssAnon:").expect("RssAnon");
        assert!(parts >= 4096.0, "the 4 MiB held is in a part: {values:?}");
        assert!(values[ANON_STACK] > 0.0, "the main stack: {values:?}");
        // RssAnon counts the same pages; allow for what changed between
        // the two reads.
        assert!(parts <= anon + 1024.0, "{parts} of {anon}: {values:?}");
        assert_eq!(
            held.iter().map(|&byte| u64::from(byte)).sum::<u64>(),
            4 << 20
        );
    }
}
