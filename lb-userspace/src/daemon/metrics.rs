//! Prometheus metrics at `--metrics-addr` (`GET /metrics`), with
//! prometheus-client.
//!
//! What the kernel counts (live connections, redirects, failed connects,
//! connects with no healthy backend, repairs) is encoded on each scrape
//! from the same [`StatusReport`] that `socklb status` prints, read by the
//! event loop when the scrape asks for it, so the two always agree. What
//! only the daemon sees (transitions, probe durations, reloads, discovery
//! updates) is counted where it happens.

use std::{
    collections::VecDeque,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Bytes, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use super::accept::AcceptErrors;
use crate::status::StatusReport;

type Labels = Vec<(String, String)>;

/// The kernel is read for a scrape at most this often.
const MIN_REFRESH: Duration = Duration::from_secs(1);
/// Connections open at once. At this many, a new one closes the oldest
/// that has not sent its request yet, so an idle or slow client never
/// holds a place a scraper needs.
const MAX_CONNECTIONS: usize = 64;
/// How long a client has to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(1);
/// How long one connection may take, request and answer.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes of a request head read at most (hyper's smallest buffer).
const MAX_HEAD_BYTES: usize = 8192;
/// How long a scrape waits for the loop's fresh reading.
const REFRESH_TIMEOUT: Duration = Duration::from_secs(2);

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .collect()
}

