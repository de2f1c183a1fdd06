//! A fleet of long-lived agents through a VIP, as kubelets and k3s agents
//! are: each keeps one TLS connection (keep-alive) and sends a small
//! request every interval; on an error it reconnects and retries once,
//! after 250 ms plus a random jitter of up to 750 ms (as client-go and the
//! k3s agent spread their retries). Between requests it watches its connection, as a client
//! blocked on a watch does: a connection that ends is opened again at once
//! (a `reconnect`, not a failed request). Agents start spread over one
//! interval. It runs until stdin closes (or `--max-seconds`), then prints
//! one JSON summary.
//!
//! With `--work-requests K`, a line `work` on stdin starts a work phase:
//! each agent sends K `/work` requests back to back on its connection
//! (each with the same one retry), records when it finished and how long
//! its longest failed attempt waited, and stops; the process ends when
//! every agent has.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Parser;
use rustls::{ClientConnection, StreamOwned};
use rustls_pki_types::ServerName;
use serde::Serialize;
use socklb::health::probe::{TlsOptions, client_config};
use socklb_tests::cli::{join_cgroup, millis, seconds};

/// A fleet of long-lived agents through a VIP; one JSON summary at the end.
#[derive(Debug, Parser)]
#[command(name = "fleetagent")]
struct Args {
    /// Where to connect (a VIP).
    #[arg(long)]
    addr: SocketAddr,
    /// A cgroup v2 directory to join first.
    #[arg(long)]
    cgroup: Option<std::path::PathBuf>,
    /// Agents, each on its own thread and connection.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=5000))]
    agents: u32,
    /// Each agent's request interval (at least 10 ms).
    #[arg(long = "interval-ms", value_name = "MS", default_value = "1000", value_parser = millis)]
    interval: Duration,
    /// The run's bound (1 to 3600).
    #[arg(long = "max-seconds", value_name = "S", default_value = "600", value_parser = seconds)]
    max: Duration,
    /// Requests of each agent in the work phase (a `work` line on stdin).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    work_requests: u32,
}

const TIMEOUT: Duration = Duration::from_secs(2);
const RETRY_AFTER: Duration = Duration::from_millis(250);
const RETRY_JITTER_MS: u64 = 750;

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    failed: AtomicU64,
    retried: AtomicU64,
    connects: AtomicU64,
    /// Connections that ended between requests and were opened again.
    reconnects: AtomicU64,
    max_ms: AtomicU64,
    servers: Mutex<BTreeMap<String, u64>>,
    errors: Mutex<Vec<String>>,
    work: Mutex<WorkSummary>,
}

/// The work phase, over all agents.
#[derive(Default, Serialize)]
struct WorkSummary {
    /// Agents that finished their K requests.
    agents_done: u32,
    requests: u64,
    failed: u64,
    /// When each agent finished, in ms from the `work` line, sorted.
    finish_ms: Vec<u64>,
    /// The longest failed attempt of any work request (the time an agent
    /// sat on a server that never answered), in ms.
    longest_failed_attempt_ms: u64,
}

#[derive(Serialize)]
struct Summary {
    agents: u32,
    requests: u64,
    failed: u64,
    retried: u64,
    connects: u64,
    reconnects: u64,
    max_ms: u64,
    servers: BTreeMap<String, u64>,
    /// The first errors seen, for the report.
    errors: Vec<String>,
    work: WorkSummary,
}

type Connection = StreamOwned<ClientConnection, TcpStream>;

fn connect(addr: SocketAddr, config: &Arc<rustls::ClientConfig>) -> Result<Connection, String> {
    let stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(TIMEOUT)))
        .map_err(|e| e.to_string())?;
    let name = ServerName::IpAddress(addr.ip().into());
    let connection = ClientConnection::new(Arc::clone(config), name).map_err(|e| e.to_string())?;
    Ok(StreamOwned::new(connection, stream))
}

