//! SOAK.md and its timeline: the seed first, each invariant's verdict
//! with its figures, every violation with its time, faults and seed, the
//! leak slopes with what the run could resolve, and what the harness
//! itself cost.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use plotters::{coord::types::RangedCoordf64, prelude::*};

use super::{
    Outcome,
    catalogue::{CATALOGUE, Group, ServerEffect},
    lifecycle::Lifecycle,
    load,
    observe::{ANON_HEAP, ANON_STACK, ANON_UNNAMED, HEAP_FREE, RSS, RSS_FILE, Sample},
    record::{Applied, Count, Invariant, LogLine},
    verdicts::{AddressBook, Bounds, Slope, slope},
};

/// A life of socklb is sampled for the leak check once it is this old
/// (its first moments fill caches and pools).
const LIFE_WARMUP_MS: u64 = 30_000;
/// The daemon's memory is sampled for the leak check once a life is this
/// old: its heap reaches its working set only once each kind of work (a
/// reload, a relist, a failover, a sweep) has run in it. Seen in the long
/// life of seed 618430790 (SOAK-FINDINGS §8): anonymous memory 1,616 →
/// 1,764 KiB over its first 2 minutes, then between 1,624 and 1,888 KiB
/// for 11 minutes with no trend.
const MEMORY_WARMUP_MS: u64 = 3 * 60_000;
/// The daemon's memory is judged only over lives sampled this long after
/// their warm-up: a fit over a few minutes cannot tell a young process's
/// growth from a leak. A long run keeps one such life (the schedule's
/// `steady_daemon_ms`, at least 10 minutes, so at least 7 after the
/// warm-up).
const MEMORY_LIFE_MS: u64 = 6 * 60_000;

/// Transitions to unhealthy of a backend with no fault on its server
/// (within the bound after one): what load alone did.
pub fn spurious_transitions(
    lines: &[LogLine],
    applied: &[Applied],
    book: &AddressBook,
    bounds: Bounds,
) -> Vec<String> {
    let mut found = Vec::new();
    for line in lines {
        let Some((addr, rest)) = line.message().split_once(' ') else {
            continue;
        };
        let (Ok(addr), true) = (addr.parse::<SocketAddr>(), rest.starts_with("unhealthy:")) else {
            continue;
        };
        let Some(server) = book.servers.get(&addr) else {
            continue;
        };
        let explained = applied.iter().any(|fault| {
            let on_server = fault.planned.server == Some(*server)
                && fault.planned.spec().effect != ServerEffect::None;
            let end = fault
                .end_ms
                .unwrap_or(u64::MAX)
                .saturating_add(bounds.detect_ms);
            on_server && fault.start_ms <= line.t_ms + 200 && line.t_ms <= end
        });
        if !explained {
            let active: Vec<String> = applied
                .iter()
                .filter(|f| f.active_at(line.t_ms))
                .map(Applied::name)
                .collect();
            found.push(format!(
                "{} — faults active: {}",
                line.message(),
                list_or_none(&active)
            ));
        }
    }
    found
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".into()
    } else {
        items.join(", ")
    }
}

/// Each sampled value's slope after the warm-up: the daemon's own
/// figures from the samples taken every few seconds (each life fitted
/// around its own mean, from LIFE_WARMUP_MS into it), the maps' from the
/// quiet checkpoints (their entries follow the open connections).
pub fn slopes(
    process: &[Sample],
    checkpoints: &[Sample],
    life: &Lifecycle,
    warm_from_ms: u64,
) -> Vec<(String, Option<Slope>)> {
    let mut fitted = slopes_of(process, warm_from_ms, Some(life));
    fitted.extend(slopes_of(checkpoints, warm_from_ms, None));
    fitted
}

