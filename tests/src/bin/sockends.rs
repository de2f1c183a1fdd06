//! Connections that end every way a TCP socket can end, for the tests of
//! socklb's socket table: each must leave no record and no live count.
//!
//! `sockends serve --listen IP:PORT --behaviour B` is a backend:
//! - `close`: accepts and closes at once (the server's FIN comes first);
//! - `reset`: accepts and resets (SO_LINGER 0);
//! - `hold`: accepts and keeps each connection until the client ends it;
//! - `silent`: listens with a full accept queue: SYNs go unanswered.
//!
//! It prints its address, then serves until its stdin closes.
//!
//! `sockends connect --addr VIP --cgroup DIR --mode M [--count N]` joins
//! the cgroup (and with `--nobody` becomes uid 65534) and makes N
//! connections that end as M says:
//! - `close`: reads to the server's EOF, then closes;
//! - `linger0`: closes with SO_LINGER 0 (the client resets);
//! - `syn-close`: closes a connect still in SYN_SENT after `--wait-ms`;
//! - `refused`: the connect is refused (nothing listens);
//! - `reset`: reads until the server's reset;
//! - `unreachable`: in a new network namespace whose loopback is down, the
//!   connect fails before any SYN; the socket stays open `--wait-ms`;
//! - `hold`: keeps every connection open until killed, or until stdin
//!   closes (then closes them all);
//! - `getpeername`: asks getpeername once (as Go's net package does after
//!   each connect), then closes with SO_LINGER 0;
//! - `vip-peer`: the same, and the connection counts as failed
//!   (EDESTADDRREQ) unless getpeername showed the address it connected to.
//!
//! It prints one JSON line: `{"mode", "made", "failed", "errnos"}`, and for
//! `hold` a line `{"held": N}` first, once all are open.

use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::PathBuf,
    process::ExitCode,
    time::{Duration, Instant},
};

use serde::Serialize;

/// Connections per process at most (the open-files limit is 20,000).
const MAX_PER_PROCESS: u32 = 19_000;
/// A bound on every run.
const MAX_RUN: Duration = Duration::from_secs(900);

struct Args {
    serve: bool,
    addr: SocketAddr,
    behaviour: String,
    cgroup: Option<PathBuf>,
    count: u32,
    wait: Duration,
    nobody: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut words = std::env::args().skip(1);
    let serve = match words.next().as_deref() {
        Some("serve") => true,
        Some("connect") => false,
        other => return Err(format!("expected serve or connect, got {other:?}")),
    };
    let mut args = Args {
        serve,
        addr: "127.0.0.1:1".parse().expect("literal"),
        behaviour: String::new(),
        cgroup: None,
        count: 1,
        wait: Duration::from_millis(50),
        nobody: false,
    };
    while let Some(flag) = words.next() {
        let mut value = || words.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" | "--addr" => {
                args.addr = value()?.parse().map_err(|e| format!("{flag}: {e}"))?
            }
            "--behaviour" | "--mode" => args.behaviour = value()?,
            "--cgroup" => args.cgroup = Some(PathBuf::from(value()?)),
            "--count" => {
                let count: u32 = value()?.parse().map_err(|e| format!("--count: {e}"))?;
                args.count = count.clamp(1, 2_000_000);
            }
            "--wait-ms" => {
                let ms: u64 = value()?.parse().map_err(|e| format!("--wait-ms: {e}"))?;
                args.wait = Duration::from_millis(ms.min(60_000));
            }
            "--nobody" => args.nobody = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    let outcome = parse_args().and_then(|args| {
        if args.serve {
            serve(&args)
        } else {
            connect(&args)
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("sockends: {message}");
            ExitCode::from(2)
        }
    }
}

/// Sets SO_LINGER to 0: the close resets the connection.
fn linger_zero(fd: i32) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads a linger struct we own.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            size_of::<libc::linger>() as u32,
        )
    };
}

/// Whether stdin has closed (the parent's way of ending a run).
fn stdin_closed() -> std::sync::mpsc::Receiver<()> {
    let (closed_tx, closed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = [0u8; 64];
        while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
        let _ = closed_tx.send(());
    });
    closed
}

