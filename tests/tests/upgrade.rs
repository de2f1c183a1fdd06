//! An upgrade in place, with no gap: an older socklb (built from this
//! repository's history) runs; then this socklb starts on the same pins
//! while a client connects every 5 ms. From the commit before the ABI was
//! versioned, from the last one with per-socket records in socket
//! storage, and from the hash layout of the socket table (this socklb,
//! told the kernel lacks BPF_CMPXCHG: the layout every release before the
//! array had): connections opened before keep getpeername and exact
//! counts.

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
    Backend, Cgroup, ClientRun, ConnClient, Daemon, FIRST_LAYOUT_COMMIT, SOCKET_STORAGE_COMMIT,
    backend_field, free_port, old_socklb_bin, old_socklb_bin_at, pace_bound, record_figures,
    require_root, service_args, spread, time_until, unique_name,
};

/// The names of the maps the program behind a pinned link uses.
fn maps_of_link(pin_path: &PathBuf, program: &str) -> Vec<String> {
    let fd = sys::open_pinned(&PinPaths::new(pin_path).link(program)).expect("pinned link");
    let link = sys::link_info(fd.as_fd()).expect("link info");
    let program = socklb::dataplane::links::program_by_id(link.prog_id).expect("program");
    let map_ids = program
        .map_ids()
        .ok()
        .flatten()
        .expect("the program's maps");
    map_ids
        .iter()
        .filter_map(|id| aya::maps::MapInfo::from_id(*id).ok())
        .filter_map(|map| map.name_as_str().map(str::to_string))
        .collect()
}

/// An old socklb serving, held connections and a client every 5 ms, then
/// this socklb started on the same pins.
struct Upgraded {
    cgroup: Cgroup,
    backends: Vec<Backend>,
    addrs: Vec<SocketAddr>,
    vip: SocketAddr,
    pin_path: PathBuf,
    daemon: Daemon,
    /// Connections opened before the upgrade, until `finish` takes them.
    held: Option<ConnClient>,
    /// Connects made across the upgrade.
    attempts: Vec<socklb_tests::Attempt>,
}

/// Runs `old_socklb`, then upgrades it in place, and waits until this
/// socklb serves; the client has finished then, the held connections not.
fn upgrade_in_place(
    label: &str,
    old_socklb: &std::path::Path,
    old_env: &[(&str, &str)],
) -> Upgraded {
    let cgroup = Cgroup::new(label);
    let backends: Vec<Backend> = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        .iter()
        .enumerate()
        .map(|(i, ip)| Backend::start_holding(&format!("b{i}"), ip))
        .collect();
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    let vip = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let pin_path = PathBuf::from("/sys/fs/bpf").join(unique_name(label));
    let args = service_args(&cgroup.path, &[vip], &addrs, &[]);

    // The old daemon installs, and serves for a moment.
    let mut old = Command::new(old_socklb)
        .envs(old_env.iter().copied())
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
    // Connections opened before the upgrade, held across it.
    let accepted = || backends.iter().map(Backend::accepted).sum::<usize>();
    let before = accepted();
    let held = ConnClient::hold_until_released(vip, &cgroup.path, 30, Duration::from_secs(60));
    let mut run = ClientRun::new(vip, Some(&cgroup.path), 1500);
    run.interval_ms = 5;
    let client = run.spawn();
    // The old data plane has served the held connections and 100 of the
    // client's connects.
    time_until(
        "connections through the old data plane",
        pace_bound(130, Duration::from_millis(run.interval_ms)),
        || accepted() >= before + 30 + 100,
    );

    // The old daemon stops (its data plane stays); this one starts on the
    // same pins: no uninstall.
    // SAFETY: SIGTERM to the child we started.
    unsafe { libc::kill(old.id() as i32, libc::SIGTERM) };
    assert!(old.wait().expect("old daemon").success());
    let mut daemon = Daemon::start_at(label, &args, pin_path.clone());
    daemon.wait_health(&addrs, true, Duration::from_secs(10));
    let attempts = client.finish();
    for program in names::PROGRAMS {
        let maps = maps_of_link(&pin_path, program);
        assert!(
            [names::SOCKET_TABLE, names::SOCKET_SLOTS]
                .iter()
                .all(|table| maps.iter().any(|map| map == table)),
            "{program}'s link runs the new program (its maps: {maps:?})"
        );
    }
    Upgraded {
        cgroup,
        backends,
        addrs,
        vip,
        pin_path,
        daemon,
        held: Some(held),
        attempts,
    }
}

