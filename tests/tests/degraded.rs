//! What socklb does on a kernel without each optional feature, tested on
//! this kernel by turning each probe off through the test-only switch
//! (`SOCKLB_TEST_DISABLE_FEATURES`): one clear line in the log, and the
//! documented fallback.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use socklb::dataplane::features::DISABLE_FOR_TEST;
use socklb_tests::{
    Backend, Cgroup, ClientRun, ConnClient, Daemon, aborted, backend_field, free_port,
    require_root, service_args, unique_name,
};

const EPERM: i32 = 1;

fn vip() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A daemon with one feature turned off, healthy.
fn without(
    feature: &str,
    cgroup: &Cgroup,
    vip: SocketAddr,
    backends: &[SocketAddr],
    extra: &[&str],
) -> Daemon {
    let pin = PathBuf::from("/sys/fs/bpf").join(unique_name("degraded"));
    let mut daemon = Daemon::start_with(
        "degraded",
        &service_args(&cgroup.path, &[vip], backends, extra),
        pin,
        &[(DISABLE_FOR_TEST, feature)],
    );
    daemon.wait_health(backends, true, Duration::from_secs(10));
    daemon
}

/// Connects through the VIP, then holds 20 connections: getpeername shows
/// each the VIP, the daemon counts them live and tracked, and once they
/// and the backend's side close, every count and the socket table are
/// back to 0.
fn redirects_and_counts(daemon: &mut Daemon, cgroup: &Cgroup, vip: SocketAddr, backend: Backend) {
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 3).run();
    assert!(
        attempts
            .iter()
            .all(|attempt| attempt.peer.as_deref() == Some(vip.to_string().as_str())),
        "getpeername shows the VIP: {attempts:?}"
    );
    let mut held = ConnClient::hold_until_released(vip, &cgroup.path, 20, Duration::from_secs(30));
    let addr = backend.addr.to_string();
    daemon.wait_for("20 live and tracked", Duration::from_secs(5), |status| {
        backend_field(status, &addr, "live") == Some(serde_json::json!(20))
            && status["data_plane"]["socket_table"]["tracked"] == 20
    });
    held.release();
    let ends = held.finish();
    assert!(
        ends.iter().all(|end| end["peer"] == vip.to_string()),
        "getpeername showed the VIP on every held connection: {ends:?}"
    );
    // The server closes its side too: a closed client socket of a held
    // connection can otherwise wait out FIN_WAIT2 (60 s), counted live.
    drop(backend);
    daemon.wait_for(
        "0 live, the table empty",
        Duration::from_secs(5),
        |status| {
            backend_field(status, &addr, "live") == Some(serde_json::json!(0))
                && status["data_plane"]["socket_table"]["tracked"] == 0
        },
    );
}

#[test]
fn without_set_retval_reject_refuses_with_eperm() {
    require_root!();
    let cgroup = Cgroup::new("no-retval");
    let mut backend = Backend::start("b0", "127.0.0.2");
    let vip = vip();
    let mut daemon = without(
        "set-retval",
        &cgroup,
        vip,
        &[backend.addr],
        &["--when-none-healthy", "reject"],
    );
    assert!(daemon.log_shows("refuses connects with EPERM", Duration::from_secs(1)));
    backend.stop();
    daemon.wait_health(&[backend.addr], false, Duration::from_secs(5));
    let attempts = ClientRun::new(vip, Some(&cgroup.path), 3).run();
    assert!(
        attempts.iter().all(|attempt| attempt.errno == Some(EPERM)),
        "refused with EPERM: {attempts:?}"
    );
}