/// One request on the agent's connection; returns the server's name.
fn request(connection: &mut Connection, addr: SocketAddr, path: &str) -> Result<String, String> {
    let text = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: keep-alive\r\n\r\n");
    connection
        .write_all(text.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 1024];
    let header_end = loop {
        if let Some(end) = answer.windows(4).position(|window| window == b"\r\n\r\n") {
            break end + 4;
        }
        match connection.read(&mut buffer) {
            Ok(0) => return Err("receive: closed".into()),
            Ok(read) => answer.extend_from_slice(&buffer[..read]),
            Err(e) => return Err(format!("receive: {e}")),
        }
        if answer.len() > 16 * 1024 {
            return Err("receive: headers too long".into());
        }
    };
    let head = String::from_utf8_lossy(&answer[..header_end]).to_string();
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("answer: {}", head.lines().next().unwrap_or("")));
    }
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length: "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0);
    while answer.len() < header_end + length {
        match connection.read(&mut buffer) {
            Ok(0) => return Err("receive: closed in the body".into()),
            Ok(read) => answer.extend_from_slice(&buffer[..read]),
            Err(e) => return Err(format!("receive: {e}")),
        }
    }
    head.lines()
        .find_map(|line| line.strip_prefix("x-server: "))
        .map(str::to_string)
        .ok_or_else(|| "answer without x-server".into())
}

/// Whether the connection becomes readable within `wait` (between
/// requests nothing is due: only an end of file or a reset).
fn ended(connection: &Connection, wait: Duration) -> bool {
    use std::os::fd::AsRawFd;
    let mut entry = libc::pollfd {
        fd: connection.sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(2) on one pollfd we own.
    let ready = unsafe { libc::poll(&mut entry, 1, wait.as_millis() as i32) };
    ready > 0 && entry.revents != 0
}

/// What every agent shares: where to go, how, and when to stop or work.
struct Shared {
    agents: u32,
    addr: SocketAddr,
    interval: Duration,
    work_requests: u32,
    config: Arc<rustls::ClientConfig>,
    stop: AtomicBool,
    /// Set by the `work` line on stdin.
    work_started: OnceLock<Instant>,
    counters: Counters,
}

/// One agent: its connection and its retry jitter.
struct Agent<'a> {
    shared: &'a Shared,
    connection: Option<Connection>,
    jitter: u64,
}

impl Agent<'_> {
    /// One request with one retry; the outcome and the longest failed
    /// attempt, in ms.
    fn request(&mut self, path: &str) -> (Result<String, String>, u64) {
        let (shared, counters) = (self.shared, &self.shared.counters);
        let mut outcome = Err(String::new());
        let mut longest_failed = 0;
        for attempt in 0..2 {
            if attempt == 1 {
                counters.retried.fetch_add(1, Ordering::Relaxed);
                // xorshift64: jitter without a random crate.
                self.jitter ^= self.jitter << 13;
                self.jitter ^= self.jitter >> 7;
                self.jitter ^= self.jitter << 17;
                std::thread::sleep(
                    RETRY_AFTER + Duration::from_millis(self.jitter % RETRY_JITTER_MS),
                );
            }
            let started = Instant::now();
            if self.connection.is_none() {
                counters.connects.fetch_add(1, Ordering::Relaxed);
                match connect(shared.addr, &shared.config) {
                    Ok(fresh) => self.connection = Some(fresh),
                    Err(error) => {
                        outcome = Err(error);
                        longest_failed = longest_failed.max(started.elapsed().as_millis() as u64);
                        continue;
                    }
                }
            }
            let Some(open) = self.connection.as_mut() else {
                continue;
            };
            outcome = request(open, shared.addr, path);
            if outcome.is_ok() {
                break;
            }
            longest_failed = longest_failed.max(started.elapsed().as_millis() as u64);
            self.connection = None;
        }
        counters.requests.fetch_add(1, Ordering::Relaxed);
        match &outcome {
            Ok(server) => {
                if let Ok(mut servers) = counters.servers.lock() {
                    *servers.entry(server.clone()).or_default() += 1;
                }
            }
            Err(error) => {
                counters.failed.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut errors) = counters.errors.lock()
                    && errors.len() < 10
                {
                    errors.push(error.clone());
                }
            }
        }
        (outcome, longest_failed)
    }

    /// The work phase: K `/work` requests back to back.
    fn work(&mut self, started: Instant) {
        let (mut failed, mut longest_failed) = (0, 0);
        for _ in 0..self.shared.work_requests {
            let (outcome, longest) = self.request("/work");
            failed += u64::from(outcome.is_err());
            longest_failed = longest_failed.max(longest);
        }
        let finished = started.elapsed().as_millis() as u64;
        if let Ok(mut work) = self.shared.counters.work.lock() {
            work.agents_done += 1;
            work.requests += u64::from(self.shared.work_requests);
            work.failed += failed;
            work.finish_ms.push(finished);
            work.longest_failed_attempt_ms = work.longest_failed_attempt_ms.max(longest_failed);
        }
    }

    fn run(&mut self, index: u32) {
        let shared = self.shared;
        let counters = &shared.counters;
        let mut next = Instant::now() + shared.interval * index / shared.agents.max(1);
        while !shared.stop.load(Ordering::Relaxed) {
            if shared.work_requests > 0
                && let Some(started) = shared.work_started.get()
            {
                self.work(*started);
                return;
            }
            let now = Instant::now();
            if next > now {
                let wait = (next - now).min(Duration::from_millis(200));
                match self.connection.as_ref() {
                    // Readable between requests: the server closed or reset it.
                    Some(open) if ended(open, wait) => {
                        counters.reconnects.fetch_add(1, Ordering::Relaxed);
                        counters.connects.fetch_add(1, Ordering::Relaxed);
                        self.connection = connect(shared.addr, &shared.config).ok();
                    }
                    Some(_) => {}
                    None => std::thread::sleep(wait),
                }
                continue;
            }
            next += shared.interval;
            let started = Instant::now();
            if self.request("/readyz").0.is_ok() {
                counters
                    .max_ms
                    .fetch_max(started.elapsed().as_millis() as u64, Ordering::Relaxed);
            }
        }
    }
}

