//! `cargo xtask demo`: socklb in front of three loopback backends.

use std::{
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use socklb_tests::{Backend, Cgroup, ClientRun, Daemon, spread};

/// The embedded default: one VIP, three backends on loopback aliases.
const VIP: &str = "127.0.0.1:16444";
const BACKENDS: [(&str, &str); 3] = [
    ("server-a", "127.0.0.2:16443"),
    ("server-b", "127.0.0.3:16443"),
    ("server-c", "127.0.0.4:16443"),
];
const CONNECTS: u32 = 300;

pub fn run(root: &Path) -> Result<()> {
    if !crate::is_root() {
        bail!("cargo xtask demo loads eBPF programs and creates a cgroup: run it as root");
    }
    // SAFETY: set before any thread starts; the helpers read them.
    unsafe {
        std::env::set_var("SOCKLB_BIN", root.join("target/debug/socklb"));
        std::env::set_var("LBCLIENT_BIN", root.join("target/debug/lbclient"));
    }
    let vip: SocketAddr = VIP.parse()?;
    let mut backends: Vec<Backend> = BACKENDS
        .iter()
        .map(|(name, addr)| Backend::start_at(name, addr.parse().expect("literal address")))
        .collect();
    let addrs: Vec<SocketAddr> = backends.iter().map(|backend| backend.addr).collect();
    println!("demo: backends {} listening", names(&backends));

    let cgroup = Cgroup::new("demo");
    println!("demo: clients run in cgroup {}", cgroup.path.display());
    let args = socklb_tests::service_args(&cgroup.path, &[vip], &addrs, &["--name", "demo"]);
    let mut daemon = Daemon::start("demo", &args);
    println!("demo: socklb {}", daemon.args.join(" "));
    daemon.wait_health(&addrs, true, Duration::from_secs(10));

    traffic("all three backends healthy", vip, &cgroup);

    backends[1].stop();
    let stopped = Instant::now();
    println!("demo: stopped {}", backends[1].name);
    daemon.wait_health(&addrs[1..2], false, Duration::from_secs(10));
    println!(
        "demo: socklb took {:?} to take it out of the table",
        stopped.elapsed()
    );
    traffic(&format!("{} down", backends[1].name), vip, &cgroup);

    backends[1].resume();
    let started = Instant::now();
    println!("demo: restarted {}", backends[1].name);
    daemon.wait_health(&addrs[1..2], true, Duration::from_secs(10));
    println!("demo: socklb took {:?} to put it back", started.elapsed());
    traffic(&format!("{} back", backends[1].name), vip, &cgroup);

    let status = socklb_tests::socklb(&[
        "status",
        "--pin-path",
        &daemon.pin_path.display().to_string(),
    ]);
    println!(
        "demo: socklb status\n{}",
        String::from_utf8_lossy(&status.stdout)
    );

    daemon.signal(libc::SIGTERM);
    match daemon.wait_exit(Duration::from_secs(10)) {
        Some(status) if status.success() => {
            println!(
                "demo: socklb stopped cleanly on SIGTERM (its data plane stays until cleanup)"
            );
        }
        Some(status) => bail!("socklb stopped on SIGTERM with {status}:\n{}", daemon.log()),
        None => bail!(
            "socklb did not stop within 10 s of SIGTERM:\n{}",
            daemon.log()
        ),
    }
    drop(daemon);
    drop(cgroup);
    drop(backends);
    println!("demo: cleaned up (backends stopped, pins removed, cgroup removed)");
    Ok(())
}

fn names(backends: &[Backend]) -> String {
    backends
        .iter()
        .map(|backend| format!("{}={}", backend.name, backend.addr))
        .collect::<Vec<_>>()
        .join(", ")
}

fn traffic(what: &str, vip: SocketAddr, cgroup: &Cgroup) {
    let attempts = ClientRun::new(vip, Some(&cgroup.path), CONNECTS).run();
    let counts = spread(&attempts);
    let shown: Vec<String> = counts
        .iter()
        .map(|(name, count)| format!("{name} {count}"))
        .collect();
    println!(
        "demo: {CONNECTS} connects to {vip}, {what}: {}",
        shown.join(", ")
    );
}