/// The client sockets the kernel holds live to the backends: the 30 held
/// ones, and any of the client's closed connects still in FIN_WAIT. Only
/// the client's cgroup: the daemon's probes to the same backends are
/// sockets too, and socklb rightly counts none of them.
fn live_client_sockets(cgroup: &Cgroup, addrs: &[SocketAddr]) -> usize {
    let client_cgroup = std::os::unix::fs::MetadataExt::ino(
        &std::fs::metadata(&cgroup.path).expect("the client cgroup"),
    );
    socklb_tests::sockdiag::dump_v4()
        .expect("a sock_diag dump")
        .iter()
        .filter(|socket| {
            addrs.contains(&socket.peer)
                && socket.is_live()
                && socket.cgroup_id == Some(client_cgroup)
        })
        .count()
}

/// Releases the held connections; how many showed the VIP in getpeername
/// (asked after the upgrade), of how many. Then every count must fall to
/// 0 once the servers close their side too.
fn finish(upgraded: &mut Upgraded) -> (usize, usize) {
    let mut client = upgraded.held.take().expect("finished once");
    client.release();
    let held = client.finish();
    let shown_vip = held
        .iter()
        .filter(|line| line["peer"] == upgraded.vip.to_string())
        .count();
    // The backends hold every connection, so a client socket that closed
    // waits in FIN_WAIT2 for the server's side. One whose last ACK was
    // handled while its process held the socket waits there for
    // tcp_fin_timeout (60 s), and is rightly counted live all that time.
    // The servers close their side, and every client socket ends.
    upgraded.backends.clear();
    let addrs = upgraded.addrs.clone();
    upgraded
        .daemon
        .wait_for("live counts back to 0", Duration::from_secs(10), |status| {
            addrs.iter().all(|addr| {
                backend_field(status, &addr.to_string(), "live") == Some(serde_json::json!(0))
            }) && status["data_plane"]["socket_table"]["tracked"] == 0
        });
    (shown_vip, held.len())
}

#[test]
fn an_install_of_the_first_layout_is_upgraded_in_place_with_no_failed_connect() {
    require_root!();
    let mut upgraded = upgrade_in_place("upgrade", &old_socklb_bin(), &[]);
    assert!(
        upgraded.daemon.log_shows(
            "upgraded the pinned data plane in place",
            Duration::from_secs(2)
        ),
        "{}",
        upgraded.daemon.log()
    );
    let counts = spread(&upgraded.attempts);
    let failed = counts.get("error").copied().unwrap_or(0);
    let paths = PinPaths::new(&upgraded.pin_path);
    for name in names::v0::MAPS {
        if name != names::LEGACY_REDIRECTS {
            assert!(!paths.map(name).exists(), "the old map {name} is unpinned");
        }
    }
    let status = upgraded.daemon.status().expect("status");
    assert_eq!(status["data_plane"]["attached"], true, "{status}");
    let (shown_vip, held) = finish(&mut upgraded);
    record_figures(&format!(
        "upgrade: from {FIRST_LAYOUT_COMMIT} in place while a client connected every 5 ms: {failed} of {} connects failed; {shown_vip} of {held} connections opened before still show the VIP in getpeername; every live count back to 0 after they closed",
        upgraded.attempts.len(),
    ));
    assert_eq!(
        failed, 0,
        "no connect failed across the upgrade: {counts:?}"
    );
    assert_eq!(shown_vip, held, "getpeername still shows the VIP");
}

#[test]
fn an_install_of_the_socket_storage_layout_is_upgraded_in_place_with_exact_counts() {
    require_root!();
    let old = old_socklb_bin_at(SOCKET_STORAGE_COMMIT);
    let mut upgraded = upgrade_in_place("upgrade-storage", &old, &[]);
    let paths = PinPaths::new(&upgraded.pin_path);
    assert!(
        paths.map(names::SOCKETS).exists(),
        "the socket storage stays pinned while sockets redirected before hold records in it"
    );
    let addrs = upgraded.addrs.clone();
    let live = |status: &serde_json::Value| -> i64 {
        addrs
            .iter()
            .filter_map(|addr| backend_field(status, &addr.to_string(), "live")?.as_i64())
            .sum()
    };
    // Exactly the client sockets that the kernel holds live to the
    // backends: the 30 held ones, and any of the client's closed connects
    // still in FIN_WAIT. The backends hold every connection, so a closed
    // client socket whose last ACK came while its process held it waits
    // in FIN_WAIT2 for tcp_fin_timeout (60 s), rightly counted; two suites
    // side by side made that happen here (31 counted, 30 expected).
    let live_in_kernel = || live_client_sockets(&upgraded.cgroup, &addrs);
    upgraded.daemon.wait_for(
        "the held connections stay counted, exactly",
        Duration::from_secs(10),
        |status| {
            let kernel = live_in_kernel();
            kernel >= 30 && usize::try_from(live(status)) == Ok(kernel)
        },
    );
    let counts = spread(&upgraded.attempts);
    let failed = counts.get("error").copied().unwrap_or(0);
    let (shown_vip, held) = finish(&mut upgraded);
    // A restart after the last of them closed drops the old storage.
    let args = service_args(&upgraded.cgroup.path, &[upgraded.vip], &upgraded.addrs, &[]);
    upgraded.daemon.restart_with(&args);
    upgraded
        .daemon
        .wait_for("the daemon runs again", Duration::from_secs(10), |status| {
            status["daemon"]["running"] == true
        });
    assert!(
        !paths.map(names::SOCKETS).exists(),
        "the socket storage is unpinned once no socket holds a record in it"
    );
    // `finish` stopped the servers: the connects are refused by the
    // backends' addresses, which only a redirect reaches (nothing listens
    // on the VIP). The kernel's redirect count says each was redirected.
    let redirected = |daemon: &socklb_tests::Daemon| {
        socklb_tests::total_redirects(&daemon.status().expect("status"))
    };
    let before = redirected(&upgraded.daemon);
    let after = ClientRun::new(upgraded.vip, Some(&upgraded.cgroup.path), 20).run();
    let redirected_after = redirected(&upgraded.daemon) - before;
    record_figures(&format!(
        "upgrade: from {SOCKET_STORAGE_COMMIT} (socket storage) in place while a client connected every 5 ms: {failed} of {} connects failed; {shown_vip} of {held} connections opened before show the VIP in getpeername and their 30 live counts fell to exactly 0 as they closed; a restart then unpinned the storage",
        upgraded.attempts.len(),
    ));
    assert_eq!(
        failed, 0,
        "no connect failed across the upgrade: {counts:?}"
    );
    assert_eq!(shown_vip, held, "getpeername still shows the VIP");
    assert_eq!(
        redirected_after,
        after.len() as u64,
        "every connect redirected after the storage went: {after:?}"
    );
}

