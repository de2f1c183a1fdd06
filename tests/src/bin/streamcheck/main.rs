//! A correctness checker for TCP byte streams, for connections whose data
//! socklb's sk_msg/sockmap acceleration moves from socket to socket in the
//! kernel: it compares what arrived with what was sent, and catches lost,
//! duplicated or reordered bytes, lost wakeups, and wrong end-of-file or
//! reset semantics. Everything is bounded: a connection that makes no
//! progress for 20 s fails (it is reported, it does not hang).
//!
//! The server plays its side of each connection; a client connection starts
//! with a 64-byte header (mode, byte counts of both directions, write
//! pattern, seed). Each direction is a deterministic pseudo-random stream
//! (splitmix64, counter based) from the connection's seed, so both ends know
//! the other's bytes, and checks every byte as it arrives; write sizes come
//! from the seed too (`small`: 1 byte to 4 KiB each, `large`: 1 MiB). In
//! the modes that end cleanly the server answers the client's half-close
//! with a 56-byte report (bytes it received, offset of the first wrong one,
//! their SHA-256, bytes it sent) and then half-closes itself, so a wrong,
//! lost or extra byte in either direction fails the client.
//!
//! Modes (`--bytes` defaults in brackets):
//! - `integrity` [256 MiB]: both directions at once (a writer thread and a
//!   reader), then half-closes, the report, EOF.
//! - `half-close` [1 MiB]: client to server only; the server reads to EOF,
//!   then reports and closes; the client must see the report, then EOF.
//! - `reset-by-server` [64 KiB]: the server sends, then closes with
//!   SO_LINGER 0 (RST); the client must see ECONNRESET or EOF within 10 s,
//!   after a correct prefix.
//! - `reset-by-client` [64 KiB]: the client sends, waits for the server's
//!   word that it has every byte (its reader then waits for more), closes
//!   with SO_LINGER 0, then asks the
//!   server on a second connection how its reader ended: it must have seen
//!   ECONNRESET or EOF within 10 s, after a correct prefix.
//! - `killed-server`: both directions stream until the connection ends (the
//!   test kills the server); prints `streaming` once bytes flowed both ways;
//!   the end must come (any error or EOF) within `--seconds` [30], after a
//!   correct prefix.
//! - `peek` [1 MiB]: server to client; the client alternates
//!   recv(MSG_PEEK) of a random size and recv of that size, which must
//!   return the peeked bytes (and more only if more arrived).
//! - `rcvlowat`: SO_RCVLOWAT 1000; the server sends 500 bytes, pauses
//!   300 ms, sends 500: poll(POLLIN) must wait for the second part and the
//!   first read return 1000 bytes; then again with a blocking read.
//! - `pingpong` [100000 messages]: one byte each way per message, both ends
//!   non-blocking with edge-triggered epoll; a wait of 5 s fails ("lost
//!   wakeup" when the echo was readable all along).
//! - `splice` [64 MiB]: server to client; the server writes into a pipe and
//!   splice(2)s it into the socket, the client splices from the socket into
//!   a pipe and reads that.
//! - `many` [64 KiB]: `--connections` [1000] opened at once, then each
//!   transfers both ways as in `integrity`, driven by one epoll loop.
//! - `stream`: `--connections` [100] stream both ways (each side at most
//!   `--rate` bytes per second, if given) until stdin closes or
//!   gives a line `stop`, or `--seconds` [600] pass; prints `streaming` once
//!   every connection has moved bytes both ways; then each half-closes and
//!   is checked as in `integrity`.
//! - `blocking-half-close` [1 KiB]: `--connections` [250] one after
//!   another, each on a plain blocking socket (no timeouts): the request,
//!   shutdown(SHUT_WR), the server's report read to EOF (the server waits
//!   `--answer-delay-ms` [0] before it answers). A blocking read must
//!   never return EAGAIN: each is counted (`connections_with_eagain`,
//!   `eagain_total`, `first_eagain_ms_median`: from the half-close), the
//!   read repeated, and the bytes checked.
//!
//! The server prints `listening` once it listens and serves every
//! connection on its own thread until it is killed. The client prints one
//! JSON object: `mode`, `ok`, `connections`, `failed`, `bytes_sent`,
//! `bytes_received` (stream bytes, without header and report), `errors`
//! (the first 10), `ms`, `seed`, and figures of the mode; it exits 0 when
//! ok, 1 when not, 2 on a usage or cgroup error.
//!
//! `streamcheck server --listen ADDR:PORT`, `streamcheck client --addr
//! ADDR:PORT --mode MODE …` (`--help` lists the flags). Sizes take a k, m
//! or g suffix for KiB, MiB, GiB; for pingpong `--bytes` counts messages.