fn slopes_of(
    samples: &[Sample],
    warm_from_ms: u64,
    lives: Option<&Lifecycle>,
) -> Vec<(String, Option<Slope>)> {
    // A map's records follow the connections open (the clients paused
    // keep theirs, and socklb may close some): records of sockets that
    // are not live are what would leak.
    let names: std::collections::BTreeSet<&String> = samples
        .iter()
        .flat_map(|sample| sample.values.keys())
        .filter(|name| !name.ends_with(" records"))
        .collect();
    let grown = |sample: &Sample, warmup_ms: u64| {
        lives.is_none_or(|lives| {
            lives
                .incarnations
                .get(sample.life as usize)
                .is_some_and(|life| sample.t_ms >= life.started_ms + warmup_ms)
        })
    };
    names
        .into_iter()
        .map(|name| {
            let memory = is_memory(name);
            let warmup_ms = if memory {
                MEMORY_WARMUP_MS
            } else {
                LIFE_WARMUP_MS
            };
            let mut points: Vec<(u64, f64, u32)> = samples
                .iter()
                .filter(|sample| sample.t_ms >= warm_from_ms)
                .filter(|sample| grown(sample, warmup_ms))
                .filter_map(|sample| {
                    let life = if lives.is_some() { sample.life } else { 0 };
                    Some((sample.t_ms, *sample.values.get(name)?, life))
                })
                .collect();
            if memory && lives.is_some() {
                keep_long_lives(&mut points);
            }
            let unit = if memory { 4.0 } else { 1.0 };
            (name.clone(), slope(&points, unit))
        })
        .collect()
}

fn is_memory(name: &str) -> bool {
    name.contains("KiB")
}

/// Why a sampled figure is shown but its slope is no verdict; None for
/// the figures a leak would grow.
pub fn not_judged(name: &str) -> Option<&'static str> {
    match name {
        RSS => Some("shown: anonymous + file-backed"),
        RSS_FILE => Some("shown: pages of the binary and libraries, paged in and out"),
        ANON_HEAP | ANON_STACK | ANON_UNNAMED => Some("shown: where the anonymous memory is"),
        HEAP_FREE => Some("shown: what malloc keeps of what was freed"),
        _ => None,
    }
}

/// Whether a sampled figure's slope is a leak: it is judged, and grows by
/// more than the run can resolve.
pub fn is_leak(name: &str, slope: &Slope) -> bool {
    not_judged(name).is_none() && slope.grows()
}

/// The verdict column of the leak table.
fn slope_verdict(name: &str, slope: &Slope) -> String {
    match not_judged(name) {
        Some(why) => format!("{} ({why})", slope.trend()),
        None if slope.grows() => "**grows**".to_string(),
        None => slope.trend().to_string(),
    }
}

/// Drops the points of lives sampled for less than [`MEMORY_LIFE_MS`].
fn keep_long_lives(points: &mut Vec<(u64, f64, u32)>) {
    let mut spans: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for &(t_ms, _, life) in points.iter() {
        let span = spans.entry(life).or_insert((t_ms, t_ms));
        span.0 = span.0.min(t_ms);
        span.1 = span.1.max(t_ms);
    }
    points.retain(|(_, _, life)| {
        spans
            .get(life)
            .is_some_and(|(first, last)| last - first >= MEMORY_LIFE_MS)
    });
}

fn seconds(outcome: &Outcome, at_ms: u64) -> f64 {
    at_ms.saturating_sub(outcome.t0_ms) as f64 / 1000.0
}

/// The timeline's lanes: one per server, then one per other group.
fn lane(applied: &Applied) -> usize {
    match (applied.planned.spec().group, applied.planned.server) {
        (Group::Server, Some(server)) => server,
        (Group::Server, None) => 0,
        (Group::Daemon, _) => 5,
        (Group::Discovery, _) => 6,
        (Group::Kernel, _) => 7,
        (Group::Node, _) => 8,
    }
}

const LANES: [&str; 10] = [
    "s0",
    "s1",
    "s2",
    "s3",
    "s4",
    Group::Daemon.label(),
    Group::Discovery.label(),
    Group::Kernel.label(),
    Group::Node.label(),
    "violations",
];

fn group_color(group: Group) -> RGBColor {
    match group {
        Group::Server => RGBColor(31, 119, 180),
        Group::Daemon => RGBColor(255, 127, 14),
        Group::Discovery => RGBColor(44, 160, 44),
        Group::Kernel => RGBColor(148, 103, 189),
        Group::Node => RGBColor(140, 86, 75),
    }
}