fn probe_histogram() -> Histogram {
    // 1 ms to about 16 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// The daemon's counters, shared with the HTTP endpoint (each is atomic).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    snapshot: Arc<Mutex<Option<StatusReport>>>,
    /// When the event loop last read the kernel for a scrape.
    refreshed: Arc<Mutex<Option<std::time::Instant>>>,
    transitions: Family<Labels, Counter>,
    probe_duration: Family<Labels, Histogram, fn() -> Histogram>,
    reloads: Family<Labels, Counter>,
    discovery_updates: Family<Labels, Counter>,
    discovery_problems: Family<Labels, Counter>,
    rebalance_moves: Family<Labels, Counter>,
    connections_kept: Family<Labels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let snapshot = Arc::new(Mutex::new(None));
        let transitions = Family::<Labels, Counter>::default();
        let probe_duration =
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(probe_histogram);
        let reloads = Family::<Labels, Counter>::default();
        let discovery_updates = Family::<Labels, Counter>::default();
        let discovery_problems = Family::<Labels, Counter>::default();
        let rebalance_moves = Family::<Labels, Counter>::default();
        let connections_kept = Family::<Labels, Counter>::default();
        let build_info = Family::<Labels, Gauge>::default();
        build_info
            .get_or_create(&labels(&[("version", env!("CARGO_PKG_VERSION"))]))
            .set(1);
        registry.register(
            "socklb_build_info",
            "socklb's version (always 1)",
            build_info,
        );
        registry.register(
            "socklb_backend_transitions",
            "Health transitions of a backend, by the state it went to",
            transitions.clone(),
        );
        registry.register(
            "socklb_probe_duration_seconds",
            "Time a health probe took, by result (ok or failed)",
            probe_duration.clone(),
        );
        registry.register(
            "socklb_config_reloads",
            "Configuration reloads (SIGHUP or --watch-config), by result",
            reloads.clone(),
        );
        registry.register(
            "socklb_discovery_updates",
            "Changes of a service's backend set applied, by the source they came from",
            discovery_updates.clone(),
        );
        registry.register(
            "socklb_discovery_problems",
            "Discovery problems, each said once, by reason: a source that failed, listed no backend or too many (the last known set stayed), or an EndpointSlice refused alone (foreign-manager, oversized, over-cap, invalid, too-many-slices)",
            discovery_problems.clone(),
        );
        registry.register(
            "socklb_rebalance_moves",
            "Connections closed to rebalance a service's backends, by the backend they left",
            rebalance_moves.clone(),
        );
        registry.register(
            "socklb_close_on_failure_kept",
            "Times a service lost its last healthy backend and close-on-failure kept the connections where they were",
            connections_kept.clone(),
        );
        registry.register_collector(Box::new(KernelCollector {
            snapshot: snapshot.clone(),
        }));
        registry.register_collector(Box::new(HeapCollector));
        Self {
            registry: Arc::new(registry),
            snapshot,
            refreshed: Arc::new(Mutex::new(None)),
            transitions,
            probe_duration,
            reloads,
            discovery_updates,
            discovery_problems,
            rebalance_moves,
            connections_kept,
        }
    }

    /// A service lost its last healthy backend; its connections stay.
    pub fn connections_kept(&self, service: &str) {
        self.connections_kept
            .get_or_create(&labels(&[("service", service)]))
            .inc();
    }

    pub fn rebalanced(&self, service: &str, backend: SocketAddr, count: usize) {
        self.rebalance_moves
            .get_or_create(&labels(&[
                ("service", service),
                ("backend", &backend.to_string()),
            ]))
            .inc_by(count as u64);
    }

    pub fn transition(&self, service: &str, backend: SocketAddr, healthy: bool) {
        let to = if healthy { "healthy" } else { "unhealthy" };
        self.transitions
            .get_or_create(&labels(&[
                ("service", service),
                ("backend", &backend.to_string()),
                ("to", to),
            ]))
            .inc();
    }

    pub fn probe(&self, service: &str, backend: SocketAddr, passed: bool, took: Duration) {
        let result = if passed { "ok" } else { "failed" };
        self.probe_duration
            .get_or_create(&labels(&[
                ("service", service),
                ("backend", &backend.to_string()),
                ("result", result),
            ]))
            .observe(took.as_secs_f64());
    }

    /// Removes the label sets of a backend that left its service, so the
    /// families hold only the backends in force, however often addresses
    /// change.
    pub fn forget_backend(&self, service: &str, backend: SocketAddr) {
        let backend = backend.to_string();
        let pair = [("service", service), ("backend", backend.as_str())];
        self.rebalance_moves.remove(&labels(&pair));
        for to in ["healthy", "unhealthy"] {
            self.transitions
                .remove(&labels(&[pair[0], pair[1], ("to", to)]));
        }
        for result in ["ok", "failed"] {
            self.probe_duration
                .remove(&labels(&[pair[0], pair[1], ("result", result)]));
        }
    }

    pub fn reload(&self, result: &str) {
        self.reloads
            .get_or_create(&labels(&[("result", result)]))
            .inc();
    }

    pub fn discovery_update(&self, service: &str, source: &str) {
        self.discovery_updates
            .get_or_create(&labels(&[("service", service), ("source", source)]))
            .inc();
    }

    /// A discovery problem said once: `reason` is a
    /// [`crate::discovery::ProblemKind`].
    pub fn discovery_problem(&self, service: &str, source: &str, reason: &str) {
        self.discovery_problems
            .get_or_create(&labels(&[
                ("service", service),
                ("source", source),
                ("reason", reason),
            ]))
            .inc();
    }

    /// Keeps the status the next scrapes encode.
    pub fn set_snapshot(&self, report: StatusReport) {
        if let Ok(mut snapshot) = self.snapshot.lock() {
            *snapshot = Some(report);
        }
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            warn!("encoding the metrics failed: {error}");
        }
        text
    }
}

/// Encodes what the kernel counts from the last status snapshot.
#[derive(Debug)]
struct KernelCollector {
    snapshot: Arc<Mutex<Option<StatusReport>>>,
}

