//! A herd of 1,000 long-lived agents (see `socklb_tests::herd`): the
//! invariants only. Their figures (times against the ideal, balance over
//! time, the baseline without rebalancing) are `cargo xtask bench
//! --fleet`'s, in bench/results/FLEET.md.
//!
//! - one server hangs as the herd starts its work: every agent is served,
//!   and none waits on the hung server longer than the detection bound
//!   the probe settings give;
//! - a rolling restart with rebalancing at its defaults: balance is
//!   reached, with close to the least moves, and requests fail only on
//!   the moment of a kill;
//! - a recovery herd: slow start keeps the recovered server to at most
//!   1.5× its fair share of the joining agents.

use std::time::Duration;

use socklb_tests::{
    herd::{self, AGENTS, WORK_REQUESTS},
    record_figures, require_root,
};

#[test]
fn a_herd_of_1000_while_one_server_hangs() {
    require_root!();
    let run = herd::hung_server();
    let bound = herd::detect_bound();
    let work = &run.summary["work"];
    record_figures(&format!(
        "herd of 1000, one server hangs: {} of {AGENTS} agents did their {WORK_REQUESTS} requests, {} failed; s0 out after {} ms; longest wait on the hung server {} ms (bound {} ms)",
        work["agents_done"],
        work["failed"],
        run.out_after.as_millis(),
        run.longest_wait().as_millis(),
        bound.as_millis()
    ));
    assert_eq!(
        work["agents_done"], AGENTS,
        "every agent finished: {}",
        run.summary
    );
    assert_eq!(
        work["failed"], 0,
        "no work request failed: {}\n{}",
        run.summary, run.log
    );
    assert!(
        run.longest_wait() <= bound,
        "no agent waits on the hung server longer than the detection bound {} ms: {} ms\n{}",
        bound.as_millis(),
        run.longest_wait().as_millis(),
        run.log
    );
}

#[test]
fn a_rolling_restart_of_a_herd_of_1000_ends_in_balance_at_the_defaults() {
    require_root!();
    // Rebalancing at its defaults (tolerance 0.2, after 10 s, 5/s): the
    // server restarted last is empty, a third of the herd (333) must move,
    // at 5/s after 10 s; twice that long at the most.
    let settle = Duration::from_secs(10 + 2 * 333 / 5);
    let run = herd::rolling_restart("herd-rolling", &["--rebalance"], settle, true);
    record_figures(&format!(
        "herd of 1000, rolling restart, rebalancing at its defaults: live {:?} when the last server was back, {:?} at the end (max/min {:.2}); {} moves for a minimum of {}; {} requests, {} failed",
        run.at_last_restart,
        run.end,
        run.ratio(),
        run.moves,
        run.minimum_moves(),
        run.requests(),
        run.failed()
    ));
    assert!(run.ratio() <= 1.3, "balanced: {:?}", run.end);
    assert!(
        run.moves as f64 <= 1.5 * run.minimum_moves() as f64,
        "{} moves for a minimum of {}",
        run.moves,
        run.minimum_moves()
    );
    // A request fails only when its retry too lands on a killed server
    // before the kill is seen: at most one in a thousand.
    assert!(
        run.failed() * 1000 <= run.requests(),
        "failed requests: {}",
        run.summary
    );
}

#[test]
fn a_recovery_herd_with_slow_start_takes_at_most_its_share() {
    require_root!();
    let run = herd::recovery("herd-slow", &["--slow-start", "30s"]);
    let fair = 1.0 / 3.0;
    record_figures(&format!(
        "recovery herd with slow start 30 s: live {:?} when s2 was back, {:?} 5 s later; s2 took {:.2} of the joining agents ({:.2}× fair)",
        run.at_return,
        run.after,
        run.share(),
        run.share() / fair
    ));
    assert_eq!(
        run.joined(),
        300,
        "every joining agent connected: {:?}",
        run.after
    );
    assert!(
        run.share() <= 1.5 * fair,
        "with slow start s2 takes at most 1.5× its fair share: {:.2}",
        run.share()
    );
}