mod blocking;
mod check;
mod client;
mod exchanges;
mod flows;
mod half_close;
mod pingpong;
mod server;
mod sockets;
mod stream;
mod wire;

use std::{
    io::{self, Write},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use clap::Parser;
use socklb_tests::cli::join_cgroup;

use crate::{
    client::{ClientFlags, run_client},
    server::serve,
};

/// How long a connection may make no progress before it counts as hung.
const IDLE_LIMIT: Duration = Duration::from_secs(20);
/// The timeout of blocking socket calls: their loops check limits this often.
const SLICE: Duration = Duration::from_secs(1);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How soon a reset must be seen (the reset modes).
const RESET_LIMIT: Duration = Duration::from_secs(10);
/// How long the server waits for the outcome a `reset-by-client` query asks.
const QUERY_WAIT: Duration = Duration::from_secs(12);
/// One edge-triggered wait of `pingpong`.
const PINGPONG_WAIT_MS: i32 = 5000;
const RCVLOWAT: usize = 1000;
const LOWAT_PART: usize = 500;
const LOWAT_PAUSE: Duration = Duration::from_millis(300);
/// When `rcvlowat` looks whether the first part alone made the socket readable.
const LOWAT_PROBE_MS: i32 = 150;
/// How long the server waits after the go byte, so the client's blocking
/// read is asleep with nothing queued when the first part comes.
const LOWAT_SETTLE: Duration = Duration::from_millis(100);
/// How soon the blocking read must return once both parts are in.
const LOWAT_WAKE_LIMIT: Duration = Duration::from_secs(2);
const READ_BUFFER: usize = 128 * 1024;
/// What one non-blocking connection may move per turn of the epoll loop.
const TURN_BUDGET: usize = 64 * 1024;
/// The stack of the server's connection threads (their buffers are on the heap).
const THREAD_STACK: usize = 256 * 1024;
const MAX_ERRORS: usize = 10;
const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// Prints one line on stdout at once (a parent waits for it).
fn announce(line: &str) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// A correctness checker for TCP byte streams (see the module
/// documentation).
#[derive(Debug, Parser)]
#[command(name = "streamcheck")]
enum Command {
    /// Listen, and play the server's side of every connection.
    Server {
        /// Where to listen.
        #[arg(long)]
        listen: SocketAddr,
        /// A cgroup v2 directory to join first.
        #[arg(long)]
        cgroup: Option<PathBuf>,
    },
    /// Run one mode against a server; print one JSON summary.
    Client(ClientFlags),
}

/// Joins `cgroup`, if any; exits with status 2 when that fails.
fn join_or_exit(cgroup: Option<&Path>) {
    if let Some(dir) = cgroup
        && let Err(message) = join_cgroup(dir)
    {
        eprintln!("streamcheck: {message}");
        std::process::exit(2);
    }
}

fn client_main(flags: ClientFlags) -> ExitCode {
    join_or_exit(flags.cgroup.as_deref());
    let args = match flags.resolve() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("streamcheck client: {message}");
            return ExitCode::from(2);
        }
    };
    let summary = run_client(&args);
    announce(&serde_json::to_string(&summary).expect("json"));
    if summary.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn main() -> ExitCode {
    match Command::parse() {
        Command::Server { listen, cgroup } => {
            join_or_exit(cgroup.as_deref());
            serve(listen)
        }
        Command::Client(flags) => client_main(flags),
    }
}