type Chart<'a> = ChartContext<'a, SVGBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The fault timeline: a bar per fault in its lane, socklb's outages
/// shaded, the checkpoints as ticks, each violation a red cross.
fn draw_timeline(path: &Path, outcome: &Outcome) -> Result<()> {
    let end = seconds(outcome, outcome.end_ms).max(1.0);
    let root = SVGBackend::new(path, (1100, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let caption = format!(
        "seed {}: faults, outages (grey), checkpoints (|), violations (×)",
        outcome.schedule.seed
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..end, 0.0..LANES.len() as f64)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(LANES.len() * 2)
        .y_label_formatter(&|value| {
            let index = value.floor() as usize;
            let centre = (value - index as f64 - 0.5).abs() < 0.01;
            let label = LANES.get(index).filter(|_| centre);
            label.map_or(String::new(), |label| label.to_string())
        })
        .x_desc("seconds")
        .draw()?;
    draw_faults(&mut chart, outcome)?;
    draw_marks(&mut chart, outcome)?;
    root.present()?;
    Ok(())
}

/// Outages, then a bar per fault with its name.
fn draw_faults(chart: &mut Chart, outcome: &Outcome) -> Result<()> {
    let bottom = (LANES.len() - 1) as f64;
    for outage in &outcome.outages {
        let from = seconds(outcome, outage.from_ms);
        let to = seconds(outcome, outage.to_ms.unwrap_or(outcome.end_ms));
        let shade = RGBColor(220, 220, 220).filled();
        chart.draw_series(std::iter::once(Rectangle::new(
            [(from, 0.0), (to, bottom)],
            shade,
        )))?;
    }
    for fault in &outcome.applied {
        let row = lane(fault) as f64;
        let from = seconds(outcome, fault.start_ms);
        let to = seconds(outcome, fault.end_ms.unwrap_or(outcome.end_ms)).max(from + 0.3);
        let color = group_color(fault.planned.spec().group).mix(0.75).filled();
        chart.draw_series(std::iter::once(Rectangle::new(
            [(from, row + 0.15), (to, row + 0.85)],
            color,
        )))?;
        let name = fault
            .planned
            .spec()
            .name
            .trim_start_matches("server-")
            .to_string();
        let font = ("sans-serif", 9).into_font().color(&BLACK);
        chart.draw_series(std::iter::once(Text::new(name, (from, row + 0.95), font)))?;
    }
    Ok(())
}

/// The checkpoints, and one cross per second and invariant however many
/// violations.
fn draw_marks(chart: &mut Chart, outcome: &Outcome) -> Result<()> {
    let bottom = (LANES.len() - 1) as f64;
    for checked in &outcome.checked {
        let at = seconds(outcome, checked.at_ms);
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(at, 0.0), (at, bottom)],
            BLACK.mix(0.4),
        )))?;
    }
    let marks: std::collections::BTreeSet<(u64, Invariant)> = outcome
        .violations
        .iter()
        .map(|violation| {
            (
                violation.at_ms.saturating_sub(outcome.t0_ms) / 1000,
                violation.invariant,
            )
        })
        .collect();
    let rows = Invariant::ALL.len() as f64;
    chart.draw_series(marks.iter().map(|(second, invariant)| {
        let row = Invariant::ALL
            .iter()
            .position(|each| each == invariant)
            .unwrap_or(0) as f64;
        let y = bottom + 0.1 + 0.8 * row / rows;
        Cross::new((*second as f64, y), 4, RED.stroke_width(2))
    }))?;
    Ok(())
}

fn verdict(outcome: &Outcome, invariant: Invariant) -> String {
    let count = outcome
        .violations
        .iter()
        .filter(|v| v.invariant == invariant)
        .count();
    if count == 0 {
        "held".into()
    } else {
        format!("**{count} violations**")
    }
}

/// The short id of the commit checked out now, with `-dirty` if the tree
/// has changes it does not hold (the run then measured those too).
pub fn head_commit() -> String {
    std::process::Command::new("git")
        .args([
            "-C",
            &crate::workspace_root().display().to_string(),
            "describe",
            // No tag names: the commit's own short id.
            "--exclude=*",
            "--always",
            "--dirty",
            "--abbrev=7",
        ])
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_string())
        .unwrap_or_default()
}

