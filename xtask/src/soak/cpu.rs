//! What the soak's own parts cost: CPU time of the harness, the clients,
//! the servers, etcd and socklb, each process read from /proc while it
//! runs (a server killed and started again is a new process, summed).

use std::collections::BTreeMap;

use super::observe::cpu_ticks;

/// CPU ticks of each process when first and last seen, by part.
#[derive(Debug, Default)]
pub struct CpuMeter {
    started_ms: u64,
    seen: BTreeMap<(&'static str, u32), (u64, u64)>,
    own: (u64, u64),
}

/// (user + system) of this process, and of its children it reaped (the
/// `socklb status`, bpftool, ip and etcdctl it ran).
fn own_ticks() -> (u64, u64) {
    let Ok(text) = std::fs::read_to_string("/proc/self/stat") else {
        return (0, 0);
    };
    let fields: Vec<u64> = text
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .map(|field| field.parse().unwrap_or(0))
                .collect()
        })
        .unwrap_or_default();
    // utime, stime, cutime, cstime: fields 14 to 17, counted from the
    // state (field 3).
    let field = |index: usize| fields.get(index).copied().unwrap_or(0);
    (field(11) + field(12), field(13) + field(14))
}

impl CpuMeter {
    pub fn start() -> Self {
        Self {
            started_ms: super::record::now_ms(),
            seen: BTreeMap::new(),
            own: own_ticks(),
        }
    }

    /// Takes a reading of one process of a part.
    pub fn observe(&mut self, part: &'static str, pid: u32) {
        if let Some(ticks) = cpu_ticks(pid) {
            self.seen.entry((part, pid)).or_insert((ticks, ticks)).1 = ticks;
        }
    }

    /// Each part's average share of one CPU over the run, in percent.
    pub fn finish(&self, end_ms: u64) -> Vec<(String, f64)> {
        // SAFETY: sysconf has no preconditions.
        let hertz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let seconds = end_ms.saturating_sub(self.started_ms) as f64 / 1000.0;
        let share = |ticks: u64| ticks as f64 / hertz / seconds.max(1.0) * 100.0;
        let (own, children) = own_ticks();
        let mut parts: BTreeMap<&'static str, u64> = BTreeMap::new();
        for ((part, _), (first, last)) in &self.seen {
            *parts.entry(part).or_default() += last - first;
        }
        let mut shares = vec![
            (
                "the harness (xtask)".to_string(),
                share(own.saturating_sub(self.own.0)),
            ),
            (
                "what it ran (socklb status, bpftool, ip, etcdctl)".to_string(),
                share(children.saturating_sub(self.own.1)),
            ),
        ];
        shares.extend(
            parts
                .into_iter()
                .map(|(part, ticks)| (part.to_string(), share(ticks))),
        );
        shares
    }
}
