//! Hand-back: with `when-daemon-gone = "auto"` (the default) and another
//! socket listening on the VIP (the agent's own balancer), once the
//! daemon's heartbeat is older than `daemon-gone-after` the connect hook
//! leaves the VIP's connects alone, so they reach that listener; a
//! restarted daemon takes over again. With nothing else listening, auto
//! keeps redirecting. Not one connect fails. status, `status --check` and
//! the metrics say which applies, why, and since when the VIPs are handed
//! back.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use socklb_tests::{
    Attempt, Backend, Cgroup, ClientRun, Daemon, free_port, record_figures, require_root,
    scrape_metrics, service_args, socklb, spread, time_until, until_served_by,
};

/// The shortest `daemon-gone-after` allowed.
const GONE_AFTER: Duration = Duration::from_secs(2);
const GONE_AFTER_FLAG: &str = "2s";

fn served_by_backend(attempt: &Attempt) -> bool {
    attempt.ok && matches!(attempt.served_by.as_deref(), Some("b0" | "b1"))
}

fn served_by_agent(attempt: &Attempt) -> bool {
    attempt.ok && attempt.served_by.as_deref() == Some("agent")
}

/// The daemon, the agent's balancer on the VIP, two backends, and a
/// client connecting every 10 ms from the cgroup.
struct Setup {
    cgroup: Cgroup,
    vip: SocketAddr,
    agent: Option<Backend>,
    backends: [Backend; 2],
    daemon: Daemon,
}

impl Setup {
    fn start(label: &str, agent: bool, extra: &[&str]) -> Self {
        let cgroup = Cgroup::new(label);
        let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
        // The agent's own balancer listens on the VIP itself, before
        // socklb starts (as the agent starts first).
        let agent = agent.then(|| Backend::start_at("agent", vip));
        let backends = [
            Backend::start("b0", "127.0.0.2"),
            Backend::start("b1", "127.0.0.3"),
        ];
        let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
        let mut daemon = Daemon::start(label, &service_args(&cgroup.path, &[vip], &addrs, extra));
        daemon.wait_health(&addrs, true, Duration::from_secs(10));
        Self {
            cgroup,
            vip,
            agent,
            backends,
            daemon,
        }
    }

    /// `socklb status --json`, read from the pins (with or without the
    /// daemon): the service's `when_daemon_gone`.
    fn hand_back_status(&self) -> serde_json::Value {
        let status = self.daemon.status().expect("socklb status --json");
        status["services"][0]["when_daemon_gone"].clone()
    }

    /// `socklb status` (text) and `socklb status --check`: their output,
    /// and the exit status of the check.
    fn status_texts(&self) -> (String, String, Option<i32>) {
        let pin = self.daemon.pin_path.display().to_string();
        let text = socklb(&["status", "--pin-path", &pin]);
        let check = socklb(&["status", "--check", "--pin-path", &pin]);
        (
            String::from_utf8_lossy(&text.stdout).into_owned(),
            String::from_utf8_lossy(&check.stdout).into_owned(),
            check.status.code(),
        )
    }
}