fn header(text: &mut String, outcome: &Outcome, minutes: f64) {
    let seed = outcome.schedule.seed;
    let commit = &outcome.commit;
    let _ = writeln!(text, "# Soak: socklb under overlapping faults\n");
    let _ = writeln!(
        text,
        "**Seed {seed}.** Replay: `cargo xtask soak --minutes {} --seed {seed}` (the same seed draws the same faults, \
         in the same order, on the same targets, for the same durations, with the same harness). Written by \
         `cargo xtask soak` at commit `{commit}`; {minutes:.1} minutes, {} faults, {} checkpoints, {} violations. \
         What the soak has found so far, each with its seed and a reduced reproduction: \
         [SOAK-FINDINGS.md](SOAK-FINDINGS.md).\n",
        outcome.schedule.run_ms / 60_000,
        outcome.applied.len(),
        outcome.checked.len(),
        outcome.violations.len()
    );
}

/// Which socklb binary the run's daemon was (SOCKLB_BIN), as the report
/// names it.
fn daemon_build() -> String {
    let path = std::env::var("SOCKLB_BIN").unwrap_or_default();
    let root = crate::workspace_root();
    let shown = std::path::Path::new(&path)
        .strip_prefix(&root)
        .map_or(path.clone(), |relative| relative.display().to_string());
    if path.ends_with("/release/socklb") {
        format!("`{shown}` (the release build, as it ships)")
    } else if path.ends_with("/debug/socklb") {
        format!("`{shown}` (a debug build)")
    } else {
        format!("`{shown}` (SOCKLB_BIN)")
    }
}

fn setup(text: &mut String, outcome: &Outcome) {
    let bounds = outcome.bounds;
    let _ = writeln!(
        text,
        "## Setup\n\n\
         - Five server namespaces on a bridge (198.18.0.0/15), each running `soakserver`: HTTPS on :6443 (`/readyz`, \
         `/hello`, and `/watch`, a watch-like response of a chunk a second) with a certificate the clients verify, \
         and the same in plain HTTP on :7000; Debian's etcd on the first three (TLS with client certificates).\n\
         - socklb, in a v1 cpu and a v1 memory cgroup of its own (this machine's cgroups are hybrid: v2 has no \
         controllers, so `cpu.max` and `memory.high` do not exist; `cpu-starve` sets `cpu.cfs_quota_us` to {}% of \
         one CPU, `memory-pressure` sets `memory.soft_limit_in_bytes` to the usage and `memory.limit_in_bytes` {} MiB \
         above it), with three services: `api` (least-conn, close-on-failure, \
         rebalance, slow start 10 s; backends from a k3s state file and the EndpointSlice of `default/kubernetes` \
         served by the test apiserver; probe `apiserver` with the CA), `plain` (least-conn, close-on-failure, slow \
         start; static backends: the five servers and a sixth on this host, in the clients' cgroup, which sockmap \
         acceleration applies to; probe `http:/readyz`; acceleration toggled by a config edit) and `etcd` \
         (probe `etcd` with a client certificate); `--watch-config` and `--metrics-addr`. Health: interval {} ms, \
         timeout {} ms, rise {}, fall {}.\n\
         - The daemon: {}.\n\
         - Clients in a child cgroup v2: {} new connections a second ({}% TLS), {} keep-alive clients in {} processes \
         with a request a second ({} of them watchers), an etcdctl call every {} s. Each new connection records where \
         the kernel sent it (a sock_diag lookup right after connect()).\n\
         - Bounds, from the health settings: a fault is detected (the server out of the tables, its connections \
         closed) within **{} ms** (interval + 20% jitter, then fall − 1 more probes at max(interval, timeout), the \
         last one's timeout, and {} ms of slack for the event loop and two shared cores); a server is back within \
         {} ms; a repair within {} ms. Time socklb was killed, stopped or restarting does not count against a bound.\n",
        super::nemesis::STARVED_PERCENT,
        super::nemesis::MEMORY_HEADROOM >> 20,
        super::config::INTERVAL.as_millis(),
        super::config::TIMEOUT.as_millis(),
        super::config::RISE,
        super::config::FALL,
        daemon_build(),
        load::SHORT_RATE,
        load::SHORT_TLS_PERCENT,
        load::KEEPALIVE_PROCESSES * load::KEEPALIVE_PER_PROCESS,
        load::KEEPALIVE_PROCESSES,
        load::KEEPALIVE_PROCESSES * load::WATCHERS_PER_PROCESS,
        load::ETCD_EVERY.as_secs(),
        bounds.detect_ms,
        super::verdicts::SLACK.as_millis(),
        bounds.rise_ms,
        bounds.repair_ms,
    );
}