#[test]
fn without_netns_cookies_every_namespace_is_redirected() {
    require_root!();
    let cgroup = Cgroup::new("no-netns");
    let backend = Backend::start("b0", "127.0.0.2");
    let vip = vip();
    let daemon = without("netns-cookie", &cgroup, vip, &[backend.addr], &[]);
    assert!(daemon.log_shows(
        "connects from every network namespace in the cgroup are redirected",
        Duration::from_secs(1)
    ));
    // A client in a namespace of its own is redirected to 127.0.0.2 of
    // that namespace, where nothing listens: refused, not "own-netns".
    let mut run = ClientRun::new(vip, Some(&cgroup.path), 3);
    run.new_netns = true;
    let attempts = run.run();
    assert!(
        attempts.iter().all(|attempt| !attempt.ok),
        "redirected in its own namespace too: {attempts:?}"
    );
}

#[test]
fn without_callbacks_at_connect_sock_ops_finds_the_redirected_sockets_and_counts() {
    require_root!();
    let cgroup = Cgroup::new("no-callbacks");
    let backend = Backend::start_holding("b0", "127.0.0.2");
    let vip = vip();
    let mut daemon = without("callbacks-at-connect", &cgroup, vip, &[backend.addr], &[]);
    assert!(daemon.log_shows(
        "sock_ops looks every connecting socket of the cgroup up",
        Duration::from_secs(1)
    ));
    redirects_and_counts(&mut daemon, &cgroup, vip, backend);
}

#[test]
fn without_socket_slots_the_hash_holds_every_record_and_counts_exactly() {
    require_root!();
    let cgroup = Cgroup::new("no-slots");
    let backend = Backend::start_holding("b0", "127.0.0.2");
    let vip = vip();
    let mut daemon = without("socket-slots", &cgroup, vip, &[backend.addr], &[]);
    assert!(daemon.log_shows(
        "the socket table is a preallocated hash",
        Duration::from_secs(1)
    ));
    let status = daemon.status().expect("status");
    let table = &status["data_plane"]["socket_table"];
    assert_eq!(
        (table["slots"].as_u64(), table["capacity"].as_u64()),
        (Some(0), Some(65536)),
        "the hash alone: {status}"
    );
    let paths = socklb::dataplane::PinPaths::new(&daemon.pin_path);
    assert!(
        !paths.map(lb_common::names::SOCKET_SLOTS).exists(),
        "no array pinned"
    );
    redirects_and_counts(&mut daemon, &cgroup, vip, backend);
}

#[test]
fn without_sock_destroy_close_on_failure_is_off() {
    require_root!();
    let cgroup = Cgroup::new("no-destroy");
    let backends = [
        Backend::start_holding("b0", "127.0.0.2"),
        Backend::start_holding("b1", "127.0.0.3"),
    ];
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    let vip = vip();
    let mut daemon = without("sock-destroy", &cgroup, vip, &addrs, &[]);
    assert!(daemon.log_shows("close-on-failure is off", Duration::from_secs(1)));
    let held = ConnClient::hold(vip, &cgroup.path, 10, Duration::from_secs(3));
    let first = addrs[0].to_string();
    daemon.wait_for("connections on b0", Duration::from_secs(5), |status| {
        backend_field(status, &first, "live").and_then(|live| live.as_i64()) > Some(0)
    });
    // b0's listener goes; its connections stay open (the backend holds
    // them), and without SOCK_DESTROY socklb leaves them alone.
    let [mut b0, _b1] = backends;
    b0.stop();
    daemon.wait_health(&addrs[..1], false, Duration::from_secs(5));
    // socklb closes nothing: no connection ends with ECONNABORTED (what
    // SOCK_DESTROY gives). One still in b0's accept queue when its listener
    // closed is reset by the kernel (ECONNRESET), which is not socklb.
    let ends = held.finish();
    assert_eq!(aborted(&ends), 0, "nothing closed by socklb: {ends:?}");
    let open = ends.iter().filter(|end| end["end"] == "open").count();
    assert!(open * 2 > ends.len(), "most stay open: {ends:?}");
    assert!(
        !daemon.log().contains("close-on-failure)"),
        "{}",
        daemon.log()
    );
}
