//! A test Kubernetes apiserver under guard: [`KubeApi`] runs the `kubeapi`
//! binary (EndpointSlices of `discovery.k8s.io/v1` over TLS with client
//! certificates, see its documentation) and drives it through its admin
//! API. The admin API's types live here, and the binary shares them.
//!
//! ```no_run
//! use socklb_tests::kube::{KubeApi, SliceSpec};
//! let api = KubeApi::start();
//! let version = api.put_slice(
//!     "default",
//!     "kubernetes",
//!     &SliceSpec::new("kubernetes", "IPv4")
//!         .with_port("https", 6443)
//!         .with_endpoint("127.0.0.2", true),
//! );
//! // A daemon under test reads api.kubeconfig() and watches the slice.
//! api.wait_stats("a watch", std::time::Duration::from_secs(10), |stats| {
//!     stats.watches_open == 1
//! });
//! # let _ = version;
//! ```

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use http_body_util::{BodyExt, Full, Limited};
use hyper::{Request, body::Bytes, header};
use hyper_util::rt::TokioIo;
use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpStream,
};
use tokio_rustls::TlsConnector;

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label that names who manages a slice. The apiserver writes its own
/// slice of `default/kubernetes` without it; the EndpointSlice controller
/// writes [`ENDPOINTSLICE_CONTROLLER`].
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
pub const ENDPOINTSLICE_CONTROLLER: &str = "endpointslice-controller.k8s.io";

/// Files the server writes in its directory.
pub mod files {
    pub const CA: &str = "ca.pem";
    pub const CA_KEY: &str = "ca-key.pem";
    pub const SERVER_CERT: &str = "server.pem";
    pub const SERVER_KEY: &str = "server-key.pem";
    pub const CLIENT_CERT: &str = "client.pem";
    pub const CLIENT_KEY: &str = "client-key.pem";
    pub const KUBECONFIG: &str = "kubeconfig";
    /// The slices and the resource version, kept across a restart.
    pub const STATE: &str = "state.json";
    /// Written last, once the server listens; removed when it stops.
    pub const READY: &str = "ready";
}

/// Body of the admin API's `PUT /slices/{namespace}/{name}`: what an
/// EndpointSlice says, without the metadata the server assigns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SliceSpec {
    /// Value of the `kubernetes.io/service-name` label.
    pub service: String,
    /// `IPv4`, `IPv6` or `FQDN`.
    #[serde(default = "default_address_type")]
    pub address_type: String,
    #[serde(default)]
    pub ports: Vec<SlicePort>,
    #[serde(default)]
    pub endpoints: Vec<SliceEndpoint>,
    /// Labels besides the service name, the managed-by label among them
    /// (none by default, as on the apiserver's own slice).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

fn default_address_type() -> String {
    "IPv4".to_string()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlicePort {
    /// The Service port's name; empty for an unnamed port, as the
    /// EndpointSlice controller writes it.
    #[serde(default)]
    pub name: String,
    pub port: u16,
    #[serde(default = "default_protocol")]
    pub protocol: String,
}

fn default_protocol() -> String {
    "TCP".to_string()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SliceEndpoint {
    pub addresses: Vec<String>,
    #[serde(default = "default_true")]
    pub ready: bool,
    /// Defaults to `ready`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<bool>,
    #[serde(default)]
    pub terminating: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
}

fn default_true() -> bool {
    true
}

impl SliceSpec {
    /// A slice of `service` with no port and no endpoint yet.
    pub fn new(service: &str, address_type: &str) -> Self {
        Self {
            service: service.to_string(),
            address_type: address_type.to_string(),
            ports: Vec::new(),
            endpoints: Vec::new(),
            labels: BTreeMap::new(),
        }
    }

    /// Adds a TCP port.
    pub fn with_port(mut self, name: &str, port: u16) -> Self {
        self.ports.push(SlicePort {
            name: name.to_string(),
            port,
            protocol: default_protocol(),
        });
        self
    }

    /// Sets a label.
    pub fn with_label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_string(), value.to_string());
        self
    }

    /// Labels the slice as managed by `manager`.
    pub fn managed_by(self, manager: &str) -> Self {
        self.with_label(MANAGED_BY_LABEL, manager)
    }

    /// Adds an endpoint with one address (serving as it is ready, not
    /// terminating).
    pub fn with_endpoint(mut self, address: &str, ready: bool) -> Self {
        self.endpoints.push(SliceEndpoint {
            addresses: vec![address.to_string()],
            ready,
            serving: None,
            terminating: false,
            node_name: None,
        });
        self
    }
}

