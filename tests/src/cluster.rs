//! A test cluster on one machine: "server" network namespaces on one
//! bridge (inside a "switch" namespace of its own, so the host's bridges
//! and forwarding are never touched), with the root namespace on the same
//! bridge. Addresses are in 198.18.0.0/15: 198.18.ID.1 for the root
//! namespace, .2, .3, … for the servers, which can also reach each other
//! (an etcd cluster needs that). Everything is removed on drop.

use std::{
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

/// The port the test apiservers listen on.
pub const SERVER_PORT: u16 = 6443;

/// The `/work` requests one test apiserver serves per second, at most.
pub const WORK_PER_SECOND: u32 = 300;

static CLUSTERS: AtomicU32 = AtomicU32::new(0);

fn run(program: &str, args: &[&str]) {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|error| panic!("running {program} {args:?}: {error}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A binary built next to the tests (testapiserver, testagent).
pub fn helper_bin(name: &str) -> PathBuf {
    crate::lbclient_bin().with_file_name(name)
}

/// One server namespace.
pub struct Server {
    pub name: String,
    pub netns: String,
    pub addr: SocketAddr,
    process: Option<Child>,
    blackholed: bool,
}

impl Server {
    /// The server's IP address.
    pub fn ip(&self) -> std::net::IpAddr {
        self.addr.ip()
    }

    /// Starts any program in the server's namespace in place of the test
    /// apiserver (killed by PID like it); its output goes to `log`.
    pub fn spawn_program(&mut self, program: &str, args: &[String], log: &std::path::Path) {
        self.kill();
        let log = std::fs::File::create(log).expect("server log");
        let child = Command::new("ip")
            .args(["netns", "exec", &self.netns, program])
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("starting {program} in {}: {error}", self.netns));
        self.process = Some(child);
    }

    fn exec(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", self.netns.as_str()];
        all.extend_from_slice(args);
        run("ip", &all);
    }

    fn spawn(&mut self, hang: bool) {
        self.kill();
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.netns])
            .arg(helper_bin("testapiserver"))
            .args(["--listen", &self.addr.to_string(), "--name", &self.name])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if hang {
            command.arg("--hang");
        }
        self.process = Some(
            command
                .spawn()
                .unwrap_or_else(|error| panic!("starting {}: {error}", self.name)),
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_err() {
            assert!(
                Instant::now() < deadline,
                "{} did not start listening on {}",
                self.name,
                self.addr
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts (or restarts) the server, answering normally.
    pub fn start(&mut self) {
        self.spawn(false);
    }

    /// Restarts it so that it accepts TCP and never answers.
    pub fn hang(&mut self) {
        self.spawn(true);
    }

    /// Makes the running server hang in place (SIGUSR1): it keeps accepting
    /// TCP and answers nothing, with no moment of refused connects.
    pub fn hang_in_place(&self) {
        let child = self.process.as_ref().expect("the server runs");
        // SAFETY: kill(2) on the PID of a child we started and still own
        // (`ip netns exec` replaces itself with the server).
        unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
    }

    /// Makes the test apiserver answer `/readyz` and `/ping` 1.5 s late
    /// (SIGUSR2), or on time again: a server too slow for a probe's 1 s
    /// timeout, not for its agents' 2 s.
    pub fn toggle_slow(&self) {
        self.signal(libc::SIGUSR2);
    }

    /// Stops the server process in place (SIGSTOP): the kernel still
    /// accepts TCP for it, and nothing answers until `resume`.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Lets a paused server run again (SIGCONT); it answers what waited.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: i32) {
        let child = self.process.as_ref().expect("the server runs");
        // SAFETY: kill(2) on the PID of a child we started and still own
        // (`ip netns exec` replaces itself with the server).
        unsafe { libc::kill(child.id() as i32, signal) };
    }

    /// Kills the server process (SIGKILL, by the PID we started).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.process.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Drops incoming SYNs to the server port inside its namespace.
    pub fn blackhole(&mut self) {
        let port = SERVER_PORT.to_string();
        self.exec(&[
            "iptables", "-A", "INPUT", "-p", "tcp", "--syn", "--dport", &port, "-j", "DROP",
        ]);
        self.blackholed = true;
    }

    /// Drops incoming SYNs that arrive with this IP TTL, as a distant
    /// network would delay them: a connect with that TTL stays in SYN_SENT.
    pub fn drop_syns_with_ttl(&mut self, ttl: u8) {
        let (port, ttl) = (SERVER_PORT.to_string(), ttl.to_string());
        self.exec(&[
            "iptables", "-A", "INPUT", "-p", "tcp", "--syn", "--dport", &port, "-m", "ttl",
            "--ttl-eq", &ttl, "-j", "DROP",
        ]);
    }

    pub fn unblackhole(&mut self) {
        let port = SERVER_PORT.to_string();
        self.exec(&[
            "iptables", "-D", "INPUT", "-p", "tcp", "--syn", "--dport", &port, "-j", "DROP",
        ]);
        self.blackholed = false;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        // Deleting the namespace also removes its veth pair.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
    }
}

/// The servers of one test.
pub struct Cluster {
    pub servers: Vec<Server>,
    id: u32,
    tag: String,
    switch: String,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Servers first (they are dropped after this body otherwise).
        self.servers.clear();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.switch])
            .status();
        let _ = std::fs::remove_file(reservation(self.id));
    }
}

