//! Test client: joins a cgroup (and optionally a fresh network namespace),
//! then connects to an address a bounded number of times and prints one JSON
//! line per attempt: who served it, what getpeername said, or the error.
//!
//! Usage: lbclient --addr ADDR:PORT [--cgroup DIR] [--count N]
//!                 [--interval-ms MS] [--timeout-ms MS] [--new-netns]
//!                 [--hold-ms MS]
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

use serde::Serialize;

/// What `--new-netns` answers with, from a listener inside that namespace.
pub const OWN_NETNS_NAME: &str = "own-netns";

#[derive(Debug)]
struct Args {
    addr: SocketAddr,
    cgroup: Option<PathBuf>,
    count: u32,
    interval: Duration,
    timeout: Duration,
    new_netns: bool,
    hold: Option<Duration>,
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
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: "127.0.0.1:1".parse().expect("literal"),
        cgroup: None,
        count: 1,
        interval: Duration::ZERO,
        timeout: Duration::from_secs(2),
        new_netns: false,
        hold: None,
        keep_open: None,
    };
    let mut have_addr = false;
    let mut words = std::env::args().skip(1);
    while let Some(flag) = words.next() {
        let mut value = || words.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => {
                args.addr = value()?.parse().map_err(|e| format!("--addr: {e}"))?;
                have_addr = true;
            }
            "--cgroup" => args.cgroup = Some(PathBuf::from(value()?)),
            "--count" => {
                args.count = value()?.parse().map_err(|e| format!("--count: {e}"))?;
                if args.count == 0 || args.count > 100_000 {
                    return Err("--count must be in 1..=100000".into());
                }
            }
            "--interval-ms" => {
                args.interval = Duration::from_millis(
                    value()?
                        .parse()
                        .map_err(|e| format!("--interval-ms: {e}"))?,
                )
            }
            "--timeout-ms" => {
                args.timeout = Duration::from_millis(
                    value()?.parse().map_err(|e| format!("--timeout-ms: {e}"))?,
                )
            }
            "--new-netns" => args.new_netns = true,
            "--keep-open-ms" => {
                args.keep_open = Some(Duration::from_millis(
                    value()?
                        .parse()
                        .map_err(|e| format!("--keep-open-ms: {e}"))?,
                ))
            }
            "--hold-ms" => {
                args.hold = Some(Duration::from_millis(
                    value()?.parse().map_err(|e| format!("--hold-ms: {e}"))?,
                ))
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if !have_addr {
        return Err("--addr is required".into());
    }
    Ok(args)
}

fn join_cgroup(dir: &std::path::Path) -> Result<(), String> {
    std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
        .map_err(|e| format!("joining cgroup {}: {e}", dir.display()))
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
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("lbclient: {message}");
            return ExitCode::from(2);
        }
    };
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
    for index in 0..args.count {
        if index > 0 && !args.interval.is_zero() {
            std::thread::sleep(args.interval);
        }
        let line = serde_json::to_string(&attempt(args.addr, args.timeout, args.hold, &mut kept))
            .expect("serialise");
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