/// The slice the apiserver writes for `default/kubernetes`: named
/// `kubernetes`, no managed-by label, each address ready or not, all on
/// the port named https.
pub fn kubernetes_slice(port: u16, endpoints: &[(IpAddr, bool)]) -> SliceSpec {
    endpoints.iter().fold(
        SliceSpec::new("kubernetes", "IPv4").with_port("https", port),
        |spec, (ip, ready)| spec.with_endpoint(&ip.to_string(), *ready),
    )
}

/// [`kubernetes_slice`] with every address ready.
pub fn ready_slice(port: u16, ips: &[IpAddr]) -> SliceSpec {
    let endpoints: Vec<(IpAddr, bool)> = ips.iter().map(|ip| (*ip, true)).collect();
    kubernetes_slice(port, &endpoints)
}

/// The admin API's `GET /stats`: counters since the server started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KubeApiStats {
    /// List requests answered (not watches, not gets).
    pub lists: u64,
    /// Watch streams started.
    pub watches: u64,
    /// Watch streams open now.
    pub watches_open: u64,
    /// ERROR events with code 410 (a watch from a version no longer kept).
    pub gone_sent: u64,
    pub bookmarks_sent: u64,
    /// ADDED, MODIFIED and DELETED events written to watch streams.
    pub events_sent: u64,
    /// TLS handshakes that failed (no client certificate, a wrong CA).
    pub handshake_failures: u64,
    /// The current global resource version.
    pub resource_version: u64,
    /// Watches and lists answered with a body that never ends (see
    /// [`Faults`]), and the bytes of such bodies handed to the connection.
    pub endless_answers: u64,
    pub endless_bytes_sent: u64,
    /// Watch requests answered with an error or ended at once (see
    /// [`Faults`]).
    pub failed_watches: u64,
}