/// One metric family from the snapshot: name, help, and (labels, value).
fn encode_family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: Vec<(Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let Some((_, first)) = samples.first() else {
        return Ok(());
    };
    let mut family = encoder.encode_descriptor(name, help, None, first.metric_type())?;
    for (labels, metric) in &samples {
        metric.encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

/// One sample per backend of every service, made by `sample`.
fn per_backend<M>(
    report: &StatusReport,
    sample: impl Fn(&crate::status::BackendStatus) -> M,
) -> Vec<(Labels, M)> {
    report
        .services
        .iter()
        .flat_map(|service| {
            service.backends.iter().map(|backend| {
                (
                    labels(&[("service", &service.name), ("backend", &backend.addr)]),
                    sample(backend),
                )
            })
        })
        .collect()
}

/// One counter per service, made by `value`.
fn per_service(
    report: &StatusReport,
    value: impl Fn(&crate::status::ServiceStatus) -> u64,
) -> Vec<(Labels, ConstCounter)> {
    report
        .services
        .iter()
        .map(|service| {
            (
                labels(&[("service", &service.name)]),
                ConstCounter::new(value(service)),
            )
        })
        .collect()
}

/// The backends' families: health, live connections, redirects, failed
/// connects.
fn encode_backends(
    encoder: &mut DescriptorEncoder,
    report: &StatusReport,
) -> Result<(), std::fmt::Error> {
    encode_family(
        encoder,
        "socklb_backend_healthy",
        "1 while the backend is healthy (its probes pass), else 0",
        per_backend(report, |backend| {
            ConstGauge::new(i64::from(backend.healthy))
        }),
    )?;
    encode_family(
        encoder,
        "socklb_backend_live_connections",
        "Established connections socklb sent to the backend that are open now",
        per_backend(report, |backend| ConstGauge::new(backend.live)),
    )?;
    encode_family(
        encoder,
        "socklb_backend_redirects",
        "Connects socklb redirected to the backend",
        per_backend(report, |backend| ConstCounter::new(backend.redirects)),
    )?;
    encode_family(
        encoder,
        "socklb_backend_failed_connects",
        "Redirected connects that failed on the server side (a reset, or the SYN unanswered)",
        per_backend(report, |backend| ConstCounter::new(backend.failed_connects)),
    )
}

impl Collector for KernelCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(snapshot) = self.snapshot.lock() else {
            return Ok(());
        };
        let Some(report) = snapshot.as_ref() else {
            return Ok(());
        };
        encode_backends(&mut encoder, report)?;
        encode_family(
            &mut encoder,
            "socklb_service_none_healthy",
            "Connects to the service's VIPs that found no healthy backend",
            per_service(report, |service| service.none_healthy),
        )?;
        encode_family(
            &mut encoder,
            "socklb_service_rejected",
            "Of those, connects refused by the reject policy",
            per_service(report, |service| service.rejected),
        )?;
        encode_hand_back(&mut encoder, report)?;
        if let Some(table) = &report.data_plane.socket_table {
            encode_socket_table(&mut encoder, table)?;
        }
        encode_family(
            &mut encoder,
            "socklb_dataplane_repairs",
            "Repairs of the kernel state that socklb found changed, by kind",
            report
                .data_plane
                .repairs_by_kind
                .iter()
                .map(|(kind, count)| (labels(&[("kind", kind)]), ConstCounter::new(*count)))
                .collect(),
        )?;
        Ok(())
    }
}

/// What malloc holds, read at each scrape.
#[derive(Debug)]
struct HeapCollector;

impl Collector for HeapCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(usage) = super::heap::usage() else {
            return Ok(());
        };
        let gauge = |bytes: u64| ConstGauge::new(i64::try_from(bytes).unwrap_or(i64::MAX));
        encode_family(
            &mut encoder,
            "socklb_heap_bytes",
            "The daemon's heap by kind: in_use, what it holds; free, what malloc keeps after it was freed (growth of in_use alone is a leak)",
            vec![
                (labels(&[("kind", "in_use")]), gauge(usage.in_use)),
                (labels(&[("kind", "free")]), gauge(usage.free)),
            ],
        )
    }
}

