//! What the soak runs on: five server namespaces (HTTPS and plain HTTP on
//! each, etcd on the first three), the test apiserver with the
//! EndpointSlice, a k3s state file, the clients' cgroup, the v1 cpu and
//! memory cgroups that hold socklb, and socklb itself. Everything is
//! removed on drop, in the order of the fields, also when the run fails.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use socklb_tests::{
    Cgroup, Daemon, TempDir,
    cluster::{Cluster, helper_bin},
    free_port,
    kube::{KubeApi, SliceSpec},
    pki::Pki,
    unique_name,
};

use super::config::{self, Edits, Inputs};

/// Ports every server namespace serves on.
pub const TLS_PORT: u16 = 6443;
pub const PLAIN_PORT: u16 = 7000;
pub const ETCD_PORT: u16 = 2379;
const ETCD_PEER_PORT: u16 = 2380;
/// The local server's address (loopback: on this host, not in a
/// namespace of the cluster).
const LOCAL_IP: [u8; 4] = [127, 0, 0, 5];
/// Servers that also run an etcd member.
pub const ETCD_MEMBERS: usize = 3;
pub const SERVERS: usize = 5;

/// A process of ours, killed by its PID on drop.
pub struct Process {
    child: Option<Child>,
}

/// Makes a child die with the harness (SIGKILL when the thread that
/// spawned it ends): a harness killed by SIGKILL leaves no server, client
/// or socklb running, and `cargo xtask`'s sweep finds empty namespaces.
pub fn die_with_parent(command: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl(2) is async-signal-safe and touches only the child.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

impl Process {
    pub fn spawn(command: &mut Command, log: &Path) -> Result<Self> {
        let log =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = die_with_parent(command)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {command:?}"))?;
        Ok(Self { child: Some(child) })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn signal(&self, signal: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on the PID of a child we own and have not reaped.
            unsafe { libc::kill(pid as i32, signal) };
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One server namespace's addresses.
#[derive(Debug, Clone)]
pub struct ServerAddrs {
    pub name: String,
    pub netns: String,
    /// Its address on the cluster's bridge, and the second one it moves
    /// to (`server-readdress`).
    pub base: Ipv4Addr,
    pub alt: Ipv4Addr,
}

impl ServerAddrs {
    pub fn tls(&self, moved: bool) -> SocketAddr {
        let ip = if moved { self.alt } else { self.base };
        SocketAddr::from((ip, TLS_PORT))
    }

    pub fn plain(&self) -> SocketAddr {
        SocketAddr::from((self.base, PLAIN_PORT))
    }

    pub fn etcd(&self) -> SocketAddr {
        SocketAddr::from((self.base, ETCD_PORT))
    }
}

/// The v1 cpu and memory cgroups socklb runs in (this machine's cgroups
/// are hybrid: cgroup v2 has no controllers here, so `cpu.max` and
/// `memory.high` do not exist; `cpu.cfs_quota_us` and
/// `memory.limit_in_bytes` stand in for them).
pub struct NodeCgroups {
    pub cpu: PathBuf,
    pub memory: PathBuf,
}

pub const V1_CPU: &str = "/sys/fs/cgroup/cpu";
pub const V1_MEMORY: &str = "/sys/fs/cgroup/memory";

impl NodeCgroups {
    fn new() -> Result<Self> {
        let make = |root: &str, label: &str| -> Result<PathBuf> {
            if !Path::new(root).join("cgroup.procs").exists() {
                bail!(
                    "{root} is not a cgroup v1 hierarchy: the node faults need the v1 cpu and memory controllers"
                );
            }
            let path = Path::new(root).join(unique_name(label));
            std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
            Ok(path)
        };
        let cpu = make(V1_CPU, "soak-cpu")?;
        let memory = make(V1_MEMORY, "soak-mem").inspect_err(|_| {
            let _ = std::fs::remove_dir(&cpu);
        })?;
        Ok(Self { cpu, memory })
    }

    fn write(path: &Path, value: &str) -> Result<()> {
        std::fs::write(path, value)
            .with_context(|| format!("writing {value} to {}", path.display()))
    }

    /// socklb may use `percent` of one CPU.
    pub fn starve(&self, percent: u32) -> Result<()> {
        Self::write(&self.cpu.join("cpu.cfs_period_us"), "100000")?;
        Self::write(
            &self.cpu.join("cpu.cfs_quota_us"),
            &(percent * 1000).to_string(),
        )
    }

    pub fn unstarve(&self) -> Result<()> {
        Self::write(&self.cpu.join("cpu.cfs_quota_us"), "-1")
    }

    pub fn memory_usage(&self) -> Result<u64> {
        let text = std::fs::read_to_string(self.memory.join("memory.usage_in_bytes"))?;
        Ok(text.trim().parse()?)
    }

    /// Reclaim down to the usage now (soft limit), and a hard limit
    /// `headroom` above it.
    pub fn press(&self, headroom: u64) -> Result<u64> {
        let usage = self.memory_usage()?;
        Self::write(
            &self.memory.join("memory.soft_limit_in_bytes"),
            &usage.to_string(),
        )?;
        Self::write(
            &self.memory.join("memory.limit_in_bytes"),
            &(usage + headroom).to_string(),
        )?;
        Ok(usage)
    }

    pub fn relieve(&self) -> Result<()> {
        Self::write(&self.memory.join("memory.limit_in_bytes"), "-1")?;
        Self::write(&self.memory.join("memory.soft_limit_in_bytes"), "-1")?;
        Self::write(&self.memory.join("memory.oom_control"), "0")
    }

    /// Times an allocation hit the limit (`memory.failcnt`).
    pub fn memory_failures(&self) -> u64 {
        std::fs::read_to_string(self.memory.join("memory.failcnt"))
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Processes the memory limit killed (`oom_kill` of memory.oom_control).
    pub fn oom_kills(&self) -> u64 {
        std::fs::read_to_string(self.memory.join("memory.oom_control"))
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|line| line.strip_prefix("oom_kill ")?.trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// The launcher that starts socklb inside both cgroups.
    fn launcher(&self) -> Vec<String> {
        vec![
            "sh".into(),
            "-c".into(),
            format!(
                // setpriv (util-linux) keeps the PID and makes socklb die
                // with the harness.
                "echo $$ > '{}/cgroup.procs' && echo $$ > '{}/cgroup.procs' && exec setpriv --pdeathsig KILL -- \"$@\"",
                self.cpu.display(),
                self.memory.display()
            ),
            "sh".into(),
        ]
    }
}

impl Drop for NodeCgroups {
    fn drop(&mut self) {
        let _ = self.unstarve();
        let _ = self.relieve();
        for (root, path) in [(V1_CPU, &self.cpu), (V1_MEMORY, &self.memory)] {
            // A straggler goes back to the root before the directory goes.
            if let Ok(pids) = std::fs::read_to_string(path.join("cgroup.procs")) {
                for pid in pids.lines() {
                    let _ = std::fs::write(Path::new(root).join("cgroup.procs"), pid);
                }
            }
            for _ in 0..50 {
                if std::fs::remove_dir(path).is_ok() || !path.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// Removes the v1 cgroups of soak runs that are gone (`cargo xtask`'s
/// sweep covers the v2 ones).
pub fn sweep_v1_cgroups() {
    for root in [V1_CPU, V1_MEMORY] {
        let Ok(entries) = std::fs::read_dir(root) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("socklb-test-soak-") && crate::is_leftover(&name) {
                println!("xtask: removing leftover cgroup {}", entry.path().display());
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
}

/// etcdctl (Debian's etcd-client) with a client certificate and bounded
/// timeouts.
#[derive(Debug, Clone)]
pub struct Etcdctl {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl Etcdctl {
    /// Runs `etcdctl ARGS` against `endpoints`, inside `cgroup` when given.
    pub fn run(
        &self,
        endpoints: &str,
        cgroup: Option<&Path>,
        args: &[&str],
    ) -> std::io::Result<std::process::Output> {
        let script = match cgroup {
            Some(_) => r#"echo $$ > "$1/cgroup.procs" && shift && exec "$@""#,
            None => r#"shift && exec "$@""#,
        };
        Command::new("sh")
            .args(["-c", script, "sh"])
            .arg(cgroup.map_or_else(PathBuf::new, Path::to_path_buf))
            .args([
                "etcdctl",
                "--endpoints",
                endpoints,
                "--dial-timeout",
                "2s",
                "--command-timeout",
                "4s",
            ])
            .arg("--cacert")
            .arg(&self.ca)
            .arg("--cert")
            .arg(&self.cert)
            .arg("--key")
            .arg(&self.key)
            .args(args)
            .env("ETCDCTL_API", "3")
            .stdin(Stdio::null())
            .output()
    }
}

/// Everything the soak runs on. Fields drop in order: socklb first.
pub struct World {
    /// None only while the world is being set up.
    daemon: Option<Daemon>,
    pub node: NodeCgroups,
    pub etcd: Vec<Process>,
    pub servers: Vec<Process>,
    /// A server on this host, in the clients' cgroup: the plain service's
    /// sixth backend, the one sockmap acceleration applies to (a backend in
    /// another namespace is not local).
    pub local: Option<Process>,
    pub local_plain: SocketAddr,
    /// Held for its namespaces, which go when it drops.
    _cluster: Cluster,
    pub cgroup: Cgroup,
    pub api: KubeApi,
    pub pki: Pki,
    pub addrs: Vec<ServerAddrs>,
    pub inputs: Inputs,
    pub edits: Edits,
    pub config_path: PathBuf,
    pub metrics: SocketAddr,
    pub slow_ms: u64,
    /// When the first socklb was spawned.
    pub daemon_spawned_ms: u64,
    pub dir: TempDir,
}

/// The alternate address of a server: the same /24, last octet + 20.
fn alt_of(base: Ipv4Addr) -> Ipv4Addr {
    let [a, b, c, d] = base.octets();
    Ipv4Addr::new(a, b, c, d + 20)
}

fn v4(ip: IpAddr) -> Ipv4Addr {
    match ip {
        IpAddr::V4(ip) => ip,
        IpAddr::V6(_) => unreachable!("test clusters are IPv4"),
    }
}

impl World {
    pub fn start() -> Result<Self> {
        let dir = TempDir::new("soak");
        let mut cluster = Cluster::without_servers();
        for _ in 0..SERVERS {
            cluster.add_namespace();
        }
        let addrs: Vec<ServerAddrs> = cluster
            .servers
            .iter()
            .map(|server| ServerAddrs {
                name: server.name.clone(),
                netns: server.netns.clone(),
                base: v4(server.ip()),
                alt: alt_of(v4(server.ip())),
            })
            .collect();
        let names: Vec<Vec<IpAddr>> = addrs
            .iter()
            .map(|a| vec![a.base.into(), a.alt.into()])
            .collect();
        let pki = Pki::create(&dir.0, &names)
            .map_err(|error| anyhow::anyhow!("creating the PKI: {error}"))?;
        let api = KubeApi::start();
        let local_plain = SocketAddr::from((LOCAL_IP, free_port()));
        let inputs = Self::inputs(&addrs, local_plain, &dir, &api, &pki);
        let mut world = Self {
            daemon: None,
            node: NodeCgroups::new()?,
            etcd: Vec::new(),
            servers: Vec::new(),
            local: None,
            local_plain,
            _cluster: cluster,
            cgroup: Cgroup::new("soak"),
            api,
            pki,
            addrs,
            inputs,
            edits: Edits::default(),
            config_path: dir.0.join("socklb.toml"),
            metrics: SocketAddr::from(([127, 0, 0, 1], free_port())),
            slow_ms: config::TIMEOUT.as_millis() as u64 * 8 / 10,
            daemon_spawned_ms: 0,
            dir,
        };
        world.start_servers()?;
        world.put_slice(&[], true);
        world.write_state_file(&[])?;
        config::write(
            &world.config_path,
            &config::render(&world.inputs, world.edits),
            true,
        )?;
        world.daemon_spawned_ms = super::record::now_ms();
        world.daemon = Some(world.new_daemon());
        Ok(world)
    }

    /// What socklb's configuration is made of.
    fn inputs(
        addrs: &[ServerAddrs],
        local_plain: SocketAddr,
        dir: &TempDir,
        api: &KubeApi,
        pki: &Pki,
    ) -> Inputs {
        let vip = || SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut plain_backends: Vec<SocketAddr> = addrs.iter().map(ServerAddrs::plain).collect();
        plain_backends.push(local_plain);
        Inputs {
            api_vip: vip(),
            plain_vip: vip(),
            etcd_vip: vip(),
            plain_backends,
            etcd_backends: addrs
                .iter()
                .take(ETCD_MEMBERS)
                .map(ServerAddrs::etcd)
                .collect(),
            state_file: dir.0.join("k3s-agent-load-balancer.json"),
            kubeconfig: api.kubeconfig(),
            ca: pki.ca.clone(),
            client_cert: pki.client.cert.clone(),
            client_key: pki.client.key.clone(),
        }
    }

    /// Every server of the namespaces, the local one and etcd, each
    /// listening before the next step.
    fn start_servers(&mut self) -> Result<()> {
        for index in 0..SERVERS {
            let server = self.spawn_server(index)?;
            self.servers.push(server);
        }
        for index in 0..SERVERS {
            self.wait_server(index)?;
        }
        self.start_local()?;
        self.start_etcd()
    }

    pub fn daemon(&self) -> &Daemon {
        self.daemon.as_ref().expect("started")
    }

    pub fn daemon_mut(&mut self) -> &mut Daemon {
        self.daemon.as_mut().expect("started")
    }

    /// A server's soakserver, in its namespace.
    pub fn spawn_server(&self, index: usize) -> Result<Process> {
        let addrs = &self.addrs[index];
        let issued = &self.pki.servers[index];
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &addrs.netns])
            .arg(helper_bin("soakserver"))
            .args(["--name", &addrs.name])
            .args(["--tls", &format!("0.0.0.0:{TLS_PORT}")])
            .args(["--plain", &format!("0.0.0.0:{PLAIN_PORT}")])
            .arg("--cert")
            .arg(&issued.cert)
            .arg("--key")
            .arg(&issued.key)
            .args(["--slow-ms", &self.slow_ms.to_string()])
            .args(["--max-seconds", "10800"]);
        Process::spawn(
            &mut command,
            &self.dir.0.join(format!("{}.log", addrs.name)),
        )
    }

    /// The local server, in the clients' cgroup (its accepted sockets are
    /// the other end that sock_ops pairs for acceleration).
    fn start_local(&mut self) -> Result<()> {
        let issued = &self.pki.servers[0];
        let tls = SocketAddr::from((LOCAL_IP, free_port()));
        let mut command = Command::new("sh");
        command
            .args([
                "-c",
                r#"echo $$ > "$1/cgroup.procs" && shift && exec "$@""#,
                "sh",
            ])
            .arg(&self.cgroup.path)
            .arg(helper_bin("soakserver"))
            .args(["--name", "local", "--tls", &tls.to_string()])
            .args(["--plain", &self.local_plain.to_string()])
            .arg("--cert")
            .arg(&issued.cert)
            .arg("--key")
            .arg(&issued.key)
            .args(["--max-seconds", "10800"]);
        self.local = Some(Process::spawn(&mut command, &self.dir.0.join("local.log"))?);
        let addr = self.local_plain;
        if !wait_until(Duration::from_secs(10), || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        }) {
            bail!("the local server does not listen on {addr}");
        }
        Ok(())
    }

    /// Waits until a server answers on its plain port (from outside).
    pub fn wait_server(&self, index: usize) -> Result<()> {
        let addr = self.addrs[index].plain();
        if !wait_until(Duration::from_secs(10), || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        }) {
            bail!("{} does not listen on {addr}", self.addrs[index].name);
        }
        Ok(())
    }

    fn start_etcd(&mut self) -> Result<()> {
        let data = self.dir.0.join("etcd");
        std::fs::create_dir_all(&data)?;
        let initial: Vec<String> = self.addrs[..ETCD_MEMBERS]
            .iter()
            .enumerate()
            .map(|(index, addrs)| format!("m{index}=http://{}:{ETCD_PEER_PORT}", addrs.base))
            .collect();
        for index in 0..ETCD_MEMBERS {
            let addrs = &self.addrs[index];
            let issued = &self.pki.servers[index];
            let mut command = Command::new("ip");
            command
                .args(["netns", "exec", &addrs.netns, "etcd"])
                .args(["--name", &format!("m{index}")])
                .arg("--data-dir")
                .arg(data.join(format!("m{index}")))
                .args([
                    "--listen-client-urls",
                    &format!("https://{}:{ETCD_PORT}", addrs.base),
                ])
                .args([
                    "--advertise-client-urls",
                    &format!("https://{}:{ETCD_PORT}", addrs.base),
                ])
                .args([
                    "--listen-peer-urls",
                    &format!("http://{}:{ETCD_PEER_PORT}", addrs.base),
                ])
                .args([
                    "--initial-advertise-peer-urls",
                    &format!("http://{}:{ETCD_PEER_PORT}", addrs.base),
                ])
                .args(["--initial-cluster", &initial.join(",")])
                .args(["--initial-cluster-state", "new"])
                .args([
                    "--initial-cluster-token",
                    &format!("soak-{}", std::process::id()),
                ])
                .arg("--cert-file")
                .arg(&issued.cert)
                .arg("--key-file")
                .arg(&issued.key)
                .arg("--trusted-ca-file")
                .arg(&self.pki.ca)
                .arg("--client-cert-auth")
                .args([
                    "--heartbeat-interval",
                    "100",
                    "--election-timeout",
                    "1000",
                    "--log-level",
                    "warn",
                ]);
            self.etcd.push(Process::spawn(
                &mut command,
                &self.dir.0.join(format!("etcd-m{index}.log")),
            )?);
        }
        let endpoints: Vec<String> = self
            .inputs
            .etcd_backends
            .iter()
            .map(|addr| format!("https://{addr}"))
            .collect();
        let healthy = wait_until(Duration::from_secs(60), || {
            self.etcdctl()
                .run(&endpoints.join(","), None, &["endpoint", "health"])
                .is_ok_and(|output| output.status.success())
        });
        if !healthy {
            bail!(
                "the etcd members did not become healthy within 60 s (logs in {})",
                data.display()
            );
        }
        Ok(())
    }

    /// etcdctl with this run's client certificate.
    pub fn etcdctl(&self) -> Etcdctl {
        Etcdctl {
            ca: self.pki.ca.clone(),
            cert: self.pki.client.cert.clone(),
            key: self.pki.client.key.clone(),
        }
    }

    /// The api service's TLS address of each server as discovery lists it.
    pub fn api_addrs(&self, moved: &[usize]) -> Vec<SocketAddr> {
        self.addrs
            .iter()
            .enumerate()
            .map(|(index, addrs)| addrs.tls(moved.contains(&index)))
            .collect()
    }

    /// Puts the EndpointSlice of `default/kubernetes`: every server, at
    /// its second address when it has moved, ready unless `unready`.
    pub fn put_slice(&self, moved: &[usize], ready: bool) {
        self.api
            .put_slice("default", "kubernetes", &self.slice_spec(moved, ready));
    }

    /// The EndpointSlice `put_slice` writes.
    pub fn slice_spec(&self, moved: &[usize], ready: bool) -> SliceSpec {
        self.api_addrs(moved).iter().fold(
            SliceSpec::new("kubernetes", "IPv4").with_port("https", TLS_PORT),
            |spec, addr| spec.with_endpoint(&addr.ip().to_string(), ready),
        )
    }

    /// The k3s agent's state file (root-owned, 0600): the servers, each at
    /// its current address; `order` lists indexes to leave out or reorder
    /// (empty: all, in order).
    pub fn write_state_file(&self, moved: &[usize]) -> Result<()> {
        self.write_state_file_with(&self.api_addrs(moved))
    }

    pub fn write_state_file_with(&self, servers: &[SocketAddr]) -> Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let text = serde_json::json!({
            "ServerURL": format!("https://{}", servers[0]),
            "ServerAddresses": servers.iter().map(ToString::to_string).collect::<Vec<_>>(),
        })
        .to_string();
        let path = &self.inputs.state_file;
        let temporary = path.with_extension("tmp");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temporary)?;
        std::io::Write::write_all(&mut file, text.as_bytes())?;
        std::fs::rename(&temporary, path)?;
        Ok(())
    }

    /// `socklb run` flags (Daemon adds the pin path and state directory).
    fn daemon_args(&self) -> Vec<String> {
        vec![
            "--config".into(),
            self.config_path.display().to_string(),
            "--watch-config".into(),
            "--cgroup".into(),
            self.cgroup.path.display().to_string(),
            "--metrics-addr".into(),
            self.metrics.to_string(),
        ]
    }

    /// A socklb daemon, inside the node cgroups, on a pin path of its own.
    fn new_daemon(&self) -> Daemon {
        Daemon::start_launched(
            "soak",
            &self.daemon_args(),
            PathBuf::from("/sys/fs/bpf").join(unique_name("soak")),
            &self.node.launcher(),
            &[],
        )
    }

    /// Every backend of every service, by service.
    pub fn backends(&self, moved: &[usize]) -> Vec<(&'static str, SocketAddr)> {
        let mut all: Vec<(&'static str, SocketAddr)> = self
            .api_addrs(moved)
            .into_iter()
            .map(|addr| (config::API, addr))
            .collect();
        all.extend(
            self.inputs
                .plain_backends
                .iter()
                .map(|addr| (config::PLAIN, *addr)),
        );
        all.extend(
            self.inputs
                .etcd_backends
                .iter()
                .map(|addr| (config::ETCD, *addr)),
        );
        all
    }

    /// Adds or removes a server's second address in its namespace.
    pub fn alt_address(&self, index: usize, add: bool) -> Result<()> {
        let addrs = &self.addrs[index];
        let links = Command::new("ip")
            .args([
                "netns",
                "exec",
                &addrs.netns,
                "ip",
                "-o",
                "-4",
                "addr",
                "show",
            ])
            .output()?;
        let text = String::from_utf8_lossy(&links.stdout);
        let device = text
            .lines()
            .find(|line| line.contains(&format!("{}/", addrs.base)))
            .and_then(|line| line.split_whitespace().nth(1))
            .with_context(|| {
                format!(
                    "the interface with {} in {}: {text}",
                    addrs.base, addrs.netns
                )
            })?
            .to_string();
        let verb = if add { "add" } else { "del" };
        let status = Command::new("ip")
            .args([
                "netns",
                "exec",
                &addrs.netns,
                "ip",
                "addr",
                verb,
                &format!("{}/24", addrs.alt),
                "dev",
                &device,
            ])
            .status()?;
        if !status.success() {
            bail!("ip addr {verb} {} in {}", addrs.alt, addrs.netns);
        }
        Ok(())
    }

    /// Whether another interface of the root namespace has taken the
    /// cluster's subnet (a test cluster of another process that does not
    /// reserve its subnet): from then on, traffic to the servers may reach
    /// someone else's.
    pub fn subnet_taken(&self) -> bool {
        let Ok(output) = Command::new("ip")
            .args(["-4", "-o", "addr", "show"])
            .output()
        else {
            return false;
        };
        let [a, b, c, _] = self.addrs[0].base.octets();
        let ours = format!(" {a}.{b}.{c}.1/24");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|line| line.contains(&ours))
            .count()
            > 1
    }

    /// Drops (or stops dropping) the SYNs to a server's soakserver ports.
    pub fn blackhole(&self, index: usize, on: bool) -> Result<()> {
        let verb = if on { "-A" } else { "-D" };
        let ports = format!("{TLS_PORT},{PLAIN_PORT}");
        let status = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.addrs[index].netns,
                "iptables",
                verb,
                "INPUT",
                "-p",
                "tcp",
                "--syn",
                "-m",
                "multiport",
                "--dports",
                &ports,
                "-j",
                "DROP",
            ])
            .status()
            .context("iptables (Debian package iptables)")?;
        if !status.success() {
            bail!("iptables {verb} in {}", self.addrs[index].netns);
        }
        Ok(())
    }
}

/// Polls `ready` every 50 ms for at most `limit`.
pub fn wait_until(limit: Duration, ready: impl FnMut() -> bool) -> bool {
    socklb_tests::holds_within(limit, Duration::from_millis(50), ready)
}