fn serve(args: &Args) -> Result<(), String> {
    socklb_tests::raise_open_files();
    let listener =
        TcpListener::bind(args.addr).map_err(|e| format!("listening on {}: {e}", args.addr))?;
    // A silent server's queue holds one connection, which the parent
    // makes; after it every SYN is dropped. The others take bursts.
    let backlog = if args.behaviour == "silent" {
        0
    } else {
        65_535
    };
    // SAFETY: listen(2) on the listener's own descriptor.
    unsafe { libc::listen(listener.as_raw_fd(), backlog) };
    println!("{}", listener.local_addr().map_err(|e| e.to_string())?);
    let _ = std::io::stdout().flush();
    let closed = stdin_closed();
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut held: Vec<TcpStream> = Vec::new();
    while started.elapsed() < MAX_RUN && closed.try_recv().is_err() {
        let mut accepted = 0;
        while args.behaviour != "silent"
            && let Ok((stream, _)) = listener.accept()
        {
            accepted += 1;
            match args.behaviour.as_str() {
                "reset" => linger_zero(stream.as_raw_fd()),
                "hold" => {
                    let _ = stream.set_nonblocking(true);
                    held.push(stream);
                    continue;
                }
                _ => {}
            }
        }
        // Held connections the client ended are closed in turn.
        held.retain(|mut stream| {
            let mut byte = [0u8; 512];
            match stream.read(&mut byte) {
                Ok(0) => false,
                Ok(_) => true,
                Err(error) => error.kind() == ErrorKind::WouldBlock,
            }
        });
        if accepted == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(())
}

#[derive(Serialize, Default)]
struct Report {
    mode: String,
    made: u64,
    failed: u64,
    /// errno → connects that failed with it.
    errnos: BTreeMap<i32, u64>,
}

fn connect(args: &Args) -> Result<(), String> {
    socklb_tests::raise_open_files();
    if let Some(dir) = &args.cgroup {
        socklb_tests::join_cgroup(dir)?;
    }
    if args.behaviour == "unreachable" {
        // A new namespace's loopback is down: a connect to 127/8 fails at
        // its route lookup, after the connect hook ran.
        // SAFETY: unshare affects only this single-threaded process.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(format!("unshare: {}", std::io::Error::last_os_error()));
        }
    }
    if args.nobody {
        socklb_tests::become_nobody()?;
    }
    let mut report = Report {
        mode: args.behaviour.clone(),
        ..Report::default()
    };
    if args.behaviour == "hold" {
        return hold(args, &mut report);
    }
    let started = Instant::now();
    for _ in 0..args.count {
        if started.elapsed() > MAX_RUN {
            break;
        }
        match one(args) {
            Ok(()) => report.made += 1,
            Err(errno) => {
                report.failed += 1;
                *report.errnos.entry(errno).or_default() += 1;
            }
        }
    }
    print_report(&report)
}

fn print_report(report: &Report) -> Result<(), String> {
    println!(
        "{}",
        serde_json::to_string(report).map_err(|e| e.to_string())?
    );
    Ok(())
}

fn errno_of(error: &std::io::Error) -> i32 {
    error.raw_os_error().unwrap_or(-1)
}

/// One connection that ends as the mode says. Err: the errno of a connect
/// or read that failed where the mode expects success (or the reverse).
fn one(args: &Args) -> Result<(), i32> {
    match args.behaviour.as_str() {
        "syn-close" => return syn_close(args.addr, args.wait),
        "unreachable" => {
            return match TcpStream::connect(args.addr) {
                Ok(_) => Err(0),
                Err(error) => {
                    // The failed socket stays open a while, then closes.
                    std::thread::sleep(args.wait);
                    (errno_of(&error) == libc::ENETUNREACH)
                        .then_some(())
                        .ok_or(errno_of(&error))
                }
            };
        }
        "refused" => {
            return match TcpStream::connect(args.addr) {
                Ok(_) => Err(0),
                Err(error) if errno_of(&error) == libc::ECONNREFUSED => Ok(()),
                Err(error) => Err(errno_of(&error)),
            };
        }
        _ => {}
    }
    let mut stream = TcpStream::connect(args.addr).map_err(|error| errno_of(&error))?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    match args.behaviour.as_str() {
        "linger0" => {
            linger_zero(stream.as_raw_fd());
            Ok(())
        }
        "getpeername" | "vip-peer" => {
            let peer = stream.peer_addr().map_err(|error| errno_of(&error))?;
            linger_zero(stream.as_raw_fd());
            if args.behaviour == "vip-peer" && peer != args.addr {
                return Err(libc::EDESTADDRREQ);
            }
            Ok(())
        }
        "reset" => match stream.read_to_end(&mut Vec::new()) {
            Err(error) if errno_of(&error) == libc::ECONNRESET => Ok(()),
            Ok(_) => Ok(()),
            Err(error) => Err(errno_of(&error)),
        },
        _ => stream
            .read_to_end(&mut Vec::new())
            .map(drop)
            .map_err(|error| errno_of(&error)),
    }
}

/// A non-blocking connect, closed while still in SYN_SENT.
fn syn_close(addr: SocketAddr, wait: Duration) -> Result<(), i32> {
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: socket(2); the descriptor is owned at once.
    let raw = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0) };
    if raw < 0 {
        return Err(errno_of(&std::io::Error::last_os_error()));
    }
    // SAFETY: a new descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(raw) };
    let std::net::SocketAddr::V4(v4) = addr else {
        return Err(libc::EAFNOSUPPORT);
    };
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: v4.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*v4.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: connect(2) reads a sockaddr_in we own.
    let result = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            (&raw const sin).cast(),
            size_of::<libc::sockaddr_in>() as u32,
        )
    };
    let error = std::io::Error::last_os_error();
    if result == 0 || errno_of(&error) != libc::EINPROGRESS {
        return Err(if result == 0 { 0 } else { errno_of(&error) });
    }
    std::thread::sleep(wait);
    drop(socket);
    Ok(())
}

/// Opens `count` connections and keeps them until killed, or until stdin
/// closes.
fn hold(args: &Args, report: &mut Report) -> Result<(), String> {
    let closed = stdin_closed();
    let mut held = Vec::new();
    for _ in 0..args.count.min(MAX_PER_PROCESS) {
        match TcpStream::connect(args.addr) {
            Ok(stream) => held.push(stream),
            Err(error) => {
                report.failed += 1;
                *report.errnos.entry(errno_of(&error)).or_default() += 1;
            }
        }
    }
    report.made = held.len() as u64;
    println!("{{\"held\": {}}}", held.len());
    let _ = std::io::stdout().flush();
    let _ = closed.recv_timeout(MAX_RUN);
    drop(held);
    print_report(report)
}
