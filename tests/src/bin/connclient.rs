//! Raw connections through a VIP, for the tests of the passive signal.
//!
//! `--abort` plays a hostile local user: it joins the cgroup, drops to
//! uid/gid 65534 with no capabilities, and makes COUNT non-blocking
//! connects with the IP TTL it is given, closing each ABORT_MS later,
//! whether or not it finished. With a TTL the server's namespace drops,
//! each connect sits in SYN_SENT until the client closes it.
//!
//! `--hold` opens COUNT connections at once (a connect that hangs delays
//! no other) and keeps them all open for HOLD_MS, reading; it prints one JSON line per connection saying how it ended:
//! "open" (still open at the end), "eof", or "error" with the errno (an
//! ECONNABORTED is a connection socklb closed). With `--reconnect` it is a
//! well-behaved long-lived client: a connection that ends is opened again
//! at once through the same address (one retry), and the line counts the
//! reconnects.
//!
//! `--nobody` drops to uid 65534 in `--hold` too (`--abort` always does),
//! and `--send TEXT` writes TEXT on each connection once it is open (a
//! client that starts a request and never finishes it). With
//! `--send-every-ms` it writes one byte on each connection that often (a
//! busy client, never idle).

use std::{
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::PathBuf,
    process::ExitCode,
    time::{Duration, Instant},
};

use clap::{ArgGroup, Parser};
use serde::Serialize;
use socklb_tests::cli::{join_cgroup, millis};

/// Raw connections through a VIP: `--abort` (a hostile user's aborted
/// connects) or `--hold` (long-lived connections).
#[derive(Debug, Parser)]
#[command(name = "connclient", group(ArgGroup::new("mode").required(true).args(["abort", "hold"])))]
struct Args {
    /// Make COUNT connects as uid 65534, each closed ABORT_MS later.
    #[arg(long)]
    abort: bool,
    /// Open COUNT connections at once and keep them for HOLD_MS.
    #[arg(long)]
    hold: bool,
    /// Where to connect (a VIP).
    #[arg(long)]
    addr: SocketAddr,
    /// A cgroup v2 directory to join first.
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// Connects (at most 19,000: the open-files limit of one process).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=19_000))]
    count: u32,
    /// The IP TTL of `--abort`'s connects.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=255))]
    ttl: u32,
    /// How long each `--abort` connect lives.
    #[arg(long = "abort-ms", value_name = "MS", default_value = "50", value_parser = millis)]
    abort_after: Duration,
    /// How long `--hold` keeps its connections.
    #[arg(long = "hold-ms", value_name = "MS", default_value = "1000", value_parser = millis)]
    hold_for: Duration,
    /// End the hold early when stdin closes.
    #[arg(long)]
    until_stdin_closes: bool,
    /// Open a connection that ends again, at once (one retry).
    #[arg(long)]
    reconnect: bool,
    /// Run as uid 65534 (always with `--abort`).
    #[arg(long)]
    nobody: bool,
    /// Written on each connection once it is open.
    #[arg(long, value_name = "TEXT")]
    send: Option<String>,
    /// Write a byte on each held connection this often.
    #[arg(long = "send-every-ms", value_name = "MS", value_parser = millis)]
    send_every: Option<Duration>,
}

/// Joins the cgroup, then (for `--abort` and `--nobody`) becomes nobody.
fn enter(args: &Args) -> Result<(), String> {
    if let Some(dir) = &args.cgroup {
        join_cgroup(dir)?;
    }
    if !args.nobody && !args.abort {
        return Ok(());
    }
    // This process is single-threaded here.
    socklb_tests::become_nobody()
}

#[derive(Serialize)]
struct Aborted {
    uid: u32,
    attempts: u32,
    /// Connects still in progress when they were closed.
    in_progress: u32,
}