/// The admin API's `PUT /faults`: how the server misbehaves from now on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    #[serde(default)]
    pub watch: WatchFault,
    #[serde(default)]
    pub list: ListFault,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WatchFault {
    #[default]
    None,
    /// Every watch is answered 500 with a Status.
    Error,
    /// Every watch is answered 200 and ends at once, with no event.
    Close,
    /// Every watch streams one line that never ends, as fast as the
    /// client reads.
    EndlessLine,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ListFault {
    #[default]
    None,
    /// Every list is a body that never ends.
    Endless,
}

/// What the admin API answers to a change of a slice.
#[derive(Debug, Clone, Deserialize)]
pub struct SliceChange {
    /// `ADDED`, `MODIFIED`, `DELETED`, or `UNCHANGED` (a PUT that changed
    /// nothing, which, as in Kubernetes, makes no event).
    pub event: String,
    pub resource_version: u64,
    /// The EndpointSlice as the API serves it.
    pub object: serde_json::Value,
}

/// What the tests that run the official Python client lack, or `None`:
/// `$SOCKLB_PYTHON`, which `cargo xtask test` sets after it creates
/// target/pyenv. A test starts with `require!(kube::missing_python())`.
pub fn missing_python() -> Option<String> {
    let Some(path) = std::env::var_os("SOCKLB_PYTHON") else {
        return Some(
            "needs SOCKLB_PYTHON, a Python with the kubernetes client: `cargo xtask test` creates \
             target/pyenv and sets it; by hand, run `python3 -m venv target/pyenv`, pip-install the \
             versions pinned in xtask/src/toolchain.rs, and set SOCKLB_PYTHON=target/pyenv/bin/python"
                .to_string(),
        );
    };
    (!Path::new(&path).exists()).then(|| format!("SOCKLB_PYTHON={} does not exist", path.display()))
}

/// The interpreter of the Python environment with the official
/// `kubernetes` client and `kubernetes-validate` (see [`missing_python`]);
/// panics when there is none.
pub fn python() -> PathBuf {
    if let Some(missing) = missing_python() {
        panic!("{missing}");
    }
    PathBuf::from(std::env::var_os("SOCKLB_PYTHON").expect("checked"))
}

/// The kubeapi binary: beside lbclient when `LBCLIENT_BIN` is set (cargo
/// xtask test), else in target/<profile>/ beside the running test.
pub fn kubeapi_bin() -> PathBuf {
    let candidate = match std::env::var_os("LBCLIENT_BIN") {
        Some(lbclient) => PathBuf::from(lbclient).with_file_name("kubeapi"),
        None => std::env::current_exe()
            .expect("current executable")
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>/deps")
            .join("kubeapi"),
    };
    assert!(
        candidate.exists(),
        "{} is missing: build it with `cargo build -p socklb-tests --bins`, or run `cargo xtask test`",
        candidate.display()
    );
    candidate
}

/// How to start a [`KubeApi`]; `Default` is a server on 127.0.0.1 with
/// its own CA.
#[derive(Debug, Clone, Default)]
pub struct KubeApiOptions {
    /// The API's address (a free port is picked); 127.0.0.1 by default.
    pub ip: Option<IpAddr>,
    /// `server:` of the kubeconfig, for a client that reaches the server
    /// through a VIP (its host also goes in the server certificate).
    pub kubeconfig_server: Option<String>,
    /// Interval of BOOKMARK events (the server's default is 1 s).
    pub bookmark_interval: Option<Duration>,
    /// Another server's directory whose CA and client certificate this one
    /// reuses, so that one kubeconfig works with both.
    pub share_pki_with: Option<PathBuf>,
}

/// A running `kubeapi` process with a temporary directory; on drop it is
/// killed (by its PID) and the directory removed. Its log is printed when
/// the test panics.
pub struct KubeApi {
    /// The API's address (TLS).
    pub addr: SocketAddr,
    /// The admin API's address (plain HTTP on loopback).
    pub admin: SocketAddr,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

/// How long the server may take to write `ready`.
const START_LIMIT: Duration = Duration::from_secs(20);

/// Read and write timeout of one admin or API request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

impl KubeApi {
    /// A server on 127.0.0.1 with its own CA.
    pub fn start() -> Self {
        Self::start_with(&KubeApiOptions::default())
    }

    pub fn start_with(options: &KubeApiOptions) -> Self {
        let ip = options.ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let addr = SocketAddr::new(ip, free_port_on(ip));
        // The admin API on the API's address when that is loopback (a
        // restart binds both again; see `resume`), else on 127.0.0.1.
        let admin_ip = if ip.is_loopback() {
            ip
        } else {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        };
        let admin = (0..10)
            .map(|_| SocketAddr::new(admin_ip, free_port_on(admin_ip)))
            .find(|admin| *admin != addr)
            .expect("a second free port");
        let dir = std::env::temp_dir().join(crate::unique_name("kubeapi"));
        std::fs::create_dir(&dir)
            .unwrap_or_else(|error| panic!("creating {}: {error}", dir.display()));
        if let Some(other) = &options.share_pki_with {
            for name in [
                files::CA,
                files::CA_KEY,
                files::CLIENT_CERT,
                files::CLIENT_KEY,
            ] {
                std::fs::copy(other.join(name), dir.join(name)).unwrap_or_else(|error| {
                    panic!("copying {name} from {}: {error}", other.display())
                });
            }
        }
        let mut args = vec![
            "--listen".to_string(),
            addr.to_string(),
            "--admin".into(),
            admin.to_string(),
            "--dir".into(),
            dir.display().to_string(),
            // An orphan (a test killed with SIGKILL) ends by itself.
            "--max-seconds".into(),
            "3600".into(),
        ];
        if let Some(server) = &options.kubeconfig_server {
            args.extend(["--kubeconfig-server".to_string(), server.clone()]);
        }
        if let Some(interval) = options.bookmark_interval {
            args.extend([
                "--bookmark-interval-ms".to_string(),
                interval.as_millis().to_string(),
            ]);
        }
        let mut api = Self {
            addr,
            admin,
            dir,
            args,
            child: None,
        };
        api.resume();
        api
    }

    /// A server on 127.0.0.LAST, an address of its own: a restarted server
    /// binds its port again, which an ephemeral port of the tests' clients
    /// (all from 127.0.0.1) can never hold.
    pub fn start_on(last: u8) -> Self {
        Self::start_with(&KubeApiOptions {
            ip: Some(IpAddr::from([127, 0, 0, last])),
            ..KubeApiOptions::default()
        })
    }

    /// Flags of a one-service daemon in `cgroup` that follows
    /// `default/kubernetes` through this server, VIP `vip`.
    pub fn follow_args(&self, cgroup: &Path, vip: SocketAddr, extra: &[&str]) -> Vec<String> {
        let kubeconfig = self.kubeconfig().display().to_string();
        let mut flags = vec![
            "--endpointslices",
            "default/kubernetes",
            "--kubeconfig",
            &kubeconfig,
        ];
        flags.extend_from_slice(extra);
        crate::service_args(cgroup, &[vip], &[], &flags)
    }

    /// The server's directory (certificates, kubeconfig, log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A kubeconfig with the server, its CA and a client certificate
    /// (CN `system:node:test`, O `system:nodes`).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join(files::KUBECONFIG)
    }

    /// `https://ADDR`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("kubeapi.log")
    }

    /// The server's output so far (one line per request).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL, and reap: the API stops answering, open watches break.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same addresses and directory (same
    /// CA, kubeconfig, slices and resource version; its watch history is
    /// gone, as after a real apiserver's restart), and waits until it
    /// listens.
    pub fn resume(&mut self) {
        if self.child.is_some() {
            return;
        }
        let ready = self.dir.join(files::READY);
        let _ = std::fs::remove_file(&ready);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("kubeapi log file");
        let child = Command::new(kubeapi_bin())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("starting kubeapi: {error}"));
        self.child = Some(child);
        let deadline = Instant::now() + START_LIMIT;
        while !ready.exists() {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|child| child.try_wait().ok().flatten())
            {
                self.child = None;
                panic!(
                    "kubeapi exited ({status}) before it was ready:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "kubeapi not ready after {START_LIMIT:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `stop`, then `resume`.
    pub fn restart(&mut self) {
        self.stop();
        self.resume();
    }

    /// Creates or replaces a slice; returns what changed (the event that
    /// watches see, and the new resource version).
    pub fn put_slice(&self, namespace: &str, name: &str, spec: &SliceSpec) -> SliceChange {
        let body = serde_json::to_string(spec).expect("slice JSON");
        let change = self.admin_json("PUT", &format!("/slices/{namespace}/{name}"), Some(&body));
        serde_json::from_value(change).expect("the admin API's answer to PUT")
    }

    /// Deletes a slice (a DELETED event); panics if there is none.
    pub fn delete_slice(&self, namespace: &str, name: &str) -> SliceChange {
        let change = self.admin_json("DELETE", &format!("/slices/{namespace}/{name}"), None);
        serde_json::from_value(change).expect("the admin API's answer to DELETE")
    }

    /// Drops the whole event history: a watch from an older resource
    /// version gets an ERROR event with code 410. Returns the current
    /// resource version (the oldest a watch can still resume from).
    pub fn compact(&self) -> u64 {
        self.admin_json("POST", "/compact", None)["resource_version"]
            .as_u64()
            .expect("resource_version")
    }

    /// Makes the server misbehave (or behave again, with the default).
    pub fn set_faults(&self, faults: &Faults) {
        let body = serde_json::to_string(faults).expect("faults JSON");
        self.admin_json("PUT", "/faults", Some(&body));
    }

    /// Ends every open watch stream; returns how many there were.
    pub fn close_watches(&self) -> u64 {
        self.admin_json("POST", "/close-watches", None)["closed"]
            .as_u64()
            .expect("closed")
    }

    pub fn stats(&self) -> KubeApiStats {
        serde_json::from_value(self.admin_json("GET", "/stats", None)).expect("stats")
    }

    /// Polls the stats until `ready` holds, at most `limit`; panics with
    /// the server's log otherwise.
    pub fn wait_stats(
        &self,
        what: &str,
        limit: Duration,
        ready: impl Fn(&KubeApiStats) -> bool,
    ) -> KubeApiStats {
        let deadline = Instant::now() + limit;
        loop {
            let stats = self.stats();
            if ready(&stats) {
                return stats;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {limit:?} waiting for {what}; stats {stats:?}\nlog:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// One admin request; panics unless it answers 200 with JSON.
    fn admin_json(&self, method: &str, path: &str, body: Option<&str>) -> serde_json::Value {
        let admin = self.admin;
        let response = block_on(async move {
            let stream = connect(admin).await?;
            http_exchange(stream, method, path, &admin.to_string(), body).await
        })
        .unwrap_or_else(|error| panic!("kubeapi admin {method} {path} on {admin}: {error}"));
        assert_eq!(
            response.status,
            200,
            "kubeapi admin {method} {path}: {}\nlog:\n{}",
            String::from_utf8_lossy(&response.body),
            self.log()
        );
        response.json()
    }

    /// TLS settings of a client that trusts this server's CA, with the
    /// kubeconfig's client certificate or without one.
    pub fn client_config(&self, with_client_certificate: bool) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        for certificate in CertificateDer::pem_file_iter(self.dir.join(files::CA))
            .expect("ca.pem")
            .flatten()
        {
            roots.add(certificate).expect("the CA certificate");
        }
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("protocol versions")
                .with_root_certificates(roots);
        let config = if with_client_certificate {
            let chain = CertificateDer::pem_file_iter(self.dir.join(files::CLIENT_CERT))
                .expect("client.pem")
                .collect::<Result<Vec<_>, _>>()
                .expect("client certificate");
            let key = PrivateKeyDer::from_pem_file(self.dir.join(files::CLIENT_KEY))
                .expect("client-key.pem");
            builder
                .with_client_auth_cert(chain, key)
                .expect("client certificate and key")
        } else {
            builder.with_no_client_auth()
        };
        Arc::new(config)
    }

    /// `GET PATH_AND_QUERY` on the API with the client certificate; reads
    /// the whole answer (a watch until the server ends it, so give it
    /// `timeoutSeconds`).
    pub fn get(&self, path_and_query: &str) -> std::io::Result<ApiResponse> {
        self.get_with(self.client_config(true), path_and_query)
    }

    /// Like `get`, with other TLS settings.
    pub fn get_with(
        &self,
        config: Arc<ClientConfig>,
        path_and_query: &str,
    ) -> std::io::Result<ApiResponse> {
        let addr = self.addr;
        block_on(async move {
            let socket = connect(addr).await?;
            let name = ServerName::IpAddress(addr.ip().into());
            let tls = TlsConnector::from(config).connect(name, socket).await?;
            http_exchange(tls, "GET", path_and_query, &addr.to_string(), None).await
        })
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            eprintln!(
                "kubeapi log ({}):\n{}",
                self.log_path().display(),
                self.log()
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port_on(ip: IpAddr) -> u16 {
    let listener = TcpListener::bind((ip, 0))
        .unwrap_or_else(|error| panic!("binding an ephemeral port on {ip}: {error}"));
    listener.local_addr().expect("local address").port()
}

/// An HTTP/1.1 answer, its body de-chunked.
#[derive(Debug, Clone)]
pub struct ApiResponse {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl ApiResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    /// The body as one JSON value; panics with the body otherwise.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|error| {
            panic!(
                "not JSON ({error}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The body as newline-delimited JSON (the events of a watch).
    pub fn json_lines(&self) -> Vec<serde_json::Value> {
        String::from_utf8_lossy(&self.body)
            .lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| {
                serde_json::from_str(line)
                    .unwrap_or_else(|error| panic!("watch line {line:?}: {error}"))
            })
            .collect()
    }
}

/// Largest answer read: a watch of a test is a few kilobytes.
const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// The longest a whole exchange may take (a watch runs until the server
/// ends it: tests give it `timeoutSeconds`).
const EXCHANGE_LIMIT: Duration = Duration::from_secs(600);

/// Runs one exchange on a runtime of its own: the tests are synchronous,
/// and each request stands alone.
fn block_on<T>(exchange: impl Future<Output = std::io::Result<T>>) -> std::io::Result<T> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        tokio::time::timeout(EXCHANGE_LIMIT, exchange)
            .await
            .map_err(|_| std::io::Error::other(format!("no answer within {EXCHANGE_LIMIT:?}")))?
    })
}

async fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    tokio::time::timeout(REQUEST_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::other(format!("connecting to {addr}: timed out")))?
}

/// Sends one HTTP/1.1 request (hyper) with `Connection: close` and reads
/// the answer, its body at most `MAX_RESPONSE_BYTES`.
async fn http_exchange<S>(
    stream: S,
    method: &str,
    path: &str,
    host: &str,
    body: Option<&str>,
) -> std::io::Result<ApiResponse>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    let driver = tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, host)
        .header(header::ACCEPT, "application/json")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONNECTION, "close")
        .body(Full::new(Bytes::from(body.unwrap_or_default().to_string())))
        .map_err(std::io::Error::other)?;
    let response = sender
        .send_request(request)
        .await
        .map_err(std::io::Error::other)?;
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(name, value)| {
            let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
            (name.as_str().to_string(), value)
        })
        .collect();
    let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes()
        .to_vec();
    driver.abort();
    Ok(ApiResponse {
        status,
        headers,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server on loopback that reads one request and answers `answer`;
    /// returns its address and the request it read.
    fn answer_once(answer: &'static [u8]) -> (SocketAddr, std::thread::JoinHandle<String>) {
        use std::io::{Read, Write};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut buffer = [0u8; 1024];
            while !request.ends_with(b"\r\n\r\n") {
                let read = stream.read(&mut buffer).unwrap();
                assert!(read > 0, "the request ended early");
                request.extend_from_slice(&buffer[..read]);
            }
            stream.write_all(answer).unwrap();
            String::from_utf8(request).unwrap()
        });
        (addr, server)
    }

    #[test]
    fn reads_a_chunked_answer_and_refuses_a_cut_one() {
        let (addr, server) = answer_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        );
        let response = block_on(async move {
            http_exchange(connect(addr).await?, "GET", "/stats", "test", None).await
        })
        .unwrap();
        assert_eq!(response.status, 200);
        assert_eq!(response.body, b"abcde");
        assert_eq!(response.header("transfer-encoding"), Some("chunked"));
        assert_eq!(response.header("Content-Type"), Some("application/json"));
        let request = server.join().unwrap();
        assert!(request.starts_with("GET /stats HTTP/1.1\r\n"), "{request}");

        let (addr, _server) =
            answer_once(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab");
        let cut =
            block_on(
                async move { http_exchange(connect(addr).await?, "GET", "/", "test", None).await },
            );
        assert!(cut.is_err(), "{cut:?}");
    }

    #[test]
    fn a_slice_spec_reads_the_documented_body() {
        let spec: SliceSpec = serde_json::from_str(
            r#"{"service": "kubernetes", "address_type": "IPv4",
                "ports": [{"name": "https", "port": 6443}],
                "endpoints": [{"addresses": ["198.18.0.2"], "ready": true}]}"#,
        )
        .unwrap();
        assert_eq!(
            spec,
            SliceSpec::new("kubernetes", "IPv4")
                .with_port("https", 6443)
                .with_endpoint("198.18.0.2", true)
        );
    }
}
