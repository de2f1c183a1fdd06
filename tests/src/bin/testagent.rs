//! A stand-in for a k3s/rke2 agent talking to its apiserver through the
//! VIP: joins a cgroup, then makes HTTPS requests, each on a new
//! connection, retrying a failed one, and prints one JSON line per request.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::Arc,
    time::{Duration, Instant},
};

use clap::Parser;
use rustls::{ClientConnection, StreamOwned};
use rustls_pki_types::ServerName;
use serde::Serialize;
use socklb::health::probe::{TlsOptions, client_config};
use socklb_tests::cli::{join_cgroup, millis};

#[derive(Serialize)]
struct Request {
    ok: bool,
    /// The server that answered (its `x-server` header).
    server: Option<String>,
    /// Attempts made, 1 without a retry.
    attempts: u32,
    /// Time from the first attempt to the answer or the last failure.
    ms: u64,
    /// Errors of the failed attempts.
    errors: Vec<String>,
    /// How long each failed attempt took.
    failed_ms: Vec<u64>,
}

/// HTTPS requests through a VIP, one JSON line each.
#[derive(Debug, Parser)]
#[command(name = "testagent")]
struct Args {
    /// Where to connect (a VIP).
    #[arg(long)]
    addr: SocketAddr,
    /// A cgroup v2 directory to join first.
    #[arg(long)]
    cgroup: Option<std::path::PathBuf>,
    /// The path of every request.
    #[arg(long, default_value = "/readyz")]
    path: String,
    /// Requests to make.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    requests: u32,
    /// Pause between requests.
    #[arg(long = "interval-ms", value_name = "MS", default_value = "0", value_parser = millis)]
    interval: Duration,
    /// Bound of each attempt, connect to answer.
    #[arg(long = "timeout-ms", value_name = "MS", default_value = "2000", value_parser = millis)]
    timeout: Duration,
    /// Retries of a failed request.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=10))]
    retries: u32,
}

/// One HTTPS GET on a new connection, all of it within `timeout`.
fn get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
    config: &Arc<rustls::ClientConfig>,
) -> Result<String, String> {
    let deadline = Instant::now() + timeout;
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| format!("connect: {e}"))?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(left))
        .map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(left))
        .map_err(|e| e.to_string())?;
    let name = ServerName::IpAddress(addr.ip().into());
    let connection = ClientConnection::new(Arc::clone(config), name).map_err(|e| e.to_string())?;
    let mut tls = StreamOwned::new(connection, stream);
    let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    tls.write_all(request.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match tls.read(&mut buffer) {
            Ok(0) => break,
            Ok(read) => answer.extend_from_slice(&buffer[..read]),
            // Servers that close without close_notify: what came is enough.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => break,
            Err(e) => return Err(format!("receive: {e}")),
        }
    }
    let text = String::from_utf8_lossy(&answer);
    if !text.starts_with("HTTP/1.1 200") {
        return Err(format!(
            "answer: {}",
            text.lines().next().unwrap_or("(empty)")
        ));
    }
    text.lines()
        .find_map(|line| line.strip_prefix("x-server: "))
        .map(str::to_string)
        .ok_or_else(|| "answer without x-server".to_string())
}

fn main() {
    let args = Args::parse();
    if let Some(cgroup) = &args.cgroup
        && let Err(message) = join_cgroup(cgroup)
    {
        eprintln!("testagent: {message}");
        std::process::exit(2);
    }
    let config = client_config(&TlsOptions::default()).expect("TLS client");
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for index in 0..args.requests {
        if index > 0 {
            std::thread::sleep(args.interval);
        }
        let started = Instant::now();
        let mut errors = Vec::new();
        let mut failed_ms = Vec::new();
        let mut server = None;
        for _ in 0..=args.retries {
            let attempt_started = Instant::now();
            match get(args.addr, &args.path, args.timeout, &config) {
                Ok(name) => {
                    server = Some(name);
                    break;
                }
                Err(error) => {
                    errors.push(error);
                    failed_ms.push(attempt_started.elapsed().as_millis() as u64);
                }
            }
        }
        let request = Request {
            ok: server.is_some(),
            attempts: errors.len() as u32 + u32::from(server.is_some()),
            server,
            ms: started.elapsed().as_millis() as u64,
            errors,
            failed_ms,
        };
        let line = serde_json::to_string(&request).expect("serialise");
        if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
            std::process::exit(1);
        }
    }
}