#[test]
fn with_the_daemon_gone_connects_reach_the_listener_and_come_back_with_it() {
    require_root!();
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let metrics_flag = metrics.to_string();
    // No --when-daemon-gone: auto, the default, finds the agent's balancer.
    let mut setup = Setup::start(
        "hand-back",
        true,
        &[
            "--daemon-gone-after",
            GONE_AFTER_FLAG,
            "--metrics-addr",
            &metrics_flag,
        ],
    );
    let vip = setup.vip;
    let choice = setup.hand_back_status();
    assert_eq!(choice["configured"], "auto", "{choice}");
    assert_eq!(choice["effective"], "hand-back", "{choice}");
    assert_eq!(
        choice["reason"],
        format!("{vip} has a listener"),
        "{choice}"
    );
    assert_eq!(choice["handed_back"], false, "{choice}");
    assert!(
        setup.daemon.log_shows(
            &format!("when the daemon is gone: auto: hand-back ({vip} has a listener)"),
            Duration::from_secs(5)
        ),
        "the log says what auto chose:\n{}",
        setup.daemon.log()
    );
    let samples = scrape_metrics(metrics);
    let service = setup.daemon.status().expect("status")["services"][0]["name"]
        .as_str()
        .expect("service name")
        .to_string();
    assert_eq!(
        samples.get(&format!(
            "socklb_when_daemon_gone_info{{service=\"{service}\",configured=\"auto\",effective=\"hand-back\"}}"
        )),
        Some(&1.0),
        "{samples:?}"
    );
    assert_eq!(
        samples.get(&format!("socklb_hand_back_active{{service=\"{service}\"}}")),
        Some(&0.0),
        "{samples:?}"
    );
    assert_eq!(
        samples.get(&format!(
            "socklb_hand_back_since_timestamp_seconds{{service=\"{service}\"}}"
        )),
        Some(&0.0),
        "{samples:?}"
    );

    let mut run = ClientRun::new(vip, Some(&setup.cgroup.path), 3000);
    run.interval_ms = 10;
    let started = Instant::now();
    let client = run.spawn();
    until_served_by(vip, &setup.cgroup.path, "b0", Duration::from_secs(10));
    let killed_ms = started.elapsed().as_millis() as u64;
    setup.daemon.kill();
    let handed_back = until_served_by(
        vip,
        &setup.cgroup.path,
        "agent",
        GONE_AFTER + Duration::from_secs(10),
    );
    // The operator's view while the daemon is gone: from the pins alone.
    let gone = setup.hand_back_status();
    assert_eq!(gone["handed_back"], true, "{gone}");
    assert!(gone["handed_back_since"].is_string(), "{gone}");
    let (text, check, code) = setup.status_texts();
    assert!(
        text.contains("HANDED BACK since "),
        "status says since when the VIPs are handed back:\n{text}"
    );
    assert!(
        check.contains(&format!("service {service} is handed back since ")),
        "status --check says so:\n{check}"
    );
    assert!(
        code.is_some_and(|code| code != 0),
        "status --check fails while handed back: {code:?}"
    );
    // A backend dies while no daemon probes it: the restarted daemon adopts
    // a verdict that says healthy, and must not send connects there.
    setup.backends[1].stop();
    let restarted_ms = started.elapsed().as_millis() as u64;
    setup.daemon.restart();
    let taken_over = until_served_by(vip, &setup.cgroup.path, "b0", Duration::from_secs(20));
    let back_ms = started.elapsed().as_millis() as u64;
    let attempts = client.finish();
    assert!(
        attempts
            .last()
            .is_some_and(|last| last.at_ms > back_ms + 500),
        "the client ran past the take-over: {} attempts",
        attempts.len()
    );
    let failed = spread(&attempts).get("error").copied().unwrap_or(0);
    assert_eq!(failed, 0, "not one connect failed: {:?}", spread(&attempts));
    let before_kill: Vec<&Attempt> = attempts.iter().filter(|a| a.at_ms < killed_ms).collect();
    assert!(
        !before_kill.is_empty() && before_kill.iter().all(|a| served_by_backend(a)),
        "before the kill every connect went to a backend"
    );
    let first_agent = attempts
        .iter()
        .find(|a| served_by_agent(a))
        .expect("connects reached the listener")
        .at_ms;
    let hand_back_ms = first_agent.saturating_sub(killed_ms);
    assert!(
        hand_back_ms <= (GONE_AFTER + Duration::from_secs(1)).as_millis() as u64,
        "the listener got connects {hand_back_ms} ms after the kill (daemon-gone-after {GONE_AFTER:?})"
    );
    assert!(
        attempts
            .iter()
            .filter(|a| a.at_ms >= first_agent && a.at_ms < restarted_ms)
            .all(served_by_agent),
        "once handed back, every connect reached the listener until the restart"
    );
    let first_back = attempts
        .iter()
        .find(|a| a.at_ms >= restarted_ms && served_by_backend(a))
        .expect("connects went back to the backends")
        .at_ms;
    assert!(
        attempts
            .iter()
            .filter(|a| a.at_ms >= first_back)
            .all(served_by_backend),
        "after the take-over every connect went to a backend"
    );
    let back = setup.hand_back_status();
    assert_eq!(back["handed_back"], false, "{back}");
    assert!(
        setup.daemon.log_shows(
            "the probes confirmed every verdict; taking the VIPs back",
            Duration::from_secs(5)
        ),
        "the restarted daemon took the VIPs back once its probes agreed:\n{}",
        setup.daemon.log()
    );
    record_figures(&format!(
        "hand-back (auto, listener on the VIP): daemon SIGKILLed with daemon-gone-after {GONE_AFTER:?}: the listener on the VIP got connects {hand_back_ms} ms later (probe saw it after {} ms); restarted with one backend dead meanwhile: back on the backends {} ms after the restart (probe {} ms); {} connects every 10 ms, 0 failed",
        handed_back.as_millis(),
        first_back.saturating_sub(restarted_ms),
        taken_over.as_millis(),
        attempts.len()
    ));
}