/// Where test clusters reserve their /24, one file per id holding the
/// PID that uses it: two test processes whose PIDs give the same id would
/// otherwise both route 198.x.y.0/24 from the root namespace, and each
/// reach the other's servers.
const RESERVATIONS: &str = "/run/socklb-test-clusters";

fn reservation(id: u32) -> PathBuf {
    PathBuf::from(RESERVATIONS).join(id.to_string())
}

/// Takes the id's reservation: a new file, or one whose process is gone.
/// An id whose subnet the root namespace already has (a cluster of a
/// process that does not reserve) is passed over.
fn reserve(id: u32, root_addrs: &str) -> bool {
    if root_addrs.contains(&format!(" 198.{}.{}.1/24", 18 + id / 256, id % 256)) {
        return false;
    }
    let path = reservation(id);
    for _ in 0..2 {
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(mut file) => {
                let _ =
                    std::io::Write::write_all(&mut file, std::process::id().to_string().as_bytes());
                return true;
            }
            Err(_) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let alive = holder
                    .trim()
                    .parse::<u32>()
                    .is_ok_and(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists());
                if alive {
                    return false;
                }
                let _ = std::fs::remove_file(&path);
            }
        }
    }
    false
}

/// A free cluster id, from `preferred` on (512 ids: 198.18.0.0/15).
fn reserve_id(preferred: u32) -> u32 {
    let _ = std::fs::create_dir_all(RESERVATIONS);
    let root_addrs = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
        .unwrap_or_default();
    (0..512)
        .map(|offset| (preferred + offset) % 512)
        .find(|id| reserve(*id, &root_addrs))
        .unwrap_or_else(|| panic!("every test cluster subnet of 198.18.0.0/15 is in use"))
}

impl Cluster {
    /// `count` server namespaces, each running a test apiserver.
    pub fn new(count: usize) -> Self {
        let mut cluster = Self::without_servers();
        for _ in 0..count {
            let index = cluster.add_namespace();
            cluster.servers[index].start();
        }
        cluster
    }

