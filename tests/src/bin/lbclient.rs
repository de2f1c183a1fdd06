//! Test client: joins a cgroup (and optionally a fresh network namespace),
//! then connects to an address a bounded number of times and prints one JSON
//! line per attempt: who served it, what getpeername said, or the error.
//!
//! With --hold-ms, each connection is kept open after the name is read,
//! until the peer ends it or MS pass, and the line says how it ended.
//! With --keep-open-ms, every connection stays open until MS after the
//! last one was made (the lines are printed as they are made).
//!
//! The backends of the tests answer each connection with their name and a
//! newline; that is what `served_by` holds.

use std::{
    io::{BufRead, BufReader, ErrorKind, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use clap::Parser;
use serde::Serialize;
use socklb_tests::cli::{join_cgroup, millis};

/// What `--new-netns` answers with, from a listener inside that namespace.
pub const OWN_NETNS_NAME: &str = "own-netns";

/// Connects to ADDR from inside a cgroup, COUNT times, and prints one JSON
/// line per attempt.
#[derive(Debug, Parser)]
#[command(name = "lbclient")]
struct Args {
    /// Where to connect (a VIP).
    #[arg(long)]
    addr: SocketAddr,
    /// A cgroup v2 directory to join first.
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// Connect attempts.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    count: u32,
    /// Pause between attempts.
    #[arg(long = "interval-ms", value_name = "MS", default_value = "0", value_parser = millis)]
    interval: Duration,
    /// Bound of each connect and of the read of the name.
    #[arg(long = "timeout-ms", value_name = "MS", default_value = "2000", value_parser = millis)]
    timeout: Duration,
    /// Connect from a new network namespace, where a listener on ADDR
    /// answers `own-netns`.
    #[arg(long)]
    new_netns: bool,
    /// Keep each connection open after the name, up to MS.
    #[arg(long = "hold-ms", value_name = "MS", value_parser = millis)]
    hold: Option<Duration>,
    /// Keep every connection open until MS after the last one was made.
    #[arg(long = "keep-open-ms", value_name = "MS", value_parser = millis)]
    keep_open: Option<Duration>,
}

#[derive(Serialize)]
struct Attempt {
    ok: bool,
    served_by: Option<String>,
    peer: Option<String>,
    errno: Option<i32>,
    error: Option<String>,
    /// With --hold-ms: "eof", "error" (see errno) or "timeout".
    hold_end: Option<String>,
    held_ms: Option<u64>,
    /// When the attempt began, in ms since the client started.
    at_ms: u64,
}

/// Moves this process into a new network namespace with loopback up, and
/// starts a listener on `addr` there that answers `own-netns`.
fn enter_new_netns(addr: SocketAddr) -> Result<(), String> {
    // SAFETY: unshare affects only this (single-threaded so far) process.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "unshare(CLONE_NEWNET): {}",
            std::io::Error::last_os_error()
        ));
    }
    let status = Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .map_err(|e| format!("running ip (iproute2): {e}"))?;
    if !status.success() {
        return Err("ip link set lo up failed".into());
    }
    let listener = TcpListener::bind(addr)
        .map_err(|e| format!("listening on {addr} in the new netns: {e}"))?;
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let _ = writeln!(stream, "{OWN_NETNS_NAME}");
        }
    });
    Ok(())
}

fn attempt(
    addr: SocketAddr,
    timeout: Duration,
    hold: Option<Duration>,
    kept: &mut Vec<TcpStream>,
) -> Attempt {
    match TcpStream::connect_timeout(&addr, timeout) {
        Err(error) => Attempt {
            ok: false,
            served_by: None,
            peer: None,
            errno: error.raw_os_error(),
            error: Some(error.to_string()),
            hold_end: None,
            held_ms: None,
            at_ms: 0,
        },
        Ok(stream) => {
            let peer = stream.peer_addr().ok().map(|peer| peer.to_string());
            let _ = stream.set_read_timeout(Some(timeout));
            let mut line = String::new();
            let mut reader = BufReader::new(&stream);
            let read = reader.read_line(&mut line);
            let served_by = line.trim().to_string();
            let ok = read.is_ok() && !served_by.is_empty();
            let mut attempt = Attempt {
                ok,
                served_by: (!served_by.is_empty()).then_some(served_by),
                peer,
                errno: read.as_ref().err().and_then(std::io::Error::raw_os_error),
                error: read.err().map(|e| e.to_string()),
                hold_end: None,
                held_ms: None,
                at_ms: 0,
            };
            if let (true, Some(hold)) = (ok, hold) {
                let started = Instant::now();
                let _ = stream.set_read_timeout(Some(hold));
                let mut rest = Vec::new();
                let end = match reader.read_to_end(&mut rest) {
                    Ok(_) => "eof",
                    Err(error)
                        if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
                    {
                        "timeout"
                    }
                    Err(error) => {
                        attempt.errno = error.raw_os_error();
                        attempt.error = Some(error.to_string());
                        "error"
                    }
                };
                attempt.hold_end = Some(end.to_string());
                attempt.held_ms = Some(started.elapsed().as_millis() as u64);
            }
            drop(reader);
            kept.push(stream);
            attempt
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(dir) = &args.cgroup
        && let Err(message) = join_cgroup(dir)
    {
        eprintln!("lbclient: {message}");
        return ExitCode::from(2);
    }
    if args.new_netns
        && let Err(message) = enter_new_netns(args.addr)
    {
        eprintln!("lbclient: {message}");
        return ExitCode::from(2);
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut kept = Vec::new();
    let started = Instant::now();
    for index in 0..args.count {
        if index > 0 && !args.interval.is_zero() {
            std::thread::sleep(args.interval);
        }
        let at_ms = started.elapsed().as_millis() as u64;
        let made = Attempt {
            at_ms,
            ..attempt(args.addr, args.timeout, args.hold, &mut kept)
        };
        let line = serde_json::to_string(&made).expect("serialise");
        if args.keep_open.is_none() {
            kept.clear();
        }
        if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
            return ExitCode::from(1);
        }
    }
    if let Some(keep_open) = args.keep_open {
        std::thread::sleep(keep_open);
    }
    ExitCode::SUCCESS
}
