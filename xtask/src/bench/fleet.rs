//! `cargo xtask bench --fleet`: the herd figures. The scenarios of
//! `socklb_tests::herd` (1,000 long-lived agents through a hung server, a
//! rolling restart with rebalancing off and on, a recovery herd without
//! and with slow start), run once each, written to bench/results/FLEET.md
//! with a chart of the rolling restart. Rebalancing runs at its defaults;
//! every other setting is named beside its figures. Nothing here asserts:
//! tests/herd.rs asserts the invariants of the same scenarios.

use std::{fmt::Write as _, path::Path, time::Duration};

use anyhow::{Context, Result};
use socklb_tests::herd::{
    self, AGENTS, BETWEEN_RESTARTS, HungServer, INTERVAL_MS, PROBE_TIMEOUT_MS, Recovery,
    RollingRestart, WORK_REQUESTS,
};

/// How long the rolling restart's herd runs on after the last server is
/// back: long enough for rebalancing at its defaults (333 moves at 5/s
/// after 10 s).
const SETTLE: Duration = Duration::from_secs(90);

pub fn run(root: &Path) -> Result<()> {
    if !crate::is_root() {
        anyhow::bail!(
            "cargo xtask bench --fleet makes network namespaces, cgroups and eBPF programs: run it as root"
        );
    }
    super::build_release(root, &["lbclient", "fleetagent", "testapiserver"])?;
    println!("bench --fleet: one hung server");
    let hung = herd::hung_server();
    println!("bench --fleet: rolling restart, rebalancing off, then on (defaults)");
    let off = herd::rolling_restart("rebalancing off", &[], SETTLE, false);
    let on = herd::rolling_restart("rebalancing on", &["--rebalance"], SETTLE, false);
    println!("bench --fleet: recovery herd, without and with slow start");
    let without = herd::recovery("without slow start", &[]);
    let with = herd::recovery("with slow start 30 s", &["--slow-start", "30s"]);
    let out = root.join("bench/results");
    std::fs::create_dir_all(&out).context("bench/results")?;
    std::fs::write(out.join("rolling-restart.svg"), charts(&[&off, &on]))
        .context("rolling-restart.svg")?;
    let mut report = header();
    report.push_str(&hung_section(&hung));
    report.push_str(&rolling_section(&[&off, &on]));
    report.push_str(&recovery_section(&[&without, &with]));
    std::fs::write(out.join("FLEET.md"), report).context("FLEET.md")?;
    println!("bench --fleet: wrote {}", out.join("FLEET.md").display());
    Ok(())
}

fn header() -> String {
    format!(
        "# A herd of 1,000 agents\n\n\
         Written by `cargo xtask bench --fleet` (the scenarios of \
         `tests/src/herd.rs`, whose invariants `tests/tests/herd.rs` asserts): \
         {AGENTS} `fleetagent` agents, each with one keep-alive TLS connection \
         to the VIP and a request every second (one retry after 250 ms plus up \
         to 750 ms of jitter), on three server namespaces running test \
         apiservers, behind socklb with least-conn, close-on-failure and health \
         checks every {INTERVAL_MS} ms (timeout {PROBE_TIMEOUT_MS} ms; fall 2, \
         rise 2). Rebalancing, where on, runs at its defaults (tolerance 0.2, \
         after 10 s, 5 closes/s).\n\n"
    )
}

fn hung_section(run: &HungServer) -> String {
    let finish = run.finish_ms();
    let last = finish.last().copied().unwrap_or(u64::MAX);
    let median = finish.get(finish.len() / 2).copied().unwrap_or(u64::MAX);
    let ideal = run.ideal_ms();
    let work = &run.summary["work"];
    format!(
        "## One hung server\n\n\
         The herd is connected ({:?} live per server) when s0 hangs in place: \
         it keeps accepting TCP and answers nothing. At that moment every agent \
         starts {WORK_REQUESTS} `/work` requests back to back; a server serves \
         {} of them per second, so the ideal time, the total work over the two \
         healthy servers' capacity, is {ideal} ms.\n\n\
         | | |\n| --- | --- |\n\
         | agents that did all their work | {} of {AGENTS} |\n\
         | last agent served after | {last} ms ({:.2}× ideal) |\n\
         | median agent served after | {median} ms |\n\
         | s0 out of the table after | {} ms |\n\
         | longest wait of any agent on s0 | {} ms |\n\
         | work requests failed | {} |\n\n\
         A server that accepts and never answers can only be found by a probe \
         that times out. The bound tests/herd.rs asserts, {} ms, is the worst \
         case of detection: the first probe to time out starts up to one \
         jittered interval after the hang, the next as it times out, so the \
         second failure comes 2 × {PROBE_TIMEOUT_MS} ms later; then 250 ms for \
         close-on-failure to end every connection on s0 and the agent to see \
         it.\n\n",
        run.before,
        socklb_tests::cluster::WORK_PER_SECOND,
        work["agents_done"],
        last as f64 / ideal as f64,
        run.out_after.as_millis(),
        run.longest_wait().as_millis(),
        work["failed"],
        herd::detect_bound().as_millis(),
    )
}

/// One cell of the rolling restart's table.
type Cell = dyn Fn(&RollingRestart) -> String;