fn faults(text: &mut String, outcome: &Outcome) {
    let _ = writeln!(
        text,
        "## The faults\n\n![fault timeline](soak-timeline.svg)\n"
    );
    let _ = writeln!(
        text,
        "| fault | what the nemesis does | drawn |\n| --- | --- | --- |"
    );
    for spec in CATALOGUE {
        let drawn = outcome
            .applied
            .iter()
            .filter(|f| f.planned.kind == spec.kind)
            .count();
        let _ = writeln!(text, "| {} | {} | {drawn} |", spec.name, spec.what);
    }
    let _ = writeln!(
        text,
        "\n<details><summary>Every fault as applied</summary>\n\n| start (s) | end (s) | fault | notes |\n| --- | --- | --- | --- |"
    );
    for fault in &outcome.applied {
        let _ = writeln!(
            text,
            "| {:.1} | {} | {} | {} |",
            seconds(outcome, fault.start_ms),
            fault
                .end_ms
                .map_or("—".into(), |end| format!("{:.1}", seconds(outcome, end))),
            fault.name(),
            fault.notes.join("; ")
        );
    }
    let _ = writeln!(text, "\n</details>\n");
}

fn connects(text: &mut String, outcome: &Outcome) {
    let verdict_connects = &outcome.connects;
    let _ = writeln!(
        text,
        "### {} — {}\n\n| clients | new connections | failed |\n| --- | --- | --- |",
        Invariant::ConnectsSucceed.title(),
        verdict(outcome, Invariant::ConnectsSucceed)
    );
    for (kind, (total, failed)) in &verdict_connects.by_kind {
        let _ = writeln!(text, "| {} | {total} | {failed} |", kind.label());
    }
    let failed: u64 = verdict_connects
        .by_kind
        .values()
        .map(|(_, failed)| failed)
        .sum();
    let _ = writeln!(
        text,
        "\nOf {failed} failed, {} fell within the bound after a fault on their server (or a repair), {} outside. \
         {} connections' destination was not found by the lookup (a refused connect can be gone before it); \
         {} answers came from a server other than the one the lookup found. Requests that failed on open \
         connections: {}; connections that ended between requests: {}; ticks with no free worker: {}.\n",
        verdict_connects.allowed,
        outcome
            .violations
            .iter()
            .filter(|v| v.invariant == Invariant::ConnectsSucceed)
            .count(),
        verdict_connects.unknown_destination,
        verdict_connects.mismatched,
        outcome.recorded.request_failures.len(),
        outcome.recorded.ended.len(),
        outcome.recorded.skipped,
    );
    let _ = writeln!(
        text,
        "### {} — {}\n\nEvery new connection's destination was checked against the faults: none may reach a server \
         more than {} ms after it was killed, hung, blackholed or moved away from that address.\n",
        Invariant::NoStaleChoice.title(),
        verdict(outcome, Invariant::NoStaleChoice),
        outcome.bounds.detect_ms
    );
}

fn agreement(text: &mut String, outcome: &Outcome) {
    let _ = writeln!(
        text,
        "### {} — {}\n\nAt each checkpoint the faults are over, socklb has every backend healthy and the clients are \
         paused; then each backend's live count (status) must equal the client cgroup's live sockets to it \
         (sock_diag), and status, /metrics and the pinned maps (bpftool) must give the same live, redirect and \
         failed-connect counts.\n\n| checkpoint (s) | settled after (ms) | readings | backends | live sockets | agreed |\n| --- | --- | --- | --- | --- | --- |",
        Invariant::ExactAgreement.title(),
        verdict(outcome, Invariant::ExactAgreement)
    );
    for checked in &outcome.checked {
        let live: i64 = checked.rows.iter().map(|row| row.sockets).sum();
        let _ = writeln!(
            text,
            "| {:.1} | {} | {} | {} | {live} | {} |",
            seconds(outcome, checked.at_ms),
            checked.settle_ms,
            checked.readings,
            checked.rows.len(),
            if checked.agreed { "yes" } else { "**no**" }
        );
    }
    text.push('\n');
}

