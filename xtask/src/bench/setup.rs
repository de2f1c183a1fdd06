//! The lab: three loopback backends, and four routes to them. Direct, socklb
//! (a VIP rewritten at connect()), HAProxy and an nginx stream proxy, the
//! last two configured the way kubespray configures its node-local proxies.

use std::{
    collections::HashSet,
    fmt::Write as _,
    fs,
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use socklb_tests::{Cgroup, Daemon};

use super::{
    Route,
    process::{ScratchDir, Supervised, check_interrupted, in_cgroup},
    tools::NGINX_STREAM_MODULE,
};

/// Where the backends listen; the proxies and VIPs listen on 127.0.0.1.
pub const BACKEND_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// Where the same backends listen a second time, inside socklb's cgroup,
/// for the sockmap route (its sock_ops program must see their sockets).
pub const ACCELERATED_BACKEND_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
const FRONT_IP: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// The file wrk fetches, and its size.
pub const SMALL_FILE: &str = "small.txt";
const SMALL_FILE_BYTES: usize = 100;

/// HAProxy's connection ceiling, below the hard open-files limit (each
/// proxied connection holds two descriptors).
const HAPROXY_MAXCONN: u32 = 4000;

const READY_LIMIT: Duration = Duration::from_secs(15);

/// The three services a client can reach, as one route exposes them.
#[derive(Debug, Clone, Copy)]
pub struct Targets {
    pub http: SocketAddr,
    pub sockperf: SocketAddr,
    pub iperf: SocketAddr,
}

/// How a client reaches the backends on one route, and from which cgroup.
pub struct RouteSetup {
    pub route: Route,
    pub targets: Targets,
    pub cgroup: PathBuf,
}

/// Everything the measurements run against. The field order is the drop
/// order: socklb and the proxies stop before the backends they point at,
/// and the cgroups go last, children before their parent.
pub struct Lab {
    pub daemon: Daemon,
    pub nginx_proxy: Supervised,
    pub haproxy: Supervised,
    pub backends: Vec<Supervised>,
    /// The backends of the sockmap route, in socklb's cgroup.
    pub accelerated_backends: Vec<Supervised>,
    backend: Targets,
    accelerated_backend: Targets,
    /// Held only to be removed on drop: the two client cgroups, then their
    /// parent (a Vec drops its elements in order).
    _cgroups: Vec<Cgroup>,
    pub routes: Vec<RouteSetup>,
    /// (name, text) of each proxy configuration, for the report.
    pub configs: Vec<(String, String)>,
}

impl Lab {
    pub fn route(&self, route: Route) -> &RouteSetup {
        self.routes
            .iter()
            .find(|setup| setup.route == route)
            .expect("every route is set up")
    }

    /// The backends a route ends at.
    pub fn backend_of(&self, route: Route) -> Targets {
        if route == Route::Sockmap {
            self.accelerated_backend
        } else {
            self.backend
        }
    }

    /// Fails if a server died during a measurement.
    pub fn ensure_running(&mut self) -> Result<()> {
        for server in self
            .backends
            .iter_mut()
            .chain(self.accelerated_backends.iter_mut())
            .chain([&mut self.haproxy, &mut self.nginx_proxy])
        {
            server.ensure_running()?;
        }
        Ok(())
    }

    /// `socket_table_size`: socklb's `socket-table-size`, when not the
    /// default.
    pub fn start(scratch: &ScratchDir, socket_table_size: Option<u32>) -> Result<Self> {
        let ports = Ports::pick()?;
        // Declared first so they are removed last if a later step fails.
        let parent_cgroup = Cgroup::new("bench");
        // Clients of direct, HAProxy and nginx run in a sibling cgroup with
        // no program attached: same kind of cgroup, no connect() hook.
        let plain_cgroup = parent_cgroup.child("plain");
        let socklb_cgroup = parent_cgroup.child("socklb");
        println!(
            "bench: client cgroups {} (socklb attached) and {} (nothing attached)",
            socklb_cgroup.path.display(),
            plain_cgroup.path.display()
        );
        let backends = start_backends(scratch, "backend", &ports.backend, None)?;
        println!(
            "bench: backends: nginx http://{}/{SMALL_FILE}, sockperf server {}, iperf3 server {}",
            ports.backend.http, ports.backend.sockperf, ports.backend.iperf
        );
        let accelerated_backends = start_backends(
            scratch,
            "accelerated",
            &ports.accelerated_backend,
            Some(&socklb_cgroup.path),
        )?;
        println!(
            "bench: the same backends in socklb's cgroup for the sockmap route: {:?}",
            ports.accelerated_backend
        );
        let proxies = Proxies::start(scratch, &ports)?;
        let (daemon, socklb_config) =
            start_socklb(scratch, &ports, &socklb_cgroup.path, socket_table_size)?;
        Ok(Self {
            daemon,
            nginx_proxy: proxies.nginx,
            haproxy: proxies.haproxy,
            backends,
            accelerated_backends,
            backend: ports.backend,
            accelerated_backend: ports.accelerated_backend,
            routes: ports.routes(&plain_cgroup.path, &socklb_cgroup.path),
            _cgroups: vec![socklb_cgroup, plain_cgroup, parent_cgroup],
            configs: vec![
                ("socklb.toml".into(), socklb_config),
                ("haproxy.cfg".into(), proxies.haproxy_config),
                ("nginx-proxy.conf".into(), proxies.nginx_config),
            ],
        })
    }
}

/// Every address of the lab: the backends, and each route's front.
struct Ports {
    backend: Targets,
    accelerated_backend: Targets,
    vips: Targets,
    accelerated_vips: Targets,
    haproxy: Targets,
    nginx: Targets,
}

impl Ports {
    fn pick() -> Result<Self> {
        let mut ports = PortPicker::default();
        let mut on = |ip: Ipv4Addr| -> Result<Targets> {
            Ok(Targets {
                http: ports.pick(ip)?,
                sockperf: ports.pick(ip)?,
                iperf: ports.pick(ip)?,
            })
        };
        Ok(Self {
            backend: on(BACKEND_IP)?,
            vips: on(FRONT_IP)?,
            haproxy: on(FRONT_IP)?,
            nginx: on(FRONT_IP)?,
            accelerated_vips: on(FRONT_IP)?,
            accelerated_backend: on(ACCELERATED_BACKEND_IP)?,
        })
    }

    /// Each route: where its client connects, from which cgroup.
    fn routes(&self, plain: &Path, socklb: &Path) -> Vec<RouteSetup> {
        let setup = |route, targets, cgroup: &Path| RouteSetup {
            route,
            targets,
            cgroup: cgroup.to_path_buf(),
        };
        vec![
            setup(Route::Direct, self.backend, plain),
            setup(Route::Socklb, self.vips, socklb),
            setup(Route::Sockmap, self.accelerated_vips, socklb),
            setup(Route::Haproxy, self.haproxy, plain),
            setup(Route::Nginx, self.nginx, plain),
        ]
    }
}

/// HAProxy and the nginx stream proxy, running, with their configurations.
struct Proxies {
    haproxy: Supervised,
    nginx: Supervised,
    haproxy_config: String,
    nginx_config: String,
}

impl Proxies {
    fn start(scratch: &ScratchDir, ports: &Ports) -> Result<Self> {
        let haproxy_config = haproxy_config(&ports.haproxy, &ports.backend);
        let haproxy_path = scratch.file("haproxy.cfg");
        fs::write(&haproxy_path, &haproxy_config)?;
        let mut haproxy = Supervised::spawn(
            "haproxy",
            Command::new("haproxy")
                .arg("-f")
                .arg(&haproxy_path)
                .arg("-db"),
            &scratch.file("haproxy.log"),
        )?;
        wait_ready(&mut haproxy, &all_of(&ports.haproxy))?;
        println!(
            "bench: HAProxy (mode tcp, leastconn, check inter 1s) on {:?}",
            ports.haproxy
        );
        let nginx_config = nginx_proxy_config(scratch, &ports.nginx, &ports.backend);
        let mut nginx = start_nginx(scratch, "nginx-proxy", &nginx_config, None)?;
        wait_ready(&mut nginx, &all_of(&ports.nginx))?;
        println!(
            "bench: nginx stream proxy (least_conn) on {:?}",
            ports.nginx
        );
        Ok(Self {
            haproxy,
            nginx,
            haproxy_config,
            nginx_config,
        })
    }
}

/// socklb on the lab's VIPs, in `cgroup`, every backend probed healthy;
/// with its configuration.
fn start_socklb(
    scratch: &ScratchDir,
    ports: &Ports,
    cgroup: &Path,
    socket_table_size: Option<u32>,
) -> Result<(Daemon, String)> {
    let mut config = socket_table_size
        .map(|size| format!("socket-table-size = {size}\n\n"))
        .unwrap_or_default();
    config += &socklb_config(
        &ports.vips,
        &ports.backend,
        &ports.accelerated_vips,
        &ports.accelerated_backend,
    );
    let path = scratch.file("socklb.toml");
    fs::write(&path, &config)?;
    let args = vec![
        "--config".to_string(),
        path.display().to_string(),
        "--cgroup".to_string(),
        cgroup.display().to_string(),
    ];
    let mut daemon = Daemon::start("bench", &args);
    let wanted: Vec<String> = all_of(&ports.backend)
        .iter()
        .chain(&all_of(&ports.accelerated_backend))
        .map(ToString::to_string)
        .collect();
    daemon.wait_for("every backend probed and healthy", READY_LIMIT, |status| {
        wanted.iter().all(|addr| {
            ["healthy", "probed"].iter().all(|field| {
                socklb_tests::backend_field(status, addr, field)
                    == Some(serde_json::Value::Bool(true))
            })
        })
    });
    println!(
        "bench: socklb (pid {}) VIPs {:?}, pins {}",
        daemon.pid(),
        ports.vips,
        daemon.pin_path.display()
    );
    Ok((daemon, config))
}

fn all_of(targets: &Targets) -> [SocketAddr; 3] {
    [targets.http, targets.sockperf, targets.iperf]
}

/// Hands out ports that are free now, each once.
#[derive(Default)]
struct PortPicker {
    taken: HashSet<u16>,
}

impl PortPicker {
    fn pick(&mut self, ip: Ipv4Addr) -> Result<SocketAddr> {
        for _ in 0..100 {
            let listener = TcpListener::bind((ip, 0)).with_context(|| format!("binding {ip}:0"))?;
            let addr = listener.local_addr()?;
            if self.taken.insert(addr.port()) {
                return Ok(addr);
            }
        }
        bail!("no free port on {ip}")
    }
}

/// Waits until the server accepts on every address, at most READY_LIMIT.
fn wait_ready(server: &mut Supervised, addrs: &[SocketAddr]) -> Result<()> {
    let deadline = Instant::now() + READY_LIMIT;
    for addr in addrs {
        loop {
            check_interrupted()?;
            server.ensure_running()?;
            if TcpStream::connect_timeout(addr, Duration::from_millis(200)).is_ok() {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "{} does not accept on {addr} after {READY_LIMIT:?}",
                    server.name
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    server.note_children();
    Ok(())
}

/// nginx, sockperf and iperf3 servers on `backend`'s addresses, in
/// `cgroup` if given; `name` keeps their files apart.
fn start_backends(
    scratch: &ScratchDir,
    name: &str,
    backend: &Targets,
    cgroup: Option<&Path>,
) -> Result<Vec<Supervised>> {
    let www = scratch.file(&format!("www-{name}"));
    fs::create_dir(&www)?;
    let mut body = "socklb bench ".repeat(SMALL_FILE_BYTES / 13 + 1);
    body.truncate(SMALL_FILE_BYTES - 1);
    body.push('\n');
    fs::write(www.join(SMALL_FILE), body)?;

    let nginx_name = format!("nginx-{name}");
    let mut nginx = start_nginx(
        scratch,
        &nginx_name,
        &nginx_backend_config(scratch, &nginx_name, &www, backend.http),
        cgroup,
    )?;
    wait_ready(&mut nginx, &[backend.http])?;

    let command = |program: &str, args: &[String]| match cgroup {
        Some(cgroup) => in_cgroup(cgroup, None, program, args),
        None => {
            let mut command = Command::new(program);
            command.args(args);
            command
        }
    };
    let words = |list: &[&str]| -> Vec<String> { list.iter().map(ToString::to_string).collect() };
    let mut sockperf = Supervised::spawn(
        "sockperf server",
        &mut command(
            "sockperf",
            &words(&[
                "server",
                "--tcp",
                "-i",
                &backend.sockperf.ip().to_string(),
                "-p",
                &backend.sockperf.port().to_string(),
            ]),
        ),
        &scratch.file(&format!("sockperf-{name}.log")),
    )?;
    wait_ready(&mut sockperf, &[backend.sockperf])?;

    let mut iperf = Supervised::spawn(
        "iperf3 server",
        &mut command(
            "iperf3",
            &words(&[
                "-s",
                "-B",
                &backend.iperf.ip().to_string(),
                "-p",
                &backend.iperf.port().to_string(),
            ]),
        ),
        &scratch.file(&format!("iperf3-{name}.log")),
    )?;
    wait_ready(&mut iperf, &[backend.iperf])?;
    Ok(vec![nginx, sockperf, iperf])
}

/// An nginx master in the foreground (`daemon off`), with its own pid and
/// error log in the scratch directory.
fn start_nginx(
    scratch: &ScratchDir,
    name: &str,
    config: &str,
    cgroup: Option<&Path>,
) -> Result<Supervised> {
    let path = scratch.file(&format!("{name}.conf"));
    fs::write(&path, config)?;
    let args = vec![
        "-p".to_string(),
        scratch.path.display().to_string(),
        "-e".to_string(),
        scratch
            .file(&format!("{name}.error.log"))
            .display()
            .to_string(),
        "-c".to_string(),
        path.display().to_string(),
    ];
    let mut command = match cgroup {
        Some(cgroup) => in_cgroup(cgroup, None, "nginx", &args),
        None => {
            let mut command = Command::new("nginx");
            command.args(&args);
            command
        }
    };
    Supervised::spawn(name, &mut command, &scratch.file(&format!("{name}.log")))
}

/// Settings both nginx instances share: their own pid file, foreground.
fn nginx_main(scratch: &ScratchDir, name: &str) -> String {
    format!(
        "daemon off;\n\
         pid {pid};\n\
         error_log {log} notice;\n\
         worker_processes 2;\n\
         worker_rlimit_nofile 16384;\n\
         worker_shutdown_timeout 10s;\n\
         events {{\n  multi_accept on;\n  use epoll;\n  worker_connections 8192;\n}}\n",
        pid = scratch.file(&format!("{name}.pid")).display(),
        log = scratch.file(&format!("{name}.error.log")).display(),
    )
}

fn nginx_backend_config(
    scratch: &ScratchDir,
    name: &str,
    www: &Path,
    listen: SocketAddr,
) -> String {
    let mut text = nginx_main(scratch, name);
    let temp = |kind: &str| {
        scratch
            .file(&format!("{name}-{kind}"))
            .display()
            .to_string()
    };
    // Keep-alive connections live for the whole run: wrk must not be made to
    // reconnect in the keep-alive measure.
    let _ = write!(
        text,
        "http {{\n  access_log off;\n  default_type text/plain;\n  keepalive_requests 1000000;\n  \
         keepalive_timeout 75s;\n  client_body_temp_path {};\n  proxy_temp_path {};\n  \
         fastcgi_temp_path {};\n  uwsgi_temp_path {};\n  scgi_temp_path {};\n  \
         server {{\n    listen {listen} backlog=4096;\n    root {};\n  }}\n}}\n",
        temp("body"),
        temp("proxy"),
        temp("fastcgi"),
        temp("uwsgi"),
        temp("scgi"),
        www.display()
    );
    text
}

/// kubespray's node-local nginx (roles/kubernetes/node/templates/
/// loadbalancer/nginx.conf.j2): a stream proxy with least_conn, one server
/// block per service. worker_rlimit_nofile and worker_connections are lower
/// than kubespray's, to fit this machine's open-files limit.
fn nginx_proxy_config(scratch: &ScratchDir, front: &Targets, backend: &Targets) -> String {
    let mut text = String::new();
    if Path::new(NGINX_STREAM_MODULE).exists() {
        let _ = writeln!(text, "load_module {NGINX_STREAM_MODULE};");
    }
    text.push_str(&nginx_main(scratch, "nginx-proxy"));
    text.push_str("stream {\n");
    for (name, listen, server) in named(front, backend) {
        let _ = write!(
            text,
            "  upstream {name} {{\n    least_conn;\n    server {server} max_fails=1 fail_timeout=10s;\n  }}\n\
             \x20 server {{\n    listen {listen};\n    proxy_pass {name};\n    proxy_timeout 10m;\n    \
             proxy_connect_timeout 1s;\n  }}\n"
        );
    }
    text.push_str("}\n");
    text
}

/// kubespray's node-local HAProxy (loadbalancer/haproxy.cfg.j2): mode tcp,
/// leastconn, the same timeouts and default-server limits, with a TCP check
/// every second instead of its HTTPS /healthz check every 15 s, and without
/// its syslog target (nothing listens for it here).
fn haproxy_config(front: &Targets, backend: &Targets) -> String {
    let mut text = format!(
        "global\n    maxconn {HAPROXY_MAXCONN}\n\n\
         defaults\n    mode tcp\n    option redispatch\n    retries 5\n    timeout queue 5m\n    \
         timeout connect 30s\n    timeout client 15m\n    timeout server 15m\n    \
         timeout check 30s\n    maxconn {HAPROXY_MAXCONN}\n"
    );
    for (name, listen, server) in named(front, backend) {
        let _ = write!(
            text,
            "\nfrontend {name}_frontend\n    bind {listen}\n    mode tcp\n    default_backend {name}_backend\n\
             \nbackend {name}_backend\n    mode tcp\n    balance leastconn\n    \
             default-server inter 1s downinter 1s rise 2 fall 2 maxconn 1000 maxqueue 256 weight 100\n    \
             server {name} {server} check\n"
        );
    }
    text
}

/// (service name, front address, backend address) of each service.
fn named(front: &Targets, backend: &Targets) -> [(&'static str, SocketAddr, SocketAddr); 3] {
    [
        ("bench_http", front.http, backend.http),
        ("bench_sockperf", front.sockperf, backend.sockperf),
        ("bench_iperf", front.iperf, backend.iperf),
    ]
}

/// socklb with the same probe interval as HAProxy's checks; the
/// accelerated services are the same with `accelerate = "sockmap"`.
fn socklb_config(
    vips: &Targets,
    backend: &Targets,
    accelerated_vips: &Targets,
    accelerated_backend: &Targets,
) -> String {
    let mut text = String::new();
    let services = named(vips, backend)
        .into_iter()
        .map(|service| (service, ""))
        .chain(
            named(accelerated_vips, accelerated_backend)
                .into_iter()
                .map(|service| (service, "accelerated-")),
        );
    for ((name, vip, server), prefix) in services {
        let accelerate = if prefix.is_empty() {
            ""
        } else {
            "accelerate = \"sockmap\"\n"
        };
        let _ = write!(
            text,
            "[[service]]\nname = \"{prefix}{}\"\nvips = [\"{vip}\"]\nbackends = [\"{server}\"]\n\
             {accelerate}[service.health]\ninterval = \"1s\"\ntimeout = \"1s\"\n\n",
            name.replace('_', "-")
        );
    }
    text
}