/// One non-blocking connect with the given TTL, closed after `after`.
fn abort_one(addr: SocketAddr, ttl: u32, after: Duration) -> Result<bool, String> {
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: socket(2); the descriptor is owned at once.
    let raw = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK, 0) };
    if raw < 0 {
        return Err(format!("socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `raw` is a new descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(raw) };
    let (level, option) = if addr.is_ipv4() {
        (libc::IPPROTO_IP, libc::IP_TTL)
    } else {
        (libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS)
    };
    let ttl = ttl as libc::c_int;
    // SAFETY: setsockopt reads one c_int.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            option,
            (&ttl as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let SocketAddr::V4(v4) = addr else {
        return Err("--abort takes an IPv4 VIP".into());
    };
    // SAFETY: sockaddr_in is plain data, filled field by field.
    let mut target: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    target.sin_family = libc::AF_INET as libc::sa_family_t;
    target.sin_port = v4.port().to_be();
    target.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
    // SAFETY: connect(2) with a valid sockaddr_in of its size.
    let result = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            (&target as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    let in_progress =
        result != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINPROGRESS);
    std::thread::sleep(after);
    drop(socket);
    Ok(in_progress)
}

#[derive(Serialize)]
struct Held {
    /// "open", "eof", "error", or "connect-error".
    end: String,
    errno: Option<i32>,
    held_ms: u64,
    /// What getpeername says at the end, for a connection still open.
    peer: Option<String>,
    /// Connections opened again after one ended (with `--reconnect`).
    reconnects: u32,
}

/// One connection of `--hold`, with `--send`'s text written on it.
fn open(args: &Args) -> std::io::Result<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&args.addr, Duration::from_secs(10))?;
    if let Some(text) = &args.send {
        stream.write_all(text.as_bytes())?;
    }
    Ok(stream)
}

/// Threads that connect at once: a connect that hangs delays no other, and
/// thousands of connections open in a few seconds.
const CONNECTING_THREADS: u32 = 32;

fn hold(args: &Args) -> Vec<Held> {
    let per_thread = args.count.div_ceil(CONNECTING_THREADS);
    let mut streams: Vec<Result<TcpStream, std::io::Error>> = std::thread::scope(|scope| {
        let connects: Vec<_> = (0..CONNECTING_THREADS)
            .map(|thread| {
                let count = per_thread.min(args.count.saturating_sub(thread * per_thread));
                scope.spawn(move || (0..count).map(|_| open(args)).collect::<Vec<_>>())
            })
            .collect();
        connects
            .into_iter()
            .flat_map(|connect| connect.join().expect("connect thread"))
            .collect()
    });
    let started = Instant::now();
    let mut ends: Vec<Option<Held>> = streams
        .iter()
        .map(|stream| {
            stream.as_ref().err().map(|error| Held {
                end: "connect-error".into(),
                errno: error.raw_os_error(),
                held_ms: 0,
                peer: None,
                reconnects: 0,
            })
        })
        .collect();
    let mut reconnects = vec![0u32; streams.len()];
    // poll(2) on every open connection until the hold ends: a readable one
    // has data, an end of file, or an error.
    let mut polled: Vec<libc::pollfd> = streams
        .iter()
        .map(|stream| libc::pollfd {
            fd: stream.as_ref().map_or(-1, |stream| stream.as_raw_fd()),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let released = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if args.until_stdin_closes {
        let released = std::sync::Arc::clone(&released);
        std::thread::spawn(move || {
            let mut sink = [0u8; 64];
            while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
            released.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    }
    let mut last_send = Instant::now();
    while started.elapsed() < args.hold_for && !released.load(std::sync::atomic::Ordering::SeqCst) {
        if let Some(every) = args.send_every
            && last_send.elapsed() >= every
        {
            last_send = Instant::now();
            for stream in streams.iter().flatten() {
                let mut stream = stream;
                let _ = stream.write(b".");
            }
        }
        let left = args
            .hold_for
            .saturating_sub(started.elapsed())
            .as_millis()
            .min(200)
            .min(args.send_every.map_or(200, |every| every.as_millis())) as i32;
        // SAFETY: poll(2) on an array of pollfd we own.
        let ready = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, left) };
        if ready <= 0 {
            continue;
        }
        let held_ms = started.elapsed().as_millis() as u64;
        for (index, ((entry, stream), end)) in polled
            .iter_mut()
            .zip(streams.iter_mut())
            .zip(ends.iter_mut())
            .enumerate()
        {
            if entry.revents == 0 || entry.fd < 0 {
                continue;
            }
            let Ok(mut current) = stream.as_ref() else {
                continue;
            };
            let _ = current.set_nonblocking(true);
            let mut buffer = [0u8; 256];
            *end = match current.read(&mut buffer) {
                Ok(0) => Some(Held {
                    end: "eof".into(),
                    errno: None,
                    held_ms,
                    peer: None,
                    reconnects: 0,
                }),
                Ok(_) => None,
                Err(error) if error.kind() == ErrorKind::WouldBlock => None,
                Err(error) => Some(Held {
                    end: "error".into(),
                    errno: error.raw_os_error(),
                    held_ms,
                    peer: None,
                    reconnects: 0,
                }),
            };
            if end.is_some() && args.reconnect {
                // A well-behaved client: open it again, retrying once.
                let again = open(args).or_else(|_| open(args));
                if let Ok(again) = again {
                    entry.fd = again.as_raw_fd();
                    *stream = Ok(again);
                    reconnects[index] += 1;
                    *end = None;
                }
            }
            if end.is_some() {
                entry.fd = -1;
            }
            entry.revents = 0;
        }
    }
    let held_ms = started.elapsed().as_millis() as u64;
    ends.into_iter()
        .zip(&streams)
        .zip(reconnects)
        .map(|((end, stream), reconnects)| {
            let end = end.map(|end| Held { reconnects, ..end });
            end.unwrap_or_else(|| Held {
                reconnects,
                end: "open".into(),
                errno: None,
                held_ms,
                peer: stream
                    .as_ref()
                    .ok()
                    .and_then(|stream| stream.peer_addr().ok())
                    .map(|peer| peer.to_string()),
            })
        })
        .collect()
}

fn main() -> ExitCode {
    let args = Args::parse();
    socklb_tests::raise_open_files();
    if let Err(message) = enter(&args) {
        eprintln!("connclient: {message}");
        return ExitCode::from(2);
    }
    let mut out = std::io::stdout().lock();
    if args.abort {
        let mut in_progress = 0;
        for _ in 0..args.count {
            match abort_one(args.addr, args.ttl, args.abort_after) {
                Ok(true) => in_progress += 1,
                Ok(false) => {}
                Err(message) => {
                    eprintln!("connclient: {message}");
                    return ExitCode::from(1);
                }
            }
        }
        let summary = Aborted {
            // SAFETY: geteuid has no preconditions.
            uid: unsafe { libc::geteuid() },
            attempts: args.count,
            in_progress,
        };
        let _ = writeln!(out, "{}", serde_json::to_string(&summary).expect("json"));
        return ExitCode::SUCCESS;
    }
    for held in hold(&args) {
        let _ = writeln!(out, "{}", serde_json::to_string(&held).expect("json"));
    }
    ExitCode::SUCCESS
}