fn main() {
    let Args {
        addr,
        cgroup,
        agents,
        interval,
        max,
        work_requests,
    } = Args::parse();
    let interval = interval.max(Duration::from_millis(10));
    let max = max.clamp(Duration::from_secs(1), Duration::from_secs(3600));
    socklb_tests::raise_open_files();
    if let Some(cgroup) = &cgroup
        && let Err(message) = join_cgroup(cgroup)
    {
        eprintln!("fleetagent: {message}");
        std::process::exit(2);
    }
    let shared = Arc::new(Shared {
        agents,
        addr,
        interval,
        work_requests,
        config: client_config(&TlsOptions::default()).expect("TLS client"),
        stop: AtomicBool::new(false),
        work_started: OnceLock::new(),
        counters: Counters::default(),
    });
    {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || {
            for line in std::io::stdin().lines() {
                match line {
                    Ok(line) if line.trim() == "work" => {
                        let _ = shared.work_started.set(Instant::now());
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            shared.stop.store(true, Ordering::SeqCst);
        });
    }
    {
        let shared = Arc::clone(&shared);
        std::thread::spawn(move || {
            std::thread::sleep(max);
            shared.stop.store(true, Ordering::SeqCst);
        });
    }
    std::thread::scope(|scope| {
        for index in 0..agents {
            let shared = &*shared;
            std::thread::Builder::new()
                .stack_size(256 * 1024)
                .spawn_scoped(scope, move || {
                    let mut agent = Agent {
                        shared,
                        connection: None,
                        jitter: 0x9e37_79b9_7f4a_7c15 ^ (u64::from(index) << 20 | 1),
                    };
                    agent.run(index);
                })
                .expect("an agent thread");
        }
    });
    let counters = &shared.counters;
    let mut work = std::mem::take(&mut *counters.work.lock().unwrap_or_else(|e| e.into_inner()));
    work.finish_ms.sort_unstable();
    let summary = Summary {
        agents,
        requests: counters.requests.load(Ordering::Relaxed),
        failed: counters.failed.load(Ordering::Relaxed),
        retried: counters.retried.load(Ordering::Relaxed),
        connects: counters.connects.load(Ordering::Relaxed),
        reconnects: counters.reconnects.load(Ordering::Relaxed),
        max_ms: counters.max_ms.load(Ordering::Relaxed),
        servers: std::mem::take(&mut *counters.servers.lock().unwrap_or_else(|e| e.into_inner())),
        errors: std::mem::take(&mut *counters.errors.lock().unwrap_or_else(|e| e.into_inner())),
        work,
    };
    println!("{}", serde_json::to_string(&summary).expect("summary"));
}
