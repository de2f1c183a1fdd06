//! A small stand-in for a Kubernetes apiserver or k3s supervisor, for the
//! scenario suites: TLS with a self-signed certificate, `/readyz` and
//! `/ping` answer 200, `/cpu` burns about 50 ms of CPU first (like the
//! node-password scrypt check of k3s), `/work` is served at a fixed
//! capacity (`cluster::WORK_PER_SECOND` per server, first come first
//! served, as a server with a bounded worker pool), anything else 404. Each answer
//! carries `x-server: NAME` and closes the connection, unless the request
//! asked `connection: keep-alive` (a long-lived agent): then the
//! connection serves the next request, and may idle for two minutes.
//!
//! With `--hang`, it accepts TCP connections and never says a word: the
//! server that 318 rke2 agents were stuck on. SIGUSR1 turns a running
//! server into such a one in place, with no moment of refused connects.
//! SIGUSR2 makes `/readyz` and `/ping` answer [`SLOW_ANSWER`] late (an
//! overloaded server), or on time again.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Parser;

/// A test apiserver over TLS (see the module documentation).
#[derive(Debug, Parser)]
#[command(name = "testapiserver")]
struct Args {
    /// Where to listen.
    #[arg(long)]
    listen: SocketAddr,
    /// The name every answer carries in `x-server`.
    #[arg(long, default_value = "server")]
    name: String,
    /// Accept TCP and never answer.
    #[arg(long)]
    hang: bool,
}

/// Set by SIGUSR1: accept, and never answer again.
static HANG: AtomicBool = AtomicBool::new(false);

extern "C" fn hang_now(_signal: libc::c_int) {
    // An atomic store is async-signal-safe.
    HANG.store(true, Ordering::SeqCst);
}

/// Toggled by SIGUSR2: `/readyz` and `/ping` answer `SLOW_ANSWER` late.
static SLOW: AtomicBool = AtomicBool::new(false);

/// How late a slow server answers: more than a probe's default timeout
/// (1 s), less than an agent's (2 s).
const SLOW_ANSWER: Duration = Duration::from_millis(1500);

extern "C" fn toggle_slow(_signal: libc::c_int) {
    // An atomic update is async-signal-safe.
    SLOW.fetch_xor(true, Ordering::SeqCst);
}

/// Holds a connection without a word until the process ends (bounded).
fn hold_silently<T>(stream: T) {
    for _ in 0..3600 {
        std::thread::sleep(Duration::from_secs(1));
    }
    drop(stream);
}

use rustls::{ServerConfig, ServerConnection, StreamOwned};
use rustls_pki_types::PrivateKeyDer;

/// When the next `/work` request may be served.
static NEXT_WORK: Mutex<Option<Instant>> = Mutex::new(None);

/// Waits for this request's turn in the server's fixed capacity.
fn wait_for_work_slot() {
    let spacing = Duration::from_secs(1) / socklb_tests::cluster::WORK_PER_SECOND;
    let slot = {
        let mut next = NEXT_WORK.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let slot = next.map_or(now, |next| next.max(now));
        *next = Some(slot + spacing);
        slot
    };
    std::thread::sleep(slot.saturating_duration_since(Instant::now()));
}

/// CPU time one `/cpu` request costs.
const CPU_COST: Duration = Duration::from_millis(50);

fn server_config(ip: std::net::IpAddr) -> ServerConfig {
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec![ip.to_string()]).expect("params");
    let certificate = params.self_signed(&key).expect("certificate");
    ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![certificate.der().clone()],
            PrivateKeyDer::try_from(key.serialize_der()).expect("key der"),
        )
        .expect("server config")
}

/// Busy work for `CPU_COST` of wall time on this thread.
fn burn_cpu() -> u64 {
    let started = Instant::now();
    let mut value: u64 = 0x9e37_79b9_7f4a_7c15;
    while started.elapsed() < CPU_COST {
        for _ in 0..10_000 {
            value = value.rotate_left(7) ^ value.wrapping_mul(0x2545_f491_4f6c_dd1d);
        }
    }
    value
}

fn serve(stream: TcpStream, config: Arc<ServerConfig>, name: &str) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let Ok(connection) = ServerConnection::new(config) else {
        return;
    };
    let mut tls = StreamOwned::new(connection, stream);
    // Bounded: a keep-alive connection serves at most this many requests.
    for _ in 0..100_000 {
        let mut request = Vec::new();
        let mut buffer = [0u8; 2048];
        while !request.windows(4).any(|window| window == b"\r\n\r\n") {
            match tls.read(&mut buffer) {
                Ok(0) | Err(_) => return,
                Ok(read) => request.extend_from_slice(&buffer[..read]),
            }
            if request.len() > 16 * 1024 {
                return;
            }
        }
        if HANG.load(Ordering::SeqCst) {
            hold_silently(tls);
            return;
        }
        let line = String::from_utf8_lossy(&request);
        let path = line.split_whitespace().nth(1).unwrap_or("/");
        let keep_alive = line
            .lines()
            .any(|header| header.eq_ignore_ascii_case("connection: keep-alive"));
        if matches!(path, "/readyz" | "/ping") && SLOW.load(Ordering::SeqCst) {
            std::thread::sleep(SLOW_ANSWER);
        }
        let (status, body) = match path {
            "/readyz" => ("200 OK", "ok".to_string()),
            "/ping" => ("200 OK", "pong".to_string()),
            "/cpu" => ("200 OK", format!("{:x}", burn_cpu())),
            "/work" => {
                wait_for_work_slot();
                ("200 OK", "done".to_string())
            }
            _ => ("404 Not Found", "not found".to_string()),
        };
        let connection = if keep_alive { "keep-alive" } else { "close" };
        let answer = format!(
            "HTTP/1.1 {status}\r\nx-server: {name}\r\ncontent-length: {}\r\nconnection: {connection}\r\n\r\n{body}",
            body.len()
        );
        let _ = tls.write_all(answer.as_bytes());
        let _ = tls.flush();
        if !keep_alive {
            tls.conn.send_close_notify();
            let _ = tls.flush();
            return;
        }
        let _ = tls.sock.set_read_timeout(Some(Duration::from_secs(120)));
    }
}

fn main() {
    let Args { listen, name, hang } = Args::parse();
    let listener = TcpListener::bind(listen).unwrap_or_else(|error| {
        eprintln!("testapiserver: listening on {listen}: {error}");
        std::process::exit(1);
    });
    let config = Arc::new(server_config(listen.ip()));
    HANG.store(hang, Ordering::SeqCst);
    // SAFETY: installs a handler that only stores to an atomic.
    unsafe { libc::signal(libc::SIGUSR1, hang_now as *const () as libc::sighandler_t) };
    // SAFETY: installs a handler that only updates an atomic.
    unsafe {
        libc::signal(
            libc::SIGUSR2,
            toggle_slow as *const () as libc::sighandler_t,
        )
    };
    let mut held = Vec::new();
    for stream in listener.incoming().flatten() {
        if HANG.load(Ordering::SeqCst) {
            // Accepted, and never answered.
            held.push(stream);
            continue;
        }
        let config = Arc::clone(&config);
        let name = name.clone();
        std::thread::spawn(move || serve(stream, config, &name));
    }
}
