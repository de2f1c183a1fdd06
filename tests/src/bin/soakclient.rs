//! The soak's clients (`cargo xtask soak`), in a child cgroup, reporting
//! every new connection with where the kernel really sent it.
//!
//! `short`: new connections at a steady rate, each one request and gone:
//! a share over TLS to the HTTPS VIP (verifying the server's certificate
//! against `--ca`, for 127.0.0.1, as a k3s agent does), the rest in plain
//! HTTP to the plain VIP. A pool of workers makes them, so that one stuck
//! on a hung server delays no other; a tick with no free worker is
//! counted as skipped.
//!
//! `keepalive`: long-lived TLS clients to the HTTPS VIP. Each keeps one
//! connection and sends `GET /readyz` (keep-alive) every interval; the
//! watchers among them hold `GET /watch` open and read its chunks. A
//! connection that ends, or a request that fails, is opened again at once;
//! a connect that fails is tried again after 250 ms plus up to 750 ms.
//!
//! Each new connection is a non-blocking connect: right after connect()
//! the kernel's socket already holds the destination the connect hook
//! chose, and a sock_diag lookup of (local address, candidate) for each of
//! `--candidates` finds it (getpeername would show the VIP).
//!
//! Output: one JSON line per event (see `Event`). Input: `pause` (finish
//! what is in flight, start nothing new, then print a `p` line),
//! `resume`; stdin closed ends the process.
//!
//! Usage: soakclient short --cgroup DIR --tls-vip ADDR --plain-vip ADDR
//!                   --ca PEM --candidates A,B,… --rate N [--tls-percent P]
//!                   [--workers N] [--timeout-ms MS] [--max-seconds S]
//!        soakclient keepalive --cgroup DIR --tls-vip ADDR --ca PEM
//!                   --candidates A,B,… --clients N [--watchers N]
//!                   [--interval-ms MS] [--timeout-ms MS] [--max-seconds S]