#[test]
fn an_install_of_the_hash_layout_is_upgraded_to_the_array_with_exact_counts() {
    require_root!();
    let hash_layout = [(
        socklb::dataplane::features::DISABLE_FOR_TEST,
        "socket-slots",
    )];
    let mut upgraded = upgrade_in_place("upgrade-hash", &socklb_tests::socklb_bin(), &hash_layout);
    let paths = PinPaths::new(&upgraded.pin_path);
    assert!(
        paths.map(names::SOCKET_SLOTS).exists(),
        "the array is pinned beside the hash"
    );
    // The 30 held connections' records stay in the hash, where the new
    // programs find them; every connect since went to the array.
    let in_hash = socklb_tests::records_in_hash(&upgraded.pin_path);
    let addrs = upgraded.addrs.clone();
    let live = |status: &serde_json::Value| -> i64 {
        addrs
            .iter()
            .filter_map(|addr| backend_field(status, &addr.to_string(), "live")?.as_i64())
            .sum()
    };
    let status = upgraded.daemon.status().expect("status");
    assert!(
        in_hash >= 30,
        "the held connections' records are in the hash ({in_hash}): {status}"
    );
    assert_eq!(
        status["data_plane"]["socket_table"]["slots"], 32768,
        "{status}"
    );
    upgraded.daemon.wait_for(
        "the held connections stay counted, exactly",
        Duration::from_secs(10),
        |status| {
            let kernel = live_client_sockets(&upgraded.cgroup, &addrs);
            kernel >= 30 && usize::try_from(live(status)) == Ok(kernel)
        },
    );
    let counts = spread(&upgraded.attempts);
    let failed = counts.get("error").copied().unwrap_or(0);
    let (shown_vip, held) = finish(&mut upgraded);
    assert_eq!(
        socklb_tests::records_in_hash(&upgraded.pin_path),
        0,
        "the hash is empty"
    );
    // The array layout cannot go back: the hash layout's programs would
    // not find the records the array holds.
    let args = service_args(&upgraded.cgroup.path, &[upgraded.vip], &upgraded.addrs, &[]);
    upgraded.daemon.env = vec![(hash_layout[0].0.to_string(), hash_layout[0].1.to_string())];
    upgraded.daemon.restart_with(&args);
    let exit = upgraded
        .daemon
        .wait_exit(Duration::from_secs(10))
        .expect("the hash layout refuses to start over the array");
    assert!(!exit.success(), "{}", upgraded.daemon.log());
    assert!(
        upgraded.daemon.log().contains(names::SOCKET_SLOTS),
        "the refusal names the array: {}",
        upgraded.daemon.log()
    );
    record_figures(&format!(
        "upgrade: from the hash layout (this socklb without BPF_CMPXCHG) to the array in place while a client connected every 5 ms: {failed} of {} connects failed; {in_hash} records stayed in the hash and were found there; {shown_vip} of {held} connections opened before show the VIP in getpeername, every live count back to 0 and the hash empty after they closed; going back to the hash layout refused",
        upgraded.attempts.len(),
    ));
    assert_eq!(
        failed, 0,
        "no connect failed across the upgrade: {counts:?}"
    );
    assert_eq!(shown_vip, held, "getpeername still shows the VIP");
}