/// The services' `when-daemon-gone`: what is configured and applies, and
/// whether the kernel hands the VIPs back now.
fn encode_hand_back(
    encoder: &mut DescriptorEncoder,
    report: &StatusReport,
) -> Result<(), std::fmt::Error> {
    encode_family(
        encoder,
        "socklb_when_daemon_gone_info",
        "What a service's VIPs do once the daemon is gone: configured (auto, keep, hand-back) and effective (keep, hand-back) (always 1)",
        report
            .services
            .iter()
            .map(|service| {
                let mode = &service.when_daemon_gone;
                (
                    labels(&[
                        ("service", &service.name),
                        ("configured", &mode.configured),
                        ("effective", &mode.effective),
                    ]),
                    ConstGauge::new(1),
                )
            })
            .collect(),
    )?;
    encode_family(
        encoder,
        "socklb_hand_back_active",
        "1 while the kernel hands the service's VIPs back (the daemon's heartbeat is older than daemon-gone-after), else 0",
        report
            .services
            .iter()
            .map(|service| {
                (
                    labels(&[("service", &service.name)]),
                    ConstGauge::new(i64::from(service.when_daemon_gone.handed_back)),
                )
            })
            .collect(),
    )?;
    // The daemon serves this, so it shows a hand-back only while the
    // daemon lives: during a takeover (a start that found the VIPs handed
    // back waits for every verdict) or with a stalled event loop. While
    // the daemon is gone the scrape itself fails, and `socklb status`
    // (which reads the kernel alone) says since when.
    let now = std::time::SystemTime::now();
    encode_family(
        encoder,
        "socklb_hand_back_since_timestamp_seconds",
        "Since when (Unix time) the kernel hands the service's VIPs back, 0 while it does not",
        report
            .services
            .iter()
            .map(|service| {
                let since = service
                    .when_daemon_gone
                    .handed_back_for_ms
                    .filter(|_| service.when_daemon_gone.handed_back)
                    .and_then(|for_ms| now.checked_sub(Duration::from_millis(for_ms)))
                    .and_then(|since| since.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |since| since.as_secs() as i64);
                (
                    labels(&[("service", &service.name)]),
                    ConstGauge::new(since),
                )
            })
            .collect(),
    )
}

/// The socket table's families: its size, use, memory and overflow.
fn encode_socket_table(
    encoder: &mut DescriptorEncoder,
    table: &crate::status::SocketTableStatus,
) -> Result<(), std::fmt::Error> {
    let gauges = [
        (
            "socklb_socket_table_capacity",
            "The most sockets the kernel's socket table can hold (socket-table-size in the hash, plus the array's slots)",
            i64::from(table.capacity),
        ),
        (
            "socklb_socket_table_tracked",
            "Redirected sockets the socket table holds now",
            i64::try_from(table.tracked).unwrap_or(i64::MAX),
        ),
        (
            "socklb_socket_table_memory_bytes",
            "Kernel memory of the socket table, allocated whole when it was made",
            i64::try_from(table.memory_bytes).unwrap_or(i64::MAX),
        ),
    ];
    for (name, help, value) in gauges {
        encode_family(
            encoder,
            name,
            help,
            vec![(Labels::new(), ConstGauge::new(value))],
        )?;
    }
    encode_family(
        encoder,
        "socklb_socket_table_untracked",
        "Connects redirected without a record because the socket table was full",
        vec![(Labels::new(), ConstCounter::new(table.untracked))],
    )
}

/// A scrape's request for a fresh reading, answered by the event loop.
pub type Refresh = oneshot::Sender<()>;

/// Serves `GET /metrics` on `addr` until the process ends. Each scrape
/// first asks the event loop (through `refresh`) to read the kernel's
/// counters; if the loop does not answer in time, the last reading is
/// served.
///
/// Any local user can connect here, so no client can delay another's
/// scrape: every connection is served by its own task, has
/// [`HEADER_TIMEOUT`] to send its request and [`CONNECTION_TIMEOUT`] in
/// all, and one request (no keep-alive); at [`MAX_CONNECTIONS`] a new
/// connection closes the oldest one still silent. The event loop, and so
/// the heartbeat, only hears of a scrape through `refresh`, at most once a
/// second.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    refresh: mpsc::Sender<Refresh>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    info!("metrics at http://{addr}/metrics");
    tokio::spawn(accept_loop(listener, metrics, refresh));
    Ok(())
}

/// Accepts until the process ends.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    refresh: mpsc::Sender<Refresh>,
) {
    let mut open = OpenConnections::default();
    let mut errors = AcceptErrors::new("metrics");
    loop {
        let Some((stream, _)) = errors.take(listener.accept().await).await else {
            continue;
        };
        if !open.make_room() {
            // Every place is taken by a request being answered: this one
            // is closed unread, and the client may try again.
            continue;
        }
        let requested = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(serve_connection(
            stream,
            metrics.clone(),
            refresh.clone(),
            requested.clone(),
        ));
        open.connections.push_back(OpenConnection {
            requested,
            task: task.abort_handle(),
        });
        // The new connection reads its request before the next accept can
        // count it as silent.
        tokio::task::yield_now().await;
    }
}