    /// The switch and the root namespace's port on it, and no server yet.
    pub fn without_servers() -> Self {
        crate::require_root();
        // The subnet comes from the PID and a counter, so that two test
        // processes on one machine do not share addresses.
        let count = CLUSTERS.fetch_add(1, Ordering::Relaxed);
        let id = reserve_id((std::process::id() % 128) * 4 + count % 4);
        let tag = format!("{}x{count}", std::process::id() % 100_000);
        let switch = format!("socklb-{tag}-sw");
        let cluster = Self {
            servers: Vec::new(),
            id,
            tag,
            switch,
        };
        run("ip", &["netns", "add", &cluster.switch]);
        cluster.in_switch(&["ip", "link", "add", "br0", "type", "bridge"]);
        cluster.in_switch(&["ip", "link", "set", "br0", "up"]);
        let (root_if, port_if) = (format!("sr{}", cluster.tag), format!("sp{}", cluster.tag));
        run(
            "ip",
            &[
                "link", "add", &root_if, "type", "veth", "peer", "name", &port_if,
            ],
        );
        cluster.plug(&port_if);
        run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/24", cluster.ip(1)),
                "dev",
                &root_if,
            ],
        );
        run("ip", &["link", "set", &root_if, "up"]);
        cluster
    }

    fn in_switch(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", self.switch.as_str()];
        all.extend_from_slice(args);
        run("ip", &all);
    }

    /// Moves a veth end into the switch namespace and onto its bridge.
    fn plug(&self, interface: &str) {
        run("ip", &["link", "set", interface, "netns", &self.switch]);
        self.in_switch(&["ip", "link", "set", interface, "master", "br0"]);
        self.in_switch(&["ip", "link", "set", interface, "up"]);
    }

    /// Host `host` of this cluster's /24 (198.18.0.0/15 is for tests).
    fn ip(&self, host: u32) -> String {
        format!("198.{}.{}.{host}", 18 + self.id / 256, self.id % 256)
    }

    /// Adds one more server namespace and starts its apiserver.
    pub fn add_server(&mut self) -> usize {
        let index = self.add_namespace();
        self.servers[index].start();
        index
    }

    /// Adds one more server namespace, with nothing running in it.
    pub fn add_namespace(&mut self) -> usize {
        let index = self.servers.len();
        assert!(index < 8, "at most eight servers per cluster");
        let netns = format!("socklb-{}-s{index}", self.tag);
        let (server_if, port_if) = (
            format!("ss{}{index}", self.tag),
            format!("sq{}{index}", self.tag),
        );
        let server_ip = self.ip(index as u32 + 2);
        run("ip", &["netns", "add", &netns]);
        let server = Server {
            name: format!("s{index}"),
            netns: netns.clone(),
            addr: format!("{server_ip}:{SERVER_PORT}")
                .parse()
                .expect("address"),
            process: None,
            blackholed: false,
        };
        run(
            "ip",
            &[
                "link", "add", &server_if, "type", "veth", "peer", "name", &port_if,
            ],
        );
        self.plug(&port_if);
        run("ip", &["link", "set", &server_if, "netns", &netns]);
        server.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{server_ip}/24"),
            "dev",
            &server_if,
        ]);
        server.exec(&["ip", "link", "set", &server_if, "up"]);
        server.exec(&["ip", "link", "set", "lo", "up"]);
        self.servers.push(server);
        index
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.servers.iter().map(|server| server.addr).collect()
    }
}

/// One request as testagent reports it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct AgentRequest {
    pub ok: bool,
    pub server: Option<String>,
    pub attempts: u32,
    pub ms: u64,
    pub errors: Vec<String>,
    pub failed_ms: Vec<u64>,
}

/// How to run testagent processes.
#[derive(Debug, Clone)]
pub struct AgentRun {
    pub vip: SocketAddr,
    pub cgroup: PathBuf,
    pub path: &'static str,
    pub requests: u32,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub retries: u32,
}

impl AgentRun {
    /// Starts `count` agents at once.
    pub fn spawn(&self, count: usize) -> Vec<Agent> {
        (0..count)
            .map(|_| {
                let child = Command::new(helper_bin("testagent"))
                    .args(["--addr", &self.vip.to_string(), "--cgroup"])
                    .arg(&self.cgroup)
                    .args(["--path", self.path])
                    .args(["--requests", &self.requests.to_string()])
                    .args(["--interval-ms", &self.interval_ms.to_string()])
                    .args(["--timeout-ms", &self.timeout_ms.to_string()])
                    .args(["--retries", &self.retries.to_string()])
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap_or_else(|error| panic!("starting testagent: {error}"));
                Agent { child: Some(child) }
            })
            .collect()
    }
}

/// A running testagent, killed on drop if not finished.
pub struct Agent {
    child: Option<Child>,
}

impl Agent {
    pub fn finish(mut self) -> Vec<AgentRequest> {
        let output = self
            .child
            .take()
            .expect("running")
            .wait_with_output()
            .expect("testagent");
        assert!(
            output.status.success(),
            "testagent: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|error| panic!("{line:?}: {error}"))
            })
            .collect()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits for all agents and returns every request.
pub fn finish_all(agents: Vec<Agent>) -> Vec<AgentRequest> {
    agents.into_iter().flat_map(Agent::finish).collect()
}

/// Requests served per server, and the failed ones under "failed".
pub fn served(requests: &[AgentRequest]) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for request in requests {
        let key = request.server.clone().unwrap_or_else(|| "failed".into());
        *counts.entry(key).or_default() += 1;
    }
    counts
}
