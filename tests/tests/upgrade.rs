//! An upgrade in place, with no gap: socklb of the commit before the ABI
//! was versioned (built from this repository's history) runs; then this
//! socklb starts on the same pins while a client connects every 5 ms.

use std::{
    net::SocketAddr,
    os::fd::AsFd,
    path::PathBuf,
    process::{Command, Stdio},
    time::Duration,
};

use lb_common::names;
use socklb::dataplane::{PinPaths, sys};
use socklb_tests::{
    Backend, Cgroup, ClientRun, ConnClient, Daemon, FIRST_LAYOUT_COMMIT, backend_field, free_port,
    old_socklb_bin, record_figures, require_root, service_args, spread, unique_name,
};

/// The names of the maps the program behind a pinned link uses.
fn maps_of_link(pin_path: &PathBuf, program: &str) -> Vec<String> {
    let fd = sys::open_pinned(&PinPaths::new(pin_path).link(program)).expect("pinned link");
    let link = sys::link_info(fd.as_fd()).expect("link info");
    let program = sys::prog_fd_by_id(link.prog_id).expect("program");
    let info = sys::prog_info(program.as_fd()).expect("program info");
    info.map_ids
        .iter()
        .filter_map(|id| aya::maps::MapInfo::from_id(*id).ok())
        .filter_map(|map| map.name_as_str().map(str::to_string))
        .collect()
}

#[test]
fn an_install_of_the_first_layout_is_upgraded_in_place_with_no_failed_connect() {
    require_root();
    let old_socklb = old_socklb_bin();
    let cgroup = Cgroup::new("upgrade");
    let backends: Vec<Backend> = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        .iter()
        .enumerate()
        .map(|(i, ip)| Backend::start_holding(&format!("b{i}"), ip))
        .collect();
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let pin_path = PathBuf::from("/sys/fs/bpf").join(unique_name("upgrade"));
    let args = service_args(&cgroup.path, &[vip], &addrs, &[]);

    // The old daemon installs, and serves for a moment.
    let mut old = Command::new(&old_socklb)
        .arg("run")
        .args(&args)
        .arg("--pin-path")
        .arg(&pin_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the old socklb");
    let ready = ClientRun::new(vip, Some(&cgroup.path), 1);
    for _ in 0..200 {
        if ready.run().iter().all(|attempt| attempt.ok) {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(
        PinPaths::new(&pin_path).map(names::v0::SERVICES).exists(),
        "the old layout is pinned"
    );
    // Connections opened before the upgrade, held across it.
    let mut held = ConnClient::hold_until_released(vip, &cgroup.path, 30, Duration::from_secs(60));
    let mut run = ClientRun::new(vip, Some(&cgroup.path), 1500);
    run.interval_ms = 5;
    let client = run.spawn();
    std::thread::sleep(Duration::from_millis(700));

    // The old daemon stops (its data plane stays); this one starts on the
    // same pins: no uninstall.
    // SAFETY: SIGTERM to the child we started.
    unsafe { libc::kill(old.id() as i32, libc::SIGTERM) };
    assert!(old.wait().expect("old daemon").success());
    let mut daemon = Daemon::start_at("upgrade", &args, pin_path.clone());
    daemon.wait_health(&addrs, true, Duration::from_secs(10));
    assert!(
        daemon.log_shows(
            "upgraded the pinned data plane in place",
            Duration::from_secs(2)
        ),
        "{}",
        daemon.log()
    );
    let attempts = client.finish();
    let counts = spread(&attempts);
    let failed = counts.get("error").copied().unwrap_or(0);

    for program in names::PROGRAMS {
        let maps = maps_of_link(&pin_path, program);
        assert!(
            maps.iter().any(|map| map == names::SOCKETS),
            "{program}'s link runs the new program (its maps: {maps:?})"
        );
    }
    let paths = PinPaths::new(&pin_path);
    for name in names::v0::MAPS {
        if name != names::LEGACY_REDIRECTS {
            assert!(!paths.map(name).exists(), "the old map {name} is unpinned");
        }
    }
    held.release();
    let held = held.finish();
    let shown_vip = held
        .iter()
        .filter(|line| line["peer"] == vip.to_string())
        .count();
    let status = daemon.status().expect("status");
    assert_eq!(status["data_plane"]["attached"], true, "{status}");
    // The backends hold every connection, so a client socket that closed
    // waits in FIN_WAIT2 for the server's side. One whose last ACK was
    // handled while its process held the socket waits there for
    // tcp_fin_timeout (60 s), and is rightly counted live all that time.
    // The servers close their side, and every client socket ends.
    drop(backends);
    daemon.wait_for("live counts back to 0", Duration::from_secs(10), |status| {
        addrs.iter().all(|addr| {
            backend_field(status, &addr.to_string(), "live") == Some(serde_json::json!(0))
        })
    });
    record_figures(&format!(
        "upgrade: from {FIRST_LAYOUT_COMMIT} in place while a client connected every 5 ms: {failed} of {} connects failed; {shown_vip} of {} connections opened before still show the VIP in getpeername; every live count back to 0 after they closed",
        attempts.len(),
        held.len()
    ));
    assert_eq!(
        failed, 0,
        "no connect failed across the upgrade: {counts:?}"
    );
    assert_eq!(
        shown_vip,
        held.len(),
        "getpeername still shows the VIP: {held:?}"
    );
}
