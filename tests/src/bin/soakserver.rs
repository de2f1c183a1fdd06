//! A control-plane server for the soak (`cargo xtask soak`): HTTPS with a
//! certificate the clients verify, and the same HTTP/1.1 in plain TCP on a
//! second port. `GET /readyz` answers `ok`, `/hello` answers the server's
//! name, and `/watch` is a watch-like long response: one chunk a second
//! until the client leaves. Every answer carries `x-server: NAME`; a
//! request with `connection: keep-alive` keeps the connection for the
//! next.
//!
//! Faults, in place and without a moment of refused connects:
//! - SIGUSR1: hang. It keeps accepting, answers nothing on any connection,
//!   old or new, and never completes another TLS handshake: the server
//!   that a herd of agents once stuck to.
//! - SIGUSR2: slow, or normal again. Every answer waits `--slow-ms` first
//!   (the soak gives 0.8 × socklb's probe timeout).
//!
//! Usage: soakserver --name NAME --tls ADDR:PORT --plain ADDR:PORT
//!                   --cert PEM --key PEM [--slow-ms MS] [--max-seconds S]

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use rustls::{ServerConfig, ServerConnection, StreamOwned};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

static HANG: AtomicBool = AtomicBool::new(false);
static SLOW: AtomicBool = AtomicBool::new(false);

extern "C" fn hang_now(_signal: libc::c_int) {
    // Atomic stores are async-signal-safe.
    HANG.store(true, Ordering::SeqCst);
}

extern "C" fn toggle_slow(_signal: libc::c_int) {
    SLOW.fetch_xor(true, Ordering::SeqCst);
}

/// Requests one connection serves at most; seconds a watch lasts at most.
const MAX_REQUESTS: u32 = 100_000;
const MAX_WATCH_SECONDS: u32 = 3600;
/// How long a connection may stay idle between requests.
const IDLE: Duration = Duration::from_secs(120);

struct Args {
    name: String,
    tls: SocketAddr,
    plain: SocketAddr,
    cert: PathBuf,
    key: PathBuf,
    slow: Duration,
    max: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut words = std::env::args().skip(1);
    let (mut name, mut tls, mut plain, mut cert, mut key) = (None, None, None, None, None);
    let (mut slow, mut max) = (Duration::from_millis(400), Duration::from_secs(7200));
    while let Some(flag) = words.next() {
        let value = words.next().ok_or(format!("{flag} needs a value"))?;
        let addr = || {
            value
                .parse::<SocketAddr>()
                .map_err(|e| format!("{flag}: {e}"))
        };
        let number = || value.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--name" => name = Some(value.clone()),
            "--tls" => tls = Some(addr()?),
            "--plain" => plain = Some(addr()?),
            "--cert" => cert = Some(PathBuf::from(&value)),
            "--key" => key = Some(PathBuf::from(&value)),
            "--slow-ms" => slow = Duration::from_millis(number()?.min(60_000)),
            "--max-seconds" => max = Duration::from_secs(number()?.clamp(1, 86_400)),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Args {
        name: name.ok_or("--name is required")?,
        tls: tls.ok_or("--tls is required")?,
        plain: plain.ok_or("--plain is required")?,
        cert: cert.ok_or("--cert is required")?,
        key: key.ok_or("--key is required")?,
        slow,
        max,
    })
}