/// One open connection of the metrics endpoint.
struct OpenConnection {
    /// Its request head has arrived.
    requested: Arc<AtomicBool>,
    task: tokio::task::AbortHandle,
}

/// The open connections, oldest first.
#[derive(Default)]
struct OpenConnections {
    connections: VecDeque<OpenConnection>,
}

impl OpenConnections {
    /// Makes room for one more connection: forgets those that ended, and
    /// when [`MAX_CONNECTIONS`] are open, closes the oldest one that has
    /// not sent its request. False when every one is answering a request.
    fn make_room(&mut self) -> bool {
        self.connections
            .retain(|connection| !connection.task.is_finished());
        if self.connections.len() < MAX_CONNECTIONS {
            return true;
        }
        let silent = self
            .connections
            .iter()
            .position(|connection| !connection.requested.load(Ordering::Relaxed));
        match silent.and_then(|index| self.connections.remove(index)) {
            Some(connection) => {
                connection.task.abort();
                true
            }
            None => false,
        }
    }
}

/// One connection: one request, then closed.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    metrics: Metrics,
    refresh: mpsc::Sender<Refresh>,
    requested: Arc<AtomicBool>,
) {
    let service = service_fn(move |request: Request<hyper::body::Incoming>| {
        requested.store(true, Ordering::Relaxed);
        answer(request, metrics.clone(), refresh.clone())
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
}

async fn answer(
    request: Request<hyper::body::Incoming>,
    metrics: Metrics,
    refresh: mpsc::Sender<Refresh>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let reply = |status: StatusCode, content_type: &str, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        if let Ok(value) = content_type.parse() {
            response
                .headers_mut()
                .insert(hyper::header::CONTENT_TYPE, value);
        }
        Ok(response)
    };
    if request.method() != hyper::Method::GET {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        );
    }
    match request.uri().path() {
        "/metrics" => {
            // At most one reading of the kernel a second, however often
            // (and by however many local clients) the endpoint is asked.
            let stale = metrics.refreshed.lock().is_ok_and(|mut refreshed| {
                let stale = refreshed.is_none_or(|at| at.elapsed() >= MIN_REFRESH);
                if stale {
                    *refreshed = Some(std::time::Instant::now());
                }
                stale
            });
            if stale {
                let (done, fresh) = oneshot::channel();
                let _ = tokio::time::timeout(REFRESH_TIMEOUT, async {
                    if refresh.send(done).await.is_ok() {
                        let _ = fresh.await;
                    }
                })
                .await;
            }
            reply(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                metrics.encode(),
            )
        }
        "/" => reply(
            StatusCode::OK,
            "text/plain",
            "socklb: metrics at /metrics\n".into(),
        ),
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_that_left_takes_its_label_sets_with_it() {
        let metrics = Metrics::new();
        let gone: SocketAddr = "127.0.0.2:6443".parse().unwrap();
        let kept: SocketAddr = "127.0.0.3:6443".parse().unwrap();
        for backend in [gone, kept] {
            metrics.transition("api", backend, false);
            metrics.transition("api", backend, true);
            metrics.probe("api", backend, true, Duration::from_millis(3));
            metrics.probe("api", backend, false, Duration::from_millis(500));
            metrics.rebalanced("api", backend, 2);
        }
        // The same address in another service is another backend.
        metrics.transition("etcd", gone, true);
        let series = |text: &str, backend: &str| {
            text.lines()
                .filter(|line| !line.starts_with('#') && line.contains(backend))
                .count()
        };
        let before = metrics.encode();
        assert!(series(&before, "127.0.0.2:6443") > 0);
        metrics.forget_backend("api", gone);
        let after = metrics.encode();
        let gone_lines: Vec<&str> = after
            .lines()
            .filter(|line| line.contains("127.0.0.2:6443"))
            .collect();
        assert_eq!(
            gone_lines,
            vec![
                "socklb_backend_transitions_total{service=\"etcd\",backend=\"127.0.0.2:6443\",to=\"healthy\"} 1"
            ],
            "only the other service's series of that address stays"
        );
        assert_eq!(
            series(&after, "127.0.0.3:6443"),
            series(&before, "127.0.0.3:6443"),
            "the backend still in force keeps every series"
        );
    }
}