use std::{
    io::{BufRead, Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use rustls::{ClientConnection, StreamOwned};
use rustls_pki_types::ServerName;
use serde::Serialize;
use socklb::health::probe::{TlsOptions, client_config};
use socklb_tests::sockdiag::Lookup;

/// Milliseconds since the Unix epoch: the clock the harness, the daemon's
/// log and every client share.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// One line of output.
#[derive(Serialize)]
#[serde(tag = "k")]
enum Event {
    /// A new connection: connect, TLS handshake and the first answer.
    #[serde(rename = "c")]
    Connect {
        t: u64,
        /// `tls`, `plain`, `ka` (keep-alive) or `watch`.
        kind: &'static str,
        /// Where the kernel sent it, when the lookup found it.
        dst: Option<String>,
        ok: bool,
        ms: u64,
        /// The server that answered (`x-server`).
        server: Option<String>,
        /// `connect`, `tls`, `answer`: where it failed.
        stage: Option<&'static str>,
        err: Option<String>,
    },
    /// A request that failed on a connection that was open.
    #[serde(rename = "r")]
    Request {
        t: u64,
        kind: &'static str,
        dst: Option<String>,
        err: String,
    },
    /// A connection that ended between requests (the server or socklb
    /// closed it).
    #[serde(rename = "x")]
    Ended {
        t: u64,
        kind: &'static str,
        dst: Option<String>,
        why: String,
    },
    /// Each second: requests answered and failed, connections open, ticks
    /// skipped for want of a free worker.
    #[serde(rename = "s")]
    Second {
        t: u64,
        ok: u64,
        failed: u64,
        open: u64,
        skipped: u64,
    },
    #[serde(rename = "p")]
    Paused { t: u64 },
    #[serde(rename = "u")]
    Resumed { t: u64 },
}

/// The process's shared state: output, counters, pause and stop.
struct Shared {
    out: Mutex<std::io::BufWriter<std::io::Stdout>>,
    stop: AtomicBool,
    paused: AtomicBool,
    /// Connects and requests under way.
    in_flight: AtomicU64,
    ok: AtomicU64,
    failed: AtomicU64,
    open: AtomicU64,
    skipped: AtomicU64,
    tls: Arc<rustls::ClientConfig>,
    candidates: Vec<SocketAddr>,
    timeout: Duration,
}

impl Shared {
    fn emit(&self, event: &Event) {
        let Ok(line) = serde_json::to_string(event) else {
            return;
        };
        if let Ok(mut out) = self.out.lock() {
            let written = writeln!(out, "{line}").and_then(|()| out.flush());
            if written.is_err() {
                // The harness is gone.
                std::process::exit(0);
            }
        }
    }

    fn running(&self) -> bool {
        !self.stop.load(Ordering::Relaxed)
    }
}

/// Marks one connect or request as in flight while it lives.
struct InFlight<'a>(&'a AtomicU64);

impl<'a> InFlight<'a> {
    fn new(counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A connection that failed: where, and why.
struct Failure {
    stage: &'static str,
    err: String,
}

fn failure(stage: &'static str, err: impl ToString) -> Failure {
    Failure {
        stage,
        err: err.to_string(),
    }
}

/// A non-blocking connect to `vip`; returns the connected stream and where
/// the kernel sent it.
fn connect(
    vip: SocketAddrV4,
    lookup: &Lookup,
    candidates: &[SocketAddr],
    timeout: Duration,
) -> (Option<SocketAddr>, Result<TcpStream, Failure>) {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let raw = unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if raw < 0 {
        return (
            None,
            Err(failure("connect", std::io::Error::last_os_error())),
        );
    }
    // SAFETY: `raw` is a new descriptor nobody else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(raw) };
    let address = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: vip.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(vip.ip().octets()),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: connect(2) with a sockaddr_in we own and its size.
    let started = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            (&raw const address).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    let error = std::io::Error::last_os_error();
    if started != 0 && error.raw_os_error() != Some(libc::EINPROGRESS) {
        return (None, Err(failure("connect", error)));
    }
    let cookie = socklb_tests::sockdiag::cookie_of(socket.as_fd());
    let stream = TcpStream::from(socket);
    let destination = match (stream.local_addr(), cookie) {
        (Ok(local), Ok(cookie)) => lookup.destination(local, cookie, candidates).ok().flatten(),
        _ => None,
    };
    (destination, finish_connect(stream, timeout))
}

/// Waits for a non-blocking connect to complete, then makes the stream
/// blocking with read and write timeouts.
fn finish_connect(stream: TcpStream, timeout: Duration) -> Result<TcpStream, Failure> {
    let mut entry = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: poll(2) on one pollfd we own.
    let ready = unsafe { libc::poll(&mut entry, 1, timeout.as_millis() as i32) };
    if ready == 0 {
        return Err(failure("connect", "timed out"));
    }
    if let Ok(Some(error)) = stream.take_error() {
        return Err(failure("connect", error));
    }
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(timeout)))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(|error| failure("connect", error))?;
    Ok(stream)
}

/// Reads one HTTP answer's head (and, with a length, its body); returns
/// the head and whether the server keeps the connection.
fn read_answer(stream: &mut impl Read) -> Result<String, Failure> {
    let mut answer = Vec::new();
    let mut buffer = [0u8; 2048];
    let head_end = loop {
        if let Some(end) = answer.windows(4).position(|window| window == b"\r\n\r\n") {
            break end + 4;
        }
        match stream.read(&mut buffer) {
            Ok(0) => return Err(failure("answer", "closed")),
            Ok(read) => answer.extend_from_slice(&buffer[..read]),
            Err(error) => return Err(failure("answer", error)),
        }
        if answer.len() > 16 * 1024 {
            return Err(failure("answer", "head too long"));
        }
    };
    let head = String::from_utf8_lossy(&answer[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length: "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0);
    while answer.len() < head_end + length {
        match stream.read(&mut buffer) {
            Ok(0) => return Err(failure("answer", "closed in the body")),
            Ok(read) => answer.extend_from_slice(&buffer[..read]),
            Err(error) => return Err(failure("answer", error)),
        }
    }
    if !head.starts_with("HTTP/1.1 200") {
        return Err(failure("answer", head.lines().next().unwrap_or_default()));
    }
    Ok(head)
}

fn server_of(head: &str) -> Option<String> {
    head.lines()
        .find_map(|line| line.strip_prefix("x-server: "))
        .map(str::to_string)
}

type Tls = StreamOwned<ClientConnection, TcpStream>;

/// A TLS session over a connected stream, verified for 127.0.0.1.
fn tls_over(stream: TcpStream, config: &Arc<rustls::ClientConfig>) -> Result<Tls, Failure> {
    let name = ServerName::IpAddress(Ipv4Addr::LOCALHOST.into());
    let connection =
        ClientConnection::new(Arc::clone(config), name).map_err(|error| failure("tls", error))?;
    let mut tls = StreamOwned::new(connection, stream);
    while tls.conn.is_handshaking() {
        tls.conn
            .complete_io(&mut tls.sock)
            .map_err(|error| failure("tls", error))?;
    }
    Ok(tls)
}

/// One request on an open connection; returns the answering server.
fn request(
    stream: &mut (impl Read + Write),
    path: &str,
    keep_alive: bool,
) -> Result<String, Failure> {
    let connection = if keep_alive { "keep-alive" } else { "close" };
    let text =
        format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: {connection}\r\n\r\n");
    stream
        .write_all(text.as_bytes())
        .and_then(|()| stream.flush())
        .map_err(|error| failure("answer", error))?;
    let head = read_answer(stream)?;
    server_of(&head).ok_or_else(|| failure("answer", "no x-server"))
}

/// One short connection: connect, (TLS,) one request, close.
fn short_once(shared: &Shared, lookup: &Lookup, vip: SocketAddrV4, tls: bool) -> Event {
    let _in_flight = InFlight::new(&shared.in_flight);
    let (t, started) = (now_ms(), Instant::now());
    let (dst, connected) = connect(vip, lookup, &shared.candidates, shared.timeout);
    let outcome = connected.and_then(|stream| {
        if tls {
            request(&mut tls_over(stream, &shared.tls)?, "/readyz", false)
        } else {
            let mut stream = stream;
            request(&mut stream, "/hello", false)
        }
    });
    let counter = if outcome.is_ok() {
        &shared.ok
    } else {
        &shared.failed
    };
    counter.fetch_add(1, Ordering::Relaxed);
    let (server, stage, err) = match outcome {
        Ok(server) => (Some(server), None, None),
        Err(failure) => (None, Some(failure.stage), Some(failure.err)),
    };
    Event::Connect {
        t,
        kind: if tls { "tls" } else { "plain" },
        dst: dst.map(|dst| dst.to_string()),
        ok: server.is_some(),
        ms: started.elapsed().as_millis() as u64,
        server,
        stage,
        err,
    }
}

/// Paces short connections at `rate` per second over `workers` threads.
fn run_short(
    shared: &Arc<Shared>,
    tls_vip: SocketAddrV4,
    plain_vip: SocketAddrV4,
    rate: u32,
    tls_percent: u32,
    workers: u32,
) {
    // Tickets wait for a worker; a tick that finds every worker busy and
    // the queue full is skipped.
    let (tickets, queue) = mpsc::sync_channel::<bool>(workers as usize);
    let queue = Arc::new(Mutex::new(queue));
    for _ in 0..workers {
        let (shared, queue) = (Arc::clone(shared), Arc::clone(&queue));
        let spawned = std::thread::Builder::new()
            .stack_size(512 * 1024)
            .spawn(move || {
                let Ok(lookup) = Lookup::new() else {
                    return;
                };
                loop {
                    let ticket = queue.lock().ok().and_then(|queue| queue.recv().ok());
                    let Some(tls) = ticket else {
                        return;
                    };
                    let vip = if tls { tls_vip } else { plain_vip };
                    shared.emit(&short_once(&shared, &lookup, vip, tls));
                }
            });
        if spawned.is_err() {
            break;
        }
    }
    let spacing = Duration::from_secs(1) / rate.max(1);
    let mut next = Instant::now();
    let mut count: u64 = 0;
    while shared.running() {
        next += spacing;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        } else if next + Duration::from_secs(1) < Instant::now() {
            // Far behind (the process was stopped): start again from now.
            next = Instant::now();
        }
        if shared.paused.load(Ordering::SeqCst) {
            continue;
        }
        count += 1;
        let tls = count % 100 < u64::from(tls_percent);
        if tickets.try_send(tls).is_err() {
            shared.skipped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What a keep-alive client holds.
enum Held {
    None,
    Open {
        tls: Box<Tls>,
        dst: Option<String>,
        since: Instant,
    },
}

/// Whether an idle connection was ended by its peer (readable between
/// requests means an end of file or a reset); returns why.
fn ended(tls: &Tls, wait: Duration) -> Option<String> {
    let mut entry = libc::pollfd {
        fd: tls.sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll(2) on one pollfd we own.
    let ready = unsafe { libc::poll(&mut entry, 1, wait.as_millis() as i32) };
    if ready <= 0 || entry.revents == 0 {
        return None;
    }
    let mut byte = [0u8; 1];
    // SAFETY: a non-blocking peek of one byte into our buffer.
    let peeked = unsafe {
        libc::recv(
            tls.sock.as_raw_fd(),
            byte.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    let error = std::io::Error::last_os_error();
    Some(match peeked {
        0 => "eof".to_string(),
        n if n > 0 => "data".to_string(),
        _ if error.raw_os_error() == Some(libc::ECONNABORTED) => "aborted".to_string(),
        _ if error.raw_os_error() == Some(libc::ECONNRESET) => "reset".to_string(),
        _ => error.to_string(),
    })
}

/// One keep-alive (or watch) client.
struct KeepAlive {
    shared: Arc<Shared>,
    vip: SocketAddrV4,
    watch: bool,
    interval: Duration,
    jitter: u64,
}

impl KeepAlive {
    fn kind(&self) -> &'static str {
        if self.watch { "watch" } else { "ka" }
    }

    /// Opens a connection and makes its first request.
    fn open(&mut self, lookup: &Lookup) -> Held {
        let shared = Arc::clone(&self.shared);
        let _in_flight = InFlight::new(&shared.in_flight);
        let (t, started) = (now_ms(), Instant::now());
        let (dst, connected) = connect(self.vip, lookup, &shared.candidates, shared.timeout);
        let path = if self.watch { "/watch" } else { "/readyz" };
        let outcome = connected.and_then(|stream| {
            let mut tls = tls_over(stream, &shared.tls)?;
            let server = request(&mut tls, path, true)?;
            Ok((tls, server))
        });
        let dst = dst.map(|dst| dst.to_string());
        let (held, server, stage, err) = match outcome {
            Ok((tls, server)) => {
                shared.ok.fetch_add(1, Ordering::Relaxed);
                shared.open.fetch_add(1, Ordering::Relaxed);
                let held = Held::Open {
                    tls: Box::new(tls),
                    dst: dst.clone(),
                    since: Instant::now(),
                };
                (held, Some(server), None, None)
            }
            Err(failure) => {
                shared.failed.fetch_add(1, Ordering::Relaxed);
                (Held::None, None, Some(failure.stage), Some(failure.err))
            }
        };
        shared.emit(&Event::Connect {
            t,
            kind: self.kind(),
            dst,
            ok: server.is_some(),
            ms: started.elapsed().as_millis() as u64,
            server,
            stage,
            err,
        });
        held
    }

    /// 250 ms plus up to 750 ms, as client-go and the k3s agent spread
    /// their retries (xorshift64, no random crate).
    fn retry_pause(&mut self) {
        self.jitter ^= self.jitter << 13;
        self.jitter ^= self.jitter >> 7;
        self.jitter ^= self.jitter << 17;
        std::thread::sleep(Duration::from_millis(250 + self.jitter % 750));
    }

    fn close(&self, held: &mut Held) {
        if matches!(held, Held::Open { .. }) {
            self.shared.open.fetch_sub(1, Ordering::Relaxed);
        }
        *held = Held::None;
    }

    /// The next step of an open connection: watch a chunk, or wait for the
    /// next request and make it. Returns false when the connection ended.
    fn step(&mut self, held: &mut Held, next: &mut Instant) -> bool {
        let Held::Open { tls, dst, since } = held else {
            return false;
        };
        if self.watch {
            return self.watch_chunk(tls, dst);
        }
        let shared = Arc::clone(&self.shared);
        let now = Instant::now();
        if *next > now || shared.paused.load(Ordering::SeqCst) {
            let wait = next
                .saturating_duration_since(now)
                .clamp(Duration::from_millis(10), Duration::from_millis(200));
            let Some(why) = ended(tls, wait) else {
                return true;
            };
            let why = format!("{why} after {} s", since.elapsed().as_secs());
            shared.emit(&Event::Ended {
                t: now_ms(),
                kind: "ka",
                dst: dst.clone(),
                why,
            });
            return false;
        }
        *next += self.interval;
        if *next < now {
            *next = now + self.interval;
        }
        let _in_flight = InFlight::new(&shared.in_flight);
        match request(tls.as_mut(), "/readyz", true) {
            Ok(_) => {
                shared.ok.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(failure) => {
                shared.failed.fetch_add(1, Ordering::Relaxed);
                let event = Event::Request {
                    t: now_ms(),
                    kind: "ka",
                    dst: dst.clone(),
                    err: failure.err,
                };
                shared.emit(&event);
                false
            }
        }
    }

    /// Reads the watch's next chunk (one a second); none within the
    /// timeout means a stuck server. Returns false when the watch ended.
    fn watch_chunk(&self, tls: &mut Tls, dst: &Option<String>) -> bool {
        let mut buffer = [0u8; 512];
        let (t, kind, dst) = (now_ms(), "watch", dst.clone());
        let event = match tls.read(&mut buffer) {
            Ok(0) => Event::Ended {
                t,
                kind,
                dst,
                why: "eof".into(),
            },
            Ok(_) => return true,
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                let err = format!("no event for {:?}", self.shared.timeout);
                Event::Request { t, kind, dst, err }
            }
            Err(error) => Event::Ended {
                t,
                kind,
                dst,
                why: error.to_string(),
            },
        };
        self.shared.emit(&event);
        false
    }

    fn run(mut self, start_after: Duration) {
        std::thread::sleep(start_after);
        let Ok(lookup) = Lookup::new() else {
            return;
        };
        let mut held = Held::None;
        let mut next = Instant::now() + self.interval;
        while self.shared.running() {
            if matches!(held, Held::None) {
                if self.shared.paused.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                held = self.open(&lookup);
                if matches!(held, Held::None) {
                    self.retry_pause();
                }
                continue;
            }
            if !self.step(&mut held, &mut next) {
                self.close(&mut held);
            }
        }
    }
}

struct Args {
    mode: String,
    cgroup: Option<PathBuf>,
    tls_vip: Option<SocketAddrV4>,
    plain_vip: Option<SocketAddrV4>,
    ca: Option<PathBuf>,
    candidates: Vec<SocketAddr>,
    rate: u32,
    tls_percent: u32,
    workers: u32,
    clients: u32,
    watchers: u32,
    interval: Duration,
    timeout: Duration,
    max: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut words = std::env::args().skip(1);
    let mode = words.next().ok_or("short or keepalive")?;
    let mut args = Args {
        mode,
        cgroup: None,
        tls_vip: None,
        plain_vip: None,
        ca: None,
        candidates: Vec::new(),
        rate: 100,
        tls_percent: 25,
        workers: 128,
        clients: 1,
        watchers: 0,
        interval: Duration::from_secs(1),
        timeout: Duration::from_secs(3),
        max: Duration::from_secs(7200),
    };
    while let Some(flag) = words.next() {
        let value = words.next().ok_or(format!("{flag} needs a value"))?;
        let number = || value.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        let vip = || {
            value
                .parse::<SocketAddrV4>()
                .map_err(|e| format!("{flag}: {e}"))
        };
        match flag.as_str() {
            "--cgroup" => args.cgroup = Some(PathBuf::from(&value)),
            "--tls-vip" => args.tls_vip = Some(vip()?),
            "--plain-vip" => args.plain_vip = Some(vip()?),
            "--ca" => args.ca = Some(PathBuf::from(&value)),
            "--candidates" => {
                args.candidates = value
                    .split(',')
                    .map(|text| {
                        text.parse()
                            .map_err(|e| format!("--candidates {text}: {e}"))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--rate" => args.rate = number()?.clamp(1, 2000) as u32,
            "--tls-percent" => args.tls_percent = number()?.min(100) as u32,
            "--workers" => args.workers = number()?.clamp(1, 512) as u32,
            "--clients" => args.clients = number()?.clamp(1, 2000) as u32,
            "--watchers" => args.watchers = number()?.min(2000) as u32,
            "--interval-ms" => args.interval = Duration::from_millis(number()?.max(10)),
            "--timeout-ms" => args.timeout = Duration::from_millis(number()?.clamp(10, 60_000)),
            "--max-seconds" => args.max = Duration::from_secs(number()?.clamp(1, 86_400)),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

/// Reads `pause`, `resume` and the end of stdin.
fn control(shared: &Arc<Shared>) {
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else {
            break;
        };
        match line.trim() {
            "pause" => {
                shared.paused.store(true, Ordering::SeqCst);
                // What is in flight finishes within the timeout.
                let deadline = Instant::now() + shared.timeout * 2 + Duration::from_secs(1);
                while shared.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                shared.emit(&Event::Paused { t: now_ms() });
            }
            "resume" => {
                shared.paused.store(false, Ordering::SeqCst);
                shared.emit(&Event::Resumed { t: now_ms() });
            }
            _ => {}
        }
    }
    shared.stop.store(true, Ordering::SeqCst);
}

fn fail(message: impl std::fmt::Display) -> ! {
    eprintln!("soakclient: {message}");
    std::process::exit(2);
}

/// The shared state, and the threads every mode has: stdin's commands,
/// the time limit, and the summary each second.
fn shared_state(args: &Args) -> Arc<Shared> {
    let tls = client_config(&TlsOptions {
        ca: args.ca.clone(),
        ..TlsOptions::default()
    })
    .unwrap_or_else(|error| fail(format!("TLS: {error}")));
    let shared = Arc::new(Shared {
        out: Mutex::new(std::io::BufWriter::new(std::io::stdout())),
        stop: AtomicBool::new(false),
        paused: AtomicBool::new(false),
        in_flight: AtomicU64::new(0),
        ok: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        open: AtomicU64::new(0),
        skipped: AtomicU64::new(0),
        tls,
        candidates: args.candidates.clone(),
        timeout: args.timeout,
    });
    let (controlled, limited, summed) = (
        Arc::clone(&shared),
        Arc::clone(&shared),
        Arc::clone(&shared),
    );
    std::thread::spawn(move || control(&controlled));
    let max = args.max;
    std::thread::spawn(move || {
        std::thread::sleep(max);
        limited.stop.store(true, Ordering::SeqCst);
    });
    std::thread::spawn(move || {
        while summed.running() {
            std::thread::sleep(Duration::from_secs(1));
            summed.emit(&Event::Second {
                t: now_ms(),
                ok: summed.ok.swap(0, Ordering::Relaxed),
                failed: summed.failed.swap(0, Ordering::Relaxed),
                open: summed.open.load(Ordering::Relaxed),
                skipped: summed.skipped.swap(0, Ordering::Relaxed),
            });
        }
    });
    shared
}

/// The keep-alive clients, each in a thread, started over one interval
/// as a fleet starts.
fn run_keepalive(shared: &Arc<Shared>, args: &Args, vip: SocketAddrV4) {
    let clients: Vec<KeepAlive> = (0..args.clients)
        .map(|index| KeepAlive {
            shared: Arc::clone(shared),
            vip,
            watch: index < args.watchers,
            interval: args.interval,
            jitter: 0x9e37_79b9_7f4a_7c15 ^ (u64::from(index) << 20 | 1),
        })
        .collect();
    let count = clients.len() as u32;
    std::thread::scope(|scope| {
        for (index, client) in clients.into_iter().enumerate() {
            let start_after = args.interval * index as u32 / count.max(1);
            let _ = std::thread::Builder::new()
                .stack_size(512 * 1024)
                .spawn_scoped(scope, move || client.run(start_after));
        }
    });
}

fn main() {
    let args = parse_args().unwrap_or_else(|message| fail(message));
    socklb_tests::raise_open_files();
    if let Some(cgroup) = &args.cgroup
        && let Err(error) =
            std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
    {
        fail(format!("joining {}: {error}", cgroup.display()));
    }
    let tls_vip = args
        .tls_vip
        .unwrap_or_else(|| fail("--tls-vip is required"));
    let shared = shared_state(&args);
    match args.mode.as_str() {
        "short" => {
            let plain_vip = args
                .plain_vip
                .unwrap_or_else(|| fail("short needs --plain-vip"));
            run_short(
                &shared,
                tls_vip,
                plain_vip,
                args.rate,
                args.tls_percent,
                args.workers,
            );
        }
        "keepalive" => run_keepalive(&shared, &args, tls_vip),
        other => fail(format!("unknown mode {other}")),
    }
}