fn tls_config(args: &Args) -> Result<Arc<ServerConfig>, String> {
    let chain = CertificateDer::pem_file_iter(&args.cert)
        .and_then(|items| items.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: {e}", args.cert.display()))?;
    let key = PrivateKeyDer::from_pem_file(&args.key)
        .map_err(|e| format!("{}: {e}", args.key.display()))?;
    let mut config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| e.to_string())?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Holds a connection without a word until the process ends (bounded).
fn hold_silently<T>(stream: T) {
    for _ in 0..MAX_WATCH_SECONDS {
        std::thread::sleep(Duration::from_secs(1));
    }
    drop(stream);
}

/// One request's head, or None when the client left.
fn read_request(stream: &mut impl Read) -> Option<String> {
    let mut request = Vec::new();
    let mut buffer = [0u8; 2048];
    while !request.windows(4).any(|window| window == b"\r\n\r\n") {
        match stream.read(&mut buffer) {
            Ok(0) | Err(_) => return None,
            Ok(read) => request.extend_from_slice(&buffer[..read]),
        }
        if request.len() > 16 * 1024 {
            return None;
        }
    }
    Some(String::from_utf8_lossy(&request).into_owned())
}

/// Streams a chunk a second until the client leaves or the server hangs.
fn watch(stream: &mut impl Write, name: &str) -> bool {
    let head = format!(
        "HTTP/1.1 200 OK\r\nx-server: {name}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    );
    if stream.write_all(head.as_bytes()).is_err() {
        return false;
    }
    for event in 0..MAX_WATCH_SECONDS {
        if HANG.load(Ordering::SeqCst) {
            return true;
        }
        let line = format!("event {event}\n");
        let chunk = format!("{:x}\r\n{line}\r\n", line.len());
        if stream
            .write_all(chunk.as_bytes())
            .and_then(|()| stream.flush())
            .is_err()
        {
            return false;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    false
}

/// Serves HTTP/1.1 requests on one connection. Returns the stream when the
/// server hung meanwhile (the caller holds it without a word).
fn serve<S: Read + Write>(mut stream: S, name: &str, slow: Duration) -> Option<S> {
    for _ in 0..MAX_REQUESTS {
        let request = read_request(&mut stream)?;
        if HANG.load(Ordering::SeqCst) {
            return Some(stream);
        }
        if SLOW.load(Ordering::SeqCst) {
            std::thread::sleep(slow);
        }
        let path = request.split_whitespace().nth(1).unwrap_or("/");
        let keep_alive = request
            .lines()
            .any(|header| header.eq_ignore_ascii_case("connection: keep-alive"));
        let (status, body) = match path {
            "/readyz" => ("200 OK", "ok".to_string()),
            "/hello" => ("200 OK", format!("{name}\n")),
            "/watch" => return watch(&mut stream, name).then_some(stream),
            _ => ("404 Not Found", "not found".to_string()),
        };
        let connection = if keep_alive { "keep-alive" } else { "close" };
        let answer = format!(
            "HTTP/1.1 {status}\r\nx-server: {name}\r\ncontent-length: {}\r\nconnection: {connection}\r\n\r\n{body}",
            body.len()
        );
        if stream
            .write_all(answer.as_bytes())
            .and_then(|()| stream.flush())
            .is_err()
            || !keep_alive
        {
            return None;
        }
    }
    None
}

fn serve_tls(stream: TcpStream, config: Arc<ServerConfig>, name: &str, slow: Duration) {
    if HANG.load(Ordering::SeqCst) {
        return hold_silently(stream);
    }
    let Ok(connection) = ServerConnection::new(config) else {
        return;
    };
    let tls = StreamOwned::new(connection, stream);
    if let Some(tls) = serve(tls, name, slow) {
        // Hung: nothing more is sent, not even close_notify.
        hold_silently(tls.sock);
    }
}

fn serve_plain(stream: TcpStream, name: &str, slow: Duration) {
    if HANG.load(Ordering::SeqCst) {
        return hold_silently(stream);
    }
    if let Some(stream) = serve(stream, name, slow) {
        hold_silently(stream);
    }
}

/// Accepts on `listener` until the process ends, a thread per connection.
fn accept_loop(listener: TcpListener, serve: impl Fn(TcpStream) + Send + Sync + Clone + 'static) {
    for stream in listener.incoming().flatten() {
        let _ = stream.set_read_timeout(Some(IDLE));
        let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
        let serve = serve.clone();
        let spawned = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || serve(stream));
        if spawned.is_err() {
            // Out of threads: this connection is dropped, the next tried.
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn main() {
    let args = parse_args().unwrap_or_else(|message| {
        eprintln!("soakserver: {message}");
        std::process::exit(2);
    });
    let config = tls_config(&args).unwrap_or_else(|message| {
        eprintln!("soakserver: TLS: {message}");
        std::process::exit(2);
    });
    let bind = |addr: SocketAddr| {
        TcpListener::bind(addr).unwrap_or_else(|error| {
            eprintln!("soakserver: listening on {addr}: {error}");
            std::process::exit(1);
        })
    };
    let (tls, plain) = (bind(args.tls), bind(args.plain));
    // SAFETY: the handlers only store to atomics.
    unsafe {
        libc::signal(libc::SIGUSR1, hang_now as *const () as libc::sighandler_t);
        libc::signal(
            libc::SIGUSR2,
            toggle_slow as *const () as libc::sighandler_t,
        );
    }
    let max = args.max;
    std::thread::spawn(move || {
        std::thread::sleep(max);
        std::process::exit(0);
    });
    let (name, slow) = (args.name.clone(), args.slow);
    std::thread::spawn(move || accept_loop(plain, move |stream| serve_plain(stream, &name, slow)));
    let name = args.name;
    accept_loop(tls, move |stream| {
        serve_tls(stream, Arc::clone(&config), &name, slow)
    });
}