#[test]
fn with_nothing_else_listening_auto_keeps_redirecting_after_the_kill() {
    require_root!();
    let mut setup = Setup::start("keep", false, &["--daemon-gone-after", GONE_AFTER_FLAG]);
    let vip = setup.vip;
    let choice = setup.hand_back_status();
    assert_eq!(choice["configured"], "auto", "{choice}");
    assert_eq!(choice["effective"], "keep", "{choice}");
    assert_eq!(
        choice["reason"],
        format!("nothing else listens on {vip}"),
        "{choice}"
    );
    let mut run = ClientRun::new(vip, Some(&setup.cgroup.path), 600);
    run.interval_ms = 10;
    let started = Instant::now();
    let client = run.spawn();
    until_served_by(vip, &setup.cgroup.path, "b0", Duration::from_secs(10));
    let killed_ms = started.elapsed().as_millis() as u64;
    setup.daemon.kill();
    let attempts = client.finish();
    let after_kill = attempts.iter().filter(|a| a.at_ms > killed_ms).count();
    let past_gone_after = attempts
        .iter()
        .filter(|a| a.at_ms > killed_ms + (GONE_AFTER + Duration::from_secs(1)).as_millis() as u64)
        .count();
    assert!(
        past_gone_after > 0,
        "the client ran past daemon-gone-after + 1 s: {} attempts, {after_kill} after the kill",
        attempts.len()
    );
    assert!(
        attempts.iter().all(served_by_backend),
        "every connect still went to a backend: {:?}",
        spread(&attempts)
    );
    let gone = setup.hand_back_status();
    assert_eq!(gone["effective"], "keep", "{gone}");
    assert_eq!(gone["handed_back"], false, "{gone}");
    let (text, _, _) = setup.status_texts();
    assert!(
        text.contains(&format!(
            "when the daemon is gone: auto: keep (nothing else listens on {vip})"
        )) && !text.contains("HANDED BACK"),
        "status says keep and why:\n{text}"
    );
    record_figures(&format!(
        "hand-back (auto, no listener): daemon SIGKILLed; {} connects every 10 ms, {after_kill} after the kill ({past_gone_after} past daemon-gone-after {GONE_AFTER:?} + 1 s), all to the backends, 0 failed",
        attempts.len()
    ));
}

/// auto is decided again at a reload: a balancer that starts listening on
/// the VIP after socklb is found by the next SIGHUP, and the log says what
/// changed.
#[test]
fn a_reload_decides_auto_again() {
    require_root!();
    let mut setup = Setup::start("hand-back-reload", false, &[]);
    let vip = setup.vip;
    assert_eq!(setup.hand_back_status()["effective"], "keep");
    setup.agent = Some(Backend::start_at("agent", vip));
    // status applies auto's rule to the listeners now, and says the next
    // reload will hand back.
    let pending = setup.hand_back_status();
    assert!(
        pending["reason"]
            .as_str()
            .is_some_and(|reason| reason.contains("the next reload hands back")),
        "{pending}"
    );
    setup.daemon.signal(libc::SIGHUP);
    let took = time_until("hand-back after SIGHUP", Duration::from_secs(10), || {
        setup.hand_back_status()["effective"] == "hand-back"
    });
    assert!(
        setup.daemon.log_shows(
            &format!(
                "auto: hand-back ({vip} has a listener) (was auto: keep (nothing else listens on {vip}))"
            ),
            Duration::from_secs(5)
        ),
        "the log says the choice changed:\n{}",
        setup.daemon.log()
    );
    record_figures(&format!(
        "hand-back (auto): a listener that came after the start was found by SIGHUP; status showed hand-back {} ms later",
        took.as_millis()
    ));
}
