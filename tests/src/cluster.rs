//! A test cluster on one machine: "server" network namespaces joined to the
//! root namespace by veth pairs, with addresses in 198.18.0.0/15, each
//! running a test apiserver. Everything is removed on drop.

use std::{
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

/// The port the test apiservers listen on.
pub const SERVER_PORT: u16 = 6443;

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
}

impl Cluster {
    /// `count` server namespaces, each running a test apiserver.
    pub fn new(count: usize) -> Self {
        crate::require_root();
        let id = CLUSTERS.fetch_add(1, Ordering::Relaxed);
        assert!(id < 60, "too many clusters in one test process");
        let mut cluster = Self {
            servers: Vec::new(),
            id,
        };
        for _ in 0..count {
            cluster.add_server();
        }
        cluster
    }

    /// Adds one more server namespace and starts its apiserver.
    pub fn add_server(&mut self) -> usize {
        let index = self.servers.len();
        assert!(index < 4, "at most four servers per cluster");
        let tag = format!("{}{}{index}", std::process::id() % 10_000, self.id);
        let netns = format!("socklb-{tag}");
        let (host_if, ns_if) = (format!("slh{tag}"), format!("sln{tag}"));
        // 198.18.0.0/15 is for benchmarks and tests (RFC 2544).
        let subnet = self.id * 4 + index as u32;
        let (third, fourth) = (subnet / 64, (subnet % 64) * 4);
        let host_ip = format!("198.18.{third}.{}", fourth + 1);
        let server_ip = format!("198.18.{third}.{}", fourth + 2);
        run("ip", &["netns", "add", &netns]);
        let mut server = Server {
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
                "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
            ],
        );
        run("ip", &["link", "set", &ns_if, "netns", &netns]);
        run(
            "ip",
            &["addr", "add", &format!("{host_ip}/30"), "dev", &host_if],
        );
        run("ip", &["link", "set", &host_if, "up"]);
        server.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{server_ip}/30"),
            "dev",
            &ns_if,
        ]);
        server.exec(&["ip", "link", "set", &ns_if, "up"]);
        server.exec(&["ip", "link", "set", "lo", "up"]);
        server.start();
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