fn silent(text: &mut String, outcome: &Outcome) {
    let verdict_silent = &outcome.silent;
    let counted = outcome
        .checked
        .iter()
        .flat_map(|c| &c.counters)
        .filter(|(_, _, equal)| *equal)
        .count();
    let compared = outcome
        .checked
        .iter()
        .map(|c| c.counters.len())
        .sum::<usize>();
    let _ = writeln!(
        text,
        "### {} — {}\n\nEach fault's start and end say what socklb must log within its bound (a transition per \
         backend, a reload result, a discovery change or problem, a repair): {} such expectations were checked, \
         {} left unjudged because a socklb outage overlapped them. At each checkpoint, each counter of the running \
         socklb (transitions, reloads, discovery updates and problems, rebalance moves) was compared with its own log \
         lines, and the repairs counted since install with the repair lines: {counted} of {compared} comparisons equal.\n",
        Invariant::NothingSilent.title(),
        verdict(outcome, Invariant::NothingSilent),
        verdict_silent.checked,
        verdict_silent.unjudged,
    );
    if !verdict_silent.observations.is_empty() || !outcome.spurious.is_empty() {
        let _ = writeln!(text, "Observations (not violations):\n");
        for observation in &verdict_silent.observations {
            let _ = writeln!(text, "- slow server taken out: {observation}");
        }
        for spurious in outcome.spurious.iter().take(20) {
            let _ = writeln!(
                text,
                "- a backend with no fault of its own taken out: {spurious}"
            );
        }
        if outcome.spurious.len() > 20 {
            let _ = writeln!(text, "- … {} more", outcome.spurious.len() - 20);
        }
        text.push('\n');
    }
}

fn leaks(text: &mut String, outcome: &Outcome) {
    let _ = writeln!(
        text,
        "### {} — {}\n\nAfter the warm-up: socklb's memory, descriptors, threads and its cgroup's tasks every {} s \
         on average, at seeded random moments from half to one and a half that apart (nothing the daemon does on a \
         period of its own, its heap trim or its probes, can then hold one phase against the readings and draw a \
         slope), from {} s into each of its lives, each life fitted around its own mean (a restart resets them; its \
         memory from \
         {} min into a life, once each kind of work has run in it, and only over lives sampled {} min or more after \
         that: a younger process is mostly warm-up). Its RSS is shown with its two parts: \
         the anonymous memory is what it allocated, the memory a leak grows, and is judged; the file-backed part is the \
         pages of its binary and libraries, which grow as code runs for the first time and shrink when the kernel \
         reclaims them, and is shown, not judged. Where the anonymous memory is (the main heap, the main thread's \
         stack, the unnamed mappings: malloc's other arena and the runtime's thread stacks, from /proc/PID/smaps) is \
         shown too, and so is what malloc keeps of what was freed; what the daemon holds in its heap (its own count, \
         `socklb_heap_bytes` from /metrics) is judged. Also the entries \
         of every pinned map and the per-socket records of sockets that are no longer live at each quiet \
         checkpoint (once a minute, clients paused; the records of live sockets are shown, not judged: they follow \
         the connections open). The resolution is twice the slope's standard error, and at least one unit over the \
         span sampled: a slope within it is flat as far as this run can tell.\n\n| sampled | first | last | slope per hour | resolution per hour | samples | verdict |\n| --- | --- | --- | --- | --- | --- | --- |",
        Invariant::NoLeak.title(),
        verdict(outcome, Invariant::NoLeak),
        super::PROCESS_SAMPLING.as_secs(),
        LIFE_WARMUP_MS / 1000,
        MEMORY_WARMUP_MS / 60_000,
        MEMORY_LIFE_MS / 60_000,
    );
    for (name, fitted) in &outcome.slopes {
        let values: Vec<f64> = outcome
            .process_samples
            .iter()
            .chain(&outcome.samples)
            .filter_map(|s| s.values.get(name).copied())
            .collect();
        let (first, last) = (
            values.first().copied().unwrap_or(0.0),
            values.last().copied().unwrap_or(0.0),
        );
        match fitted {
            Some(fitted) => {
                let _ = writeln!(
                    text,
                    "| {name} | {first:.0} | {last:.0} | {:+.1} | ±{:.1} | {} | {} |",
                    fitted.per_hour,
                    fitted.resolution_per_hour,
                    fitted.samples,
                    slope_verdict(name, fitted)
                );
            }
            None => {
                let why = if is_memory(name) {
                    format!(
                        "not judged: no life sampled {} min",
                        MEMORY_LIFE_MS / 60_000
                    )
                } else {
                    "too few samples".to_string()
                };
                let _ = writeln!(
                    text,
                    "| {name} | {first:.0} | {last:.0} | — | — | {} | {why} |",
                    values.len()
                );
            }
        }
    }
    text.push('\n');
}