fn rolling_section(runs: &[&RollingRestart]) -> String {
    let mut text = format!(
        "## Rolling restart\n\n\
         Each server in turn is killed, started again and waited for until \
         healthy; the next is killed {} s later (longer than an agent's longest \
         retry delay, so that no request meets two kills, one per attempt). \
         The herd runs on for {} s after the last one.\n\n\
         | | {} |\n| --- |{}\n",
        BETWEEN_RESTARTS.as_secs(),
        SETTLE.as_secs(),
        runs.iter()
            .map(|run| run.label)
            .collect::<Vec<_>>()
            .join(" | "),
        " --- |".repeat(runs.len())
    );
    let rows: [(&str, &Cell); 6] = [
        ("live per server when the last server was back", &|run| {
            format!("{:?}", run.at_last_restart)
        }),
        ("live per server at the end", &|run| {
            format!("{:?}", run.end)
        }),
        ("max/min at the end", &|run| format!("{:.2}", run.ratio())),
        ("max/min ≤ 1.3 reached after the last return", &|run| {
            run.balanced_after()
                .map_or("never".to_string(), |seconds| format!("{seconds:.0} s"))
        }),
        ("connections moved (minimum needed)", &|run| {
            format!("{} ({})", run.moves, run.minimum_moves())
        }),
        ("requests, failed, retried; reconnects", &|run| {
            format!(
                "{}, {}, {}; {}",
                run.summary["requests"],
                run.summary["failed"],
                run.summary["retried"],
                run.summary["reconnects"]
            )
        }),
    ];
    for (label, cell) in rows {
        let cells: Vec<String> = runs.iter().map(|run| cell(run)).collect();
        let _ = writeln!(text, "| {label} | {} |", cells.join(" | "));
    }
    text.push_str(
        "\n![live connections per server](rolling-restart.svg)\n\n\
         ### Live connections per server, each second\n\n",
    );
    for run in runs {
        let _ = writeln!(
            text,
            "#### {}\n\n| s | s0 | s1 | s2 |\n| --- | --- | --- | --- |",
            run.label
        );
        for (t, live) in &run.series {
            let _ = writeln!(text, "| {t:.0} | {} | {} | {} |", live[0], live[1], live[2]);
        }
        text.push('\n');
    }
    text
}

fn recovery_section(runs: &[&Recovery]) -> String {
    let fair = 1.0 / 3.0;
    let mut text = String::from(
        "## Recovery herd\n\n\
         700 agents are settled on s0 and s1 while s2 is down; s2 comes back \
         and is healthy, and 300 more agents connect at once (spread over one \
         second). The share of those new connections that s2 takes in its \
         first 5 s, against its fair share of a third:\n\n\
         | | live when s2 was back | 5 s later | new connections | s2's share | × fair |\n\
         | --- | --- | --- | --- | --- | --- |\n",
    );
    for run in runs {
        let _ = writeln!(
            text,
            "| {} | {:?} | {:?} | {} | {} ({:.2}) | {:.2} |",
            run.label,
            run.at_return,
            run.after,
            run.joined(),
            run.after[2] - run.at_return[2],
            run.share(),
            run.share() / fair
        );
    }
    text.push_str(
        "\nWithout slow start the recovered server, with no live connection, \
         wins every least-conn draw it is in; with it, its slots ramp from \
         about a tenth of its weight to all of it over 30 s.\n",
    );
    text
}

/// The rolling restart's charts, one above the other.
fn charts(runs: &[&RollingRestart]) -> String {
    let height = 280 * runs.len();
    let mut svg =
        format!(r#"<svg xmlns="http://www.w3.org/2000/svg" width="760" height="{height}">"#);
    for (index, run) in runs.iter().enumerate() {
        let _ = write!(
            svg,
            r#"<g transform="translate(0,{})">{}</g>"#,
            280 * index,
            chart(run, 760.0, 270.0)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// An SVG line chart of the live connections per server over time.
fn chart(run: &RollingRestart, width: f64, height: f64) -> String {
    let last_t = run.series.last().map_or(1.0, |(t, _)| *t).max(1.0);
    let max_live = run
        .series
        .iter()
        .flat_map(|(_, live)| live.iter().copied())
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let (left, right, top, bottom) = (50.0, 10.0, 30.0, 30.0);
    let x = |t: f64| left + t / last_t * (width - left - right);
    let y = |live: f64| top + (1.0 - live / max_live) * (height - top - bottom);
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11"><text x="{left}" y="16" font-size="13">{}: live connections per server (1,000 agents)</text>"#,
        run.label
    );
    let _ = write!(
        svg,
        r#"<line x1="{left}" y1="{0}" x2="{1}" y2="{0}" stroke="black"/><line x1="{left}" y1="{top}" x2="{left}" y2="{0}" stroke="black"/><text x="4" y="{2}">{3}</text><text x="4" y="{0}">0</text><text x="{4}" y="{5}">{last_t:.0} s</text>"#,
        height - bottom,
        width - right,
        top + 4.0,
        max_live as i64,
        width - right - 30.0,
        height - 12.0,
    );
    for (index, restart) in run.restarts.iter().enumerate() {
        let _ = write!(
            svg,
            r##"<line x1="{0}" y1="{top}" x2="{0}" y2="{1}" stroke="#999" stroke-dasharray="3,3"/><text x="{0}" y="{2}" fill="#666">s{index} back</text>"##,
            x(*restart),
            height - bottom,
            height - 16.0
        );
    }
    for (server, color) in ["#1f77b4", "#ff7f0e", "#2ca02c"].iter().enumerate() {
        let points: Vec<String> = run
            .series
            .iter()
            .map(|(t, live)| format!("{:.1},{:.1}", x(*t), y(live[server] as f64)))
            .collect();
        let _ = write!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/><text x="{}" y="{}" fill="{color}">s{server}</text>"#,
            points.join(" "),
            width - right - 60.0 + 20.0 * server as f64,
            top - 4.0
        );
    }
    svg.push_str("</svg>");
    svg
}