fn crashes(text: &mut String, outcome: &Outcome) {
    let _ = writeln!(
        text,
        "### {} — {}\n\n| socklb PID | started (s) | ended (s) | how it ended |\n| --- | --- | --- | --- |",
        Invariant::NoCrash.title(),
        verdict(outcome, Invariant::NoCrash)
    );
    for life in &outcome.lives {
        let _ = writeln!(
            text,
            "| {} | {:.1} | {} | {} |",
            life.pid,
            seconds(outcome, life.started_ms),
            life.ended_ms
                .map_or("—".into(), |end| format!("{:.1}", seconds(outcome, end))),
            life.end.as_deref().unwrap_or("—")
        );
    }
    text.push('\n');
}

/// Violations shown per invariant; the rest are counted.
const SHOWN_PER_INVARIANT: usize = 40;

fn violations(text: &mut String, outcome: &Outcome) {
    let _ = writeln!(text, "## Violations\n");
    if outcome.violations.is_empty() {
        let _ = writeln!(text, "None.\n");
    }
    for invariant in Invariant::ALL {
        let found: Vec<_> = outcome
            .violations
            .iter()
            .filter(|v| v.invariant == invariant)
            .collect();
        if found.is_empty() {
            continue;
        }
        let _ = writeln!(
            text,
            "### {} ({})\n\n| time (s) | faults active | what |\n| --- | --- | --- |",
            invariant.title(),
            found.len()
        );
        for violation in found.iter().take(SHOWN_PER_INVARIANT) {
            let _ = writeln!(
                text,
                "| {:.1} | {} | {} |",
                seconds(outcome, violation.at_ms),
                list_or_none(&violation.active),
                violation.what.replace('|', "\\|")
            );
        }
        if found.len() > SHOWN_PER_INVARIANT {
            let _ = writeln!(text, "\n… and {} more.", found.len() - SHOWN_PER_INVARIANT);
        }
        text.push('\n');
    }
    if !outcome.harness_problems.is_empty() {
        let _ = writeln!(
            text,
            "Harness problems (the run did not test all it meant to):\n"
        );
        for problem in &outcome.harness_problems {
            let _ = writeln!(text, "- {problem}");
        }
        text.push('\n');
    }
}

fn cost(text: &mut String, outcome: &Outcome) {
    let _ = writeln!(
        text,
        "## What the harness cost\n\nAverage share of one CPU over the run (two shared cores):\n"
    );
    for (part, share) in &outcome.cpu {
        let _ = writeln!(text, "- {part}: {share:.1}%");
    }
    let expectations: usize = outcome.applied.iter().map(|f| f.expectations.len()).sum();
    let exact = outcome
        .applied
        .iter()
        .flat_map(|f| &f.expectations)
        .filter(|e| matches!(e.count, Count::Exactly(_)))
        .count();
    let _ = writeln!(
        text,
        "\n{expectations} log expectations were set ({exact} of them exact counts)."
    );
}

/// Writes SOAK.md at `path` and soak-timeline.svg beside it.
pub fn write(path: &Path, outcome: &Outcome) -> Result<PathBuf> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    draw_timeline(&dir.join("soak-timeline.svg"), outcome).context("drawing the timeline")?;
    let minutes = (outcome.end_ms.saturating_sub(outcome.t0_ms)) as f64 / 60_000.0;
    let mut text = String::new();
    header(&mut text, outcome, minutes);
    let _ = writeln!(text, "| invariant | verdict |\n| --- | --- |");
    for invariant in Invariant::ALL {
        let _ = writeln!(
            text,
            "| {} | {} |",
            invariant.title(),
            verdict(outcome, invariant)
        );
    }
    text.push('\n');
    setup(&mut text, outcome);
    faults(&mut text, outcome);
    let _ = writeln!(text, "## The invariants\n");
    connects(&mut text, outcome);
    agreement(&mut text, outcome);
    silent(&mut text, outcome);
    leaks(&mut text, outcome);
    crashes(&mut text, outcome);
    violations(&mut text, outcome);
    cost(&mut text, outcome);
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soak::observe::RSS_ANON;

    #[test]
    fn memory_is_judged_only_over_long_lives() {
        // Life 0: 3 minutes of warm-up growth; life 1: 9 flat minutes.
        let mut points: Vec<(u64, f64, u32)> = (0..=6)
            .map(|i| (i * 30_000, 20_000.0 + i as f64 * 500.0, 0))
            .chain((0..=18).map(|i| (300_000 + i * 30_000, 30_000.0, 1)))
            .collect();
        keep_long_lives(&mut points);
        assert!(points.iter().all(|(_, _, life)| *life == 1));
        assert_eq!(points.len(), 19);
        let fitted = slope(&points, 4.0).expect("a slope");
        assert!(fitted.flat(), "{fitted:?}");
    }

    #[test]
    fn memory_is_fitted_after_its_warm_up_and_counts_after_theirs() {
        use crate::soak::{observe::RSS_ANON, record::Incarnation};
        // One life of 13 minutes, sampled every 10 s: its memory rises for
        // 2 minutes, then stays flat; its descriptors rise the whole time.
        let mut life = Lifecycle::default();
        life.incarnations.push(Incarnation {
            pid: 1,
            started_ms: 0,
            ended_ms: None,
            end: None,
        });
        let samples: Vec<Sample> = (0..=78u64)
            .map(|i| {
                let t_ms = i * 10_000;
                let memory = 1_600.0 + (t_ms.min(120_000) as f64) * 0.001;
                let values = [
                    (RSS_ANON.to_string(), memory),
                    ("daemon fds".to_string(), 70.0 + i as f64),
                ];
                Sample {
                    t_ms,
                    life: 0,
                    values: values.into_iter().collect(),
                }
            })
            .collect();
        let fitted: BTreeMap<String, Option<Slope>> =
            slopes_of(&samples, 0, Some(&life)).into_iter().collect();
        let memory = fitted[RSS_ANON].expect("judged");
        assert!(memory.flat(), "{memory:?}");
        assert_eq!(memory.samples, 61, "from 3 minutes in");
        let fds = fitted["daemon fds"].expect("judged");
        assert!(fds.grows(), "{fds:?}");
        assert_eq!(fds.samples, 76, "from 30 s in");
    }

    #[test]
    fn anonymous_memory_is_judged_and_rss_only_shown() {
        let rising: Vec<(u64, f64, u32)> = (0..30)
            .map(|minute| (minute * 60_000, 4_000.0 + minute as f64 * 10.0, 0))
            .collect();
        let grows = slope(&rising, 1.0).expect("a slope");
        let level: Vec<(u64, f64, u32)> = (0..30)
            .map(|minute| (minute * 60_000, 4_000.0, 0))
            .collect();
        let flat = slope(&level, 1.0).expect("a slope");
        let cases = [
            (RSS_ANON, &grows, true, "**grows**"),
            (RSS_ANON, &flat, false, "flat"),
            ("daemon fds", &grows, true, "**grows**"),
            (RSS, &grows, false, "grows (shown: anonymous + file-backed)"),
            (
                RSS_FILE,
                &grows,
                false,
                "grows (shown: pages of the binary and libraries, paged in and out)",
            ),
            (
                RSS_FILE,
                &flat,
                false,
                "flat (shown: pages of the binary and libraries, paged in and out)",
            ),
        ];
        for (name, fitted, leak, column) in cases {
            assert_eq!(is_leak(name, fitted), leak, "{name}: {fitted:?}");
            assert_eq!(slope_verdict(name, fitted), column, "{name}");
        }
    }
}
