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
//!
//! The server prints `listening` once it listens and serves every
//! connection on its own thread until it is killed. The client prints one
//! JSON object: `mode`, `ok`, `connections`, `failed`, `bytes_sent`,
//! `bytes_received` (stream bytes, without header and report), `errors`
//! (the first 10), `ms`, `seed`, and figures of the mode; it exits 0 when
//! ok, 1 when not, 2 on a usage or cgroup error.
//!
//! Usage: streamcheck server --listen ADDR:PORT [--cgroup DIR]
//!        streamcheck client --addr ADDR:PORT --mode MODE [--bytes N]
//!                    [--writes small|large] [--connections K]
//!                    [--seconds S] [--seed S] [--cgroup DIR]
//! (N takes a k, m or g suffix for KiB, MiB, GiB; for pingpong it counts
//! messages.)

use std::{
    collections::{BTreeMap, VecDeque},
    fs::File,
    io::{self, ErrorKind, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::{Path, PathBuf},
    process::ExitCode,
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant, SystemTime},
};

use ring::digest::{Context, SHA256};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

const HEADER_LEN: usize = 64;
const REPORT_LEN: usize = 56;
const MAGIC: [u8; 4] = *b"SCK1";
/// The byte count of a direction that streams until it is stopped.
const UNBOUNDED: u64 = u64::MAX;
/// The report's offset when no byte was wrong.
const NO_MISMATCH: u64 = u64::MAX;
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
const SMALL_WRITE_MAX: u64 = 4096;
const LARGE_WRITE: u64 = 1 << 20;
const READ_BUFFER: usize = 128 * 1024;
/// What one non-blocking connection may move per turn of the epoll loop.
const TURN_BUDGET: usize = 64 * 1024;
/// The stack of the server's connection threads (their buffers are on the heap).
const THREAD_STACK: usize = 256 * 1024;
const MAX_ERRORS: usize = 10;
const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

// ---------------------------------------------------------------------------
// The streams: deterministic bytes and write sizes from a seed.

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's output function.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Word `index` of the sequence with this seed: splitmix64 is counter based,
/// so any part of a stream can be made without the parts before it.
fn word(seed: u64, index: u64) -> u64 {
    mix(seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GAMMA)))
}

/// Bytes `position..position + out.len()` of the stream with this seed:
/// word `index` is bytes `8 * index..8 * index + 8`, little-endian.
fn fill_stream(seed: u64, position: u64, out: &mut [u8]) {
    // Whole blocks of words, then copied out: several times faster than
    // word by word in a debug build, which is what the tests run.
    let mut words = [0u64; 512];
    let mut done = 0;
    while done < out.len() {
        let at = position + done as u64;
        let skip = (at % 8) as usize;
        let take = (8 * words.len() - skip).min(out.len() - done);
        let count = (skip + take).div_ceil(8);
        fill_words(seed, at / 8, &mut words[..count]);
        out[done..done + take].copy_from_slice(&as_bytes(&words)[skip..skip + take]);
        done += take;
    }
}

/// Words `first..first + words.len()` of the sequence with this seed, each
/// stored little-endian.
fn fill_words(seed: u64, first: u64, words: &mut [u64]) {
    let mut counter = seed.wrapping_add(first.wrapping_mul(GAMMA));
    for slot in words {
        counter = counter.wrapping_add(GAMMA);
        *slot = mix(counter).to_le();
    }
}

fn as_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding and u8 no alignment; the bytes live as
    // long as the words.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// A connection's two streams.
#[derive(Clone, Copy)]
enum Direction {
    /// Client to server.
    Up,
    /// Server to client.
    Down,
}

impl Direction {
    /// The seed of this direction's bytes.
    fn seed(self, seed: u64) -> u64 {
        match self {
            Direction::Up => mix(seed ^ 0x7570_7570),
            Direction::Down => mix(seed ^ 0x646f_776e),
        }
    }

    /// The seed of this direction's write sizes.
    fn sizes_seed(self, seed: u64) -> u64 {
        mix(self.seed(seed) ^ 0x7369_7a65)
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Writes {
    /// 1 byte to 4 KiB, random per write.
    Small,
    /// 1 MiB per write.
    Large,
}

impl Writes {
    fn parse(text: &str) -> Result<Self, String> {
        match text {
            "small" => Ok(Writes::Small),
            "large" => Ok(Writes::Large),
            other => Err(format!("--writes: {other} is neither small nor large")),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Writes::Small => "small",
            Writes::Large => "large",
        }
    }

    /// The size of write `index` of a stream whose sizes come from `seed`.
    fn size(self, seed: u64, index: u64) -> u64 {
        match self {
            Writes::Small => 1 + word(seed, index) % SMALL_WRITE_MAX,
            Writes::Large => LARGE_WRITE,
        }
    }
}

/// The seed of connection `index` of a run.
fn connection_seed(seed: u64, index: u64) -> u64 {
    word(seed, index)
}

// ---------------------------------------------------------------------------
// The wire: the client's header and the server's report.

/// What the server plays on a connection.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Role {
    /// Both streams (either may be empty or unbounded), then the report.
    Duplex = 1,
    ResetByServer = 2,
    /// The first connection of `reset-by-client`.
    ResetVictim = 3,
    /// The second: how did the first one's reader end?
    ResetQuery = 4,
    Rcvlowat = 5,
    Pingpong = 6,
}

impl Role {
    fn from_code(code: u8) -> Option<Self> {
        [
            Role::Duplex,
            Role::ResetByServer,
            Role::ResetVictim,
            Role::ResetQuery,
            Role::Rcvlowat,
            Role::Pingpong,
        ]
        .into_iter()
        .find(|role| *role as u8 == code)
    }
}

#[derive(Clone, Copy, Debug)]
struct Header {
    role: Role,
    writes: Writes,
    /// The server sends with splice(2).
    splice: bool,
    /// Bytes client to server (UNBOUNDED: until stopped).
    up: u64,
    /// Bytes server to client.
    down: u64,
    seed: u64,
    /// Names the first connection of `reset-by-client`.
    token: u64,
    /// Bytes per second each side sends at most (0: as fast as it can).
    rate: u64,
}

impl Header {
    fn new(role: Role, seed: u64) -> Self {
        Header {
            role,
            writes: Writes::Small,
            splice: false,
            up: 0,
            down: 0,
            seed,
            token: 0,
            rate: 0,
        }
    }

    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut bytes = [0u8; HEADER_LEN];
        bytes[..4].copy_from_slice(&MAGIC);
        bytes[4] = self.role as u8;
        bytes[5] = (self.writes == Writes::Large) as u8;
        bytes[6] = self.splice as u8;
        let fields = [self.up, self.down, self.seed, self.token, self.rate];
        for (slot, value) in fields.iter().enumerate() {
            bytes[8 + slot * 8..16 + slot * 8].copy_from_slice(&value.to_be_bytes());
        }
        bytes
    }

    fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Self, String> {
        if bytes[..4] != MAGIC {
            return Err(format!("not a streamcheck header: {:02x?}", &bytes[..8]));
        }
        Ok(Header {
            role: Role::from_code(bytes[4]).ok_or(format!("unknown role {}", bytes[4]))?,
            writes: if bytes[5] == 1 {
                Writes::Large
            } else {
                Writes::Small
            },
            splice: bytes[6] == 1,
            up: be_u64(bytes, 8),
            down: be_u64(bytes, 16),
            seed: be_u64(bytes, 24),
            token: be_u64(bytes, 32),
            rate: be_u64(bytes, 40),
        })
    }
}

fn be_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// The server's account of a connection, sent after the client's EOF.
struct Report {
    /// Bytes it received.
    received: u64,
    /// The offset of the first wrong byte, or NO_MISMATCH.
    mismatch: u64,
    /// Bytes it sent before the report.
    sent: u64,
    /// SHA-256 of what it received.
    digest: [u8; 32],
}

impl Report {
    fn encode(&self) -> [u8; REPORT_LEN] {
        let mut bytes = [0u8; REPORT_LEN];
        bytes[..8].copy_from_slice(&self.received.to_be_bytes());
        bytes[8..16].copy_from_slice(&self.mismatch.to_be_bytes());
        bytes[16..24].copy_from_slice(&self.sent.to_be_bytes());
        bytes[24..].copy_from_slice(&self.digest);
        bytes
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        (bytes.len() == REPORT_LEN).then(|| Report {
            received: be_u64(bytes, 0),
            mismatch: be_u64(bytes, 8),
            sent: be_u64(bytes, 16),
            digest: bytes[24..].try_into().expect("32 bytes"),
        })
    }
}

fn finish_digest(context: Context) -> [u8; 32] {
    context
        .finish()
        .as_ref()
        .try_into()
        .expect("SHA-256 is 32 bytes")
}

// ---------------------------------------------------------------------------
// Sending and checking a stream.

/// One direction's sending side: the stream cut into writes, and the
/// SHA-256 of what went out.
struct Sender {
    seed: u64,
    sizes_seed: u64,
    writes: Writes,
    limit: u64,
    /// Bytes the socket took.
    sent: u64,
    /// Writes begun.
    started: u64,
    /// The current write and how much of it the socket took.
    chunk: Vec<u8>,
    offset: usize,
    hash: Context,
    /// Bytes per second at most (0: no pacing), from when it first sent.
    rate: u64,
    begun: Option<Instant>,
}

impl Sender {
    fn new(seed: u64, direction: Direction, writes: Writes, limit: u64) -> Self {
        Sender {
            seed: direction.seed(seed),
            sizes_seed: direction.sizes_seed(seed),
            writes,
            limit,
            sent: 0,
            started: 0,
            chunk: Vec::new(),
            offset: 0,
            hash: Context::new(&SHA256),
            rate: 0,
            begun: None,
        }
    }

    fn paced(mut self, rate: u64) -> Self {
        self.rate = rate;
        self
    }

    /// How long to wait before the next write to keep to the rate, if it
    /// is ahead of it.
    fn ahead(&mut self) -> Option<Duration> {
        if self.rate == 0 {
            return None;
        }
        let begun = *self.begun.get_or_insert_with(Instant::now);
        let allowed = (begun.elapsed().as_secs_f64() * self.rate as f64) as u64;
        (self.sent > allowed).then(|| {
            Duration::from_secs_f64((self.sent - allowed) as f64 / self.rate as f64)
                .max(Duration::from_millis(1))
        })
    }

    /// The rest of the current write (a new one once it is all sent);
    /// empty at the limit.
    fn pending(&mut self) -> &[u8] {
        if self.offset == self.chunk.len() {
            let left = self.limit - self.sent;
            if left == 0 {
                return &[];
            }
            let size = self.writes.size(self.sizes_seed, self.started).min(left);
            self.started += 1;
            self.chunk.resize(size as usize, 0);
            fill_stream(self.seed, self.sent, &mut self.chunk);
            self.offset = 0;
        }
        &self.chunk[self.offset..]
    }

    /// The socket took the next `count` bytes of `pending()`.
    fn advance(&mut self, count: usize) {
        self.hash
            .update(&self.chunk[self.offset..self.offset + count]);
        self.offset += count;
        self.sent += count as u64;
    }

    fn done(&self) -> bool {
        self.sent >= self.limit
    }

    fn account(&self, error: Option<String>) -> Sent {
        Sent {
            bytes: self.sent,
            digest: finish_digest(self.hash.clone()),
            error,
        }
    }
}

/// What one side sent, for checking the other side's report.
struct Sent {
    bytes: u64,
    digest: [u8; 32],
    error: Option<String>,
}

/// Checks a received stream against the expected one, byte by byte, and
/// hashes it.
struct Verifier {
    seed: u64,
    limit: u64,
    count: u64,
    mismatch: Option<u64>,
    hash: Context,
}

impl Verifier {
    fn new(seed: u64, direction: Direction, limit: u64) -> Self {
        Verifier {
            seed: direction.seed(seed),
            limit,
            count: 0,
            mismatch: None,
            hash: Context::new(&SHA256),
        }
    }

    fn feed(&mut self, data: &[u8]) {
        self.hash.update(data);
        if self.mismatch.is_none() {
            self.mismatch = self.first_mismatch(data);
        }
        self.count += data.len() as u64;
    }

    /// The stream offset of the first byte of `data` (arriving at
    /// `self.count`) that differs from the expected stream.
    fn first_mismatch(&self, data: &[u8]) -> Option<u64> {
        let mut expected = [0u8; 4096];
        let mut at = self.count;
        for chunk in data.chunks(expected.len()) {
            let expected = &mut expected[..chunk.len()];
            fill_stream(self.seed, at, expected);
            if chunk != expected {
                let offset = chunk.iter().zip(expected.iter()).position(|(a, b)| a != b);
                return Some(at + offset.unwrap_or(0) as u64);
            }
            at += chunk.len() as u64;
        }
        None
    }

    /// What is wrong with what arrived so far as the start of the stream.
    fn prefix_problem(&self, whose: &str) -> Option<String> {
        if let Some(at) = self.mismatch {
            return Some(format!(
                "{whose}: wrong byte at offset {at} (of {} received)",
                self.count
            ));
        }
        (self.count > self.limit).then(|| {
            format!(
                "{whose}: {} bytes received, more than the {} sent",
                self.count, self.limit
            )
        })
    }

    fn digest(&self) -> [u8; 32] {
        finish_digest(self.hash.clone())
    }

    fn report(&self, sent: u64) -> Report {
        Report {
            received: self.count,
            mismatch: self.mismatch.unwrap_or(NO_MISMATCH),
            sent,
            digest: self.digest(),
        }
    }
}

/// A verifier that holds back the last REPORT_LEN bytes of a stream that a
/// report ends.
struct Receiver {
    verifier: Verifier,
    holds_report: bool,
    held: Vec<u8>,
    /// Every byte received, report included.
    raw: u64,
}

impl Receiver {
    fn new(verifier: Verifier, holds_report: bool) -> Self {
        Receiver {
            verifier,
            holds_report,
            held: Vec::with_capacity(REPORT_LEN),
            raw: 0,
        }
    }

    fn take(&mut self, data: &[u8]) {
        self.raw += data.len() as u64;
        if !self.holds_report {
            self.verifier.feed(data);
            return;
        }
        let release = (self.held.len() + data.len()).saturating_sub(REPORT_LEN);
        let from_held = release.min(self.held.len());
        self.verifier.feed(&self.held[..from_held]);
        let from_data = release - from_held;
        self.verifier.feed(&data[..from_data]);
        self.held.drain(..from_held);
        self.held.extend_from_slice(&data[from_data..]);
    }

    /// The report that ended the stream, if it came whole.
    fn report(&self) -> Option<Report> {
        Report::decode(&self.held)
    }
}

/// How a reading loop ended.
#[derive(Clone, Debug)]
enum Ending {
    Eof,
    /// ECONNRESET.
    Reset,
    Error(String),
    /// No progress for IDLE_LIMIT.
    Stalled(String),
    /// The run's time was up.
    Deadline,
}

impl Ending {
    fn from_error(error: &io::Error) -> Self {
        if error.raw_os_error() == Some(libc::ECONNRESET) {
            Ending::Reset
        } else {
            Ending::Error(error.to_string())
        }
    }

    fn name(&self) -> String {
        match self {
            Ending::Eof => "eof".into(),
            Ending::Reset => "reset".into(),
            Ending::Error(error) => format!("error: {error}"),
            Ending::Stalled(what) => format!("stalled: {what}"),
            Ending::Deadline => "deadline".into(),
        }
    }

    /// The connection ended (rather than hung or ran out of time).
    fn ended(&self) -> bool {
        matches!(self, Ending::Eof | Ending::Reset | Ending::Error(_))
    }
}

/// What is wrong with a connection that should have ended with the server's
/// report and EOF, after `down_limit` bytes from the server.
fn reported_problems(
    sent: &Sent,
    receiver: &Receiver,
    ending: &Ending,
    down_limit: u64,
) -> Vec<String> {
    let mut problems = Vec::new();
    let verifier = &receiver.verifier;
    if !matches!(ending, Ending::Eof) {
        problems.push(format!(
            "the connection ended ({}) after {} bytes instead of with the server's report and EOF",
            ending.name(),
            receiver.raw
        ));
    }
    if let Some(error) = &sent.error {
        problems.push(format!("sending: {error}"));
    }
    problems.extend(verifier.prefix_problem("server to client"));
    if !matches!(ending, Ending::Eof) {
        return problems;
    }
    let Some(report) = receiver.report() else {
        problems.push(format!(
            "EOF came without the server's report ({} bytes in all)",
            receiver.raw
        ));
        return problems;
    };
    if verifier.count != report.sent {
        problems.push(format!(
            "received {} bytes of the {} the server sent",
            verifier.count, report.sent
        ));
    }
    if down_limit != UNBOUNDED && report.sent != down_limit {
        problems.push(format!(
            "the server sent {} bytes, not {down_limit}",
            report.sent
        ));
    }
    if report.received != sent.bytes {
        problems.push(format!(
            "the server received {} bytes of the {} sent",
            report.received, sent.bytes
        ));
    }
    if report.mismatch != NO_MISMATCH {
        problems.push(format!(
            "client to server: the server saw a wrong byte at offset {}",
            report.mismatch
        ));
    }
    if report.digest != sent.digest {
        problems.push("client to server: the server's SHA-256 differs from the one sent".into());
    }
    problems
}

// ---------------------------------------------------------------------------
// Socket helpers.

fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

fn check_size(result: isize) -> io::Result<usize> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result as usize)
    }
}

fn set_option(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: setsockopt reads one c_int.
    check(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// SO_LINGER {on, 0}: closing the socket then resets the connection.
fn set_linger_zero(stream: &TcpStream) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads one struct linger.
    check(unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// Bytes waiting in the socket's receive queue (FIONREAD).
fn bytes_waiting(stream: &TcpStream) -> io::Result<usize> {
    let mut count: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int.
    check(unsafe { libc::ioctl(stream.as_raw_fd(), libc::FIONREAD, &mut count) })?;
    Ok(count as usize)
}

/// poll(2) on one descriptor; the events it reports (0 on timeout).
fn poll_one(fd: RawFd, events: libc::c_short, timeout_ms: i32) -> io::Result<libc::c_short> {
    let mut entry = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    loop {
        // SAFETY: poll(2) on one pollfd we own.
        match check(unsafe { libc::poll(&mut entry, 1, timeout_ms) }) {
            Ok(_) => return Ok(entry.revents),
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
}

/// recv(2) with flags.
fn recv(stream: &TcpStream, buffer: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: recv(2) into a buffer of the length it is given.
    check_size(unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            flags,
        )
    })
}

fn is_timeout(error: &io::Error) -> bool {
    matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Blocking calls on the socket return every SLICE, so loops can check
/// their limits.
fn prepare_blocking(stream: &TcpStream) -> Result<(), String> {
    stream
        .set_read_timeout(Some(SLICE))
        .and_then(|()| stream.set_write_timeout(Some(SLICE)))
        .map_err(|error| format!("socket timeouts: {error}"))
}

fn connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|error| format!("connect to {addr}: {error}"))?;
    prepare_blocking(&stream)?;
    Ok(stream)
}

/// Writes all of `data` to a blocking socket, with at most IDLE_LIMIT
/// without progress.
fn write_all_patiently(mut stream: &TcpStream, mut data: &[u8]) -> Result<(), String> {
    let mut progress = Instant::now();
    while !data.is_empty() {
        match stream.write(data) {
            Ok(0) => return Err("write returned 0".into()),
            Ok(count) => {
                data = &data[count..];
                progress = Instant::now();
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if is_timeout(&error) && progress.elapsed() < IDLE_LIMIT => {}
            Err(error) => return Err(format!("write: {error}")),
        }
    }
    Ok(())
}

/// Reads all of `buffer` from a blocking socket, with at most IDLE_LIMIT
/// without progress.
fn read_exact_patiently(mut stream: &TcpStream, buffer: &mut [u8]) -> Result<(), String> {
    let mut filled = 0;
    let mut progress = Instant::now();
    while filled < buffer.len() {
        match stream.read(&mut buffer[filled..]) {
            Ok(0) => return Err(format!("EOF after {filled} of {} bytes", buffer.len())),
            Ok(count) => {
                filled += count;
                progress = Instant::now();
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if is_timeout(&error) && progress.elapsed() < IDLE_LIMIT => {}
            Err(error) => return Err(format!("read: {error}")),
        }
    }
    Ok(())
}

/// Reads a blocking socket to EOF, with at most IDLE_LIMIT without progress.
fn read_to_end_patiently(mut stream: &TcpStream) -> Result<Vec<u8>, String> {
    let mut all = Vec::new();
    let mut buffer = [0u8; 4096];
    let mut progress = Instant::now();
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return Ok(all),
            Ok(count) => {
                all.extend_from_slice(&buffer[..count]);
                progress = Instant::now();
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if is_timeout(&error) && progress.elapsed() < IDLE_LIMIT => {}
            Err(error) => return Err(format!("read after {} bytes: {error}", all.len())),
        }
    }
}

/// Writes all of `data` to a non-blocking socket, waiting with poll(2)
/// while it is full.
fn write_all_polling(mut stream: &TcpStream, mut data: &[u8]) -> Result<(), String> {
    while !data.is_empty() {
        match stream.write(data) {
            Ok(count) => data = &data[count..],
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if error.kind() == ErrorKind::WouldBlock => {
                let ready = poll_one(
                    stream.as_raw_fd(),
                    libc::POLLOUT,
                    IDLE_LIMIT.as_millis() as i32,
                )
                .map_err(|error| format!("poll: {error}"))?;
                if ready == 0 {
                    return Err(format!(
                        "the socket stayed full for {} s",
                        IDLE_LIMIT.as_secs()
                    ));
                }
            }
            Err(error) => return Err(format!("write: {error}")),
        }
    }
    Ok(())
}

/// An epoll instance.
struct Epoll(OwnedFd);

impl Epoll {
    fn new() -> io::Result<Self> {
        // SAFETY: epoll_create1(2); the descriptor is owned at once.
        let fd = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `fd` is a new descriptor nothing else owns.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn add(&self, fd: RawFd, events: libc::c_int, token: u64) -> io::Result<()> {
        let mut event = libc::epoll_event {
            events: events as u32,
            u64: token,
        };
        // SAFETY: epoll_ctl(2) reads one epoll_event.
        check(unsafe { libc::epoll_ctl(self.0.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) })
            .map(drop)
    }

    /// Waits up to `timeout_ms` for events; how many came.
    fn wait(&self, events: &mut [libc::epoll_event], timeout_ms: i32) -> io::Result<usize> {
        loop {
            // SAFETY: epoll_wait(2) fills at most `events.len()` entries.
            let ready = unsafe {
                libc::epoll_wait(
                    self.0.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as libc::c_int,
                    timeout_ms,
                )
            };
            match check(ready) {
                Ok(ready) => return Ok(ready as usize),
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
    }
}

fn no_events<const N: usize>() -> [libc::epoll_event; N] {
    [libc::epoll_event { events: 0, u64: 0 }; N]
}

/// A pipe for splice(2): bytes go through it between a socket and memory.
struct SplicePipe {
    read: File,
    write: File,
    capacity: usize,
    /// Bytes in the pipe that the socket has not taken yet (sending).
    in_pipe: usize,
}

impl SplicePipe {
    fn new() -> io::Result<Self> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2(2) writes two descriptors, owned at once.
        check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
        // SAFETY: both are new descriptors nothing else owns.
        let (read, write) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        // 1 MiB, so a large write fits (the unprivileged maximum); a smaller
        // pipe only means more splices.
        // SAFETY: fcntl(2) on our own pipe.
        unsafe {
            libc::fcntl(
                write.as_raw_fd(),
                libc::F_SETPIPE_SZ,
                LARGE_WRITE as libc::c_int,
            )
        };
        // SAFETY: as above.
        let capacity = check(unsafe { libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ) })?;
        Ok(SplicePipe {
            read,
            write,
            capacity: capacity as usize,
            in_pipe: 0,
        })
    }

    /// Sends the start of `data` to the socket through the pipe; how many
    /// bytes the socket took. What it did not take stays in the pipe: the
    /// first bytes of the next call's `data`.
    fn send(&mut self, socket: &TcpStream, data: &[u8]) -> io::Result<usize> {
        if self.in_pipe == 0 {
            let take = data.len().min(self.capacity);
            (&self.write).write_all(&data[..take])?;
            self.in_pipe = take;
        }
        let moved = splice(self.read.as_raw_fd(), socket.as_raw_fd(), self.in_pipe)?;
        self.in_pipe -= moved;
        Ok(moved)
    }

    /// Splices what the socket has (up to `buffer`'s size) into the pipe and
    /// reads it out into `buffer`; 0 at EOF.
    fn receive(&mut self, socket: &TcpStream, buffer: &mut [u8]) -> io::Result<usize> {
        let moved = splice(
            socket.as_raw_fd(),
            self.write.as_raw_fd(),
            buffer.len().min(self.capacity),
        )?;
        (&self.read).read_exact(&mut buffer[..moved])?;
        Ok(moved)
    }
}

fn splice(from: RawFd, to: RawFd, length: usize) -> io::Result<usize> {
    // SAFETY: splice(2) between two descriptors we own, without offsets.
    check_size(unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            length,
            libc::SPLICE_F_MOVE,
        )
    })
}

// ---------------------------------------------------------------------------
// Blocking streams, both sides.

/// Sends the sender's stream until its limit, until `stop` (an unbounded
/// one), or an error; `published` follows the bytes sent.
fn send_stream(
    stream: &TcpStream,
    sender: &mut Sender,
    stop: &AtomicBool,
    splice: bool,
    published: &AtomicU64,
) -> Result<(), String> {
    let mut pipe = match splice {
        true => Some(SplicePipe::new().map_err(|error| format!("pipe: {error}"))?),
        false => None,
    };
    let mut progress = Instant::now();
    while !(sender.limit == UNBOUNDED && stop.load(Ordering::Relaxed)) {
        if let Some(wait) = sender.ahead() {
            thread::sleep(wait.min(Duration::from_millis(50)));
            continue;
        }
        let data = sender.pending();
        if data.is_empty() {
            return Ok(());
        }
        let written = match pipe.as_mut() {
            Some(pipe) => pipe.send(stream, data),
            None => (&*stream).write(data),
        };
        match written {
            Ok(0) => return Err(format!("write returned 0 after {} bytes", sender.sent)),
            Ok(count) => {
                sender.advance(count);
                published.store(sender.sent, Ordering::Relaxed);
                progress = Instant::now();
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if is_timeout(&error) && progress.elapsed() < IDLE_LIMIT => {}
            Err(error) if is_timeout(&error) => {
                return Err(format!(
                    "no progress sending for {} s after {} bytes",
                    IDLE_LIMIT.as_secs(),
                    sender.sent
                ));
            }
            Err(error) => return Err(format!("sending after {} bytes: {error}", sender.sent)),
        }
    }
    Ok(())
}

/// How a blocking reader takes bytes from its socket.
enum ReadMethod {
    Plain,
    Splice(SplicePipe),
    Peek(Peeker),
}

impl ReadMethod {
    fn read(&mut self, mut stream: &TcpStream, buffer: &mut [u8]) -> io::Result<usize> {
        match self {
            ReadMethod::Plain => stream.read(buffer),
            ReadMethod::Splice(pipe) => pipe.receive(stream, buffer),
            ReadMethod::Peek(peeker) => peeker.read(stream, buffer),
        }
    }
}

/// Reads in turns of recv(MSG_PEEK) and recv of the same random size, and
/// checks that the second returns what the first showed.
struct Peeker {
    seed: u64,
    turns: u64,
    position: u64,
    peeked: Vec<u8>,
}

impl Peeker {
    fn new(seed: u64) -> Self {
        Peeker {
            seed: mix(seed ^ 0x7065_656b),
            turns: 0,
            position: 0,
            peeked: Vec::new(),
        }
    }

    fn read(&mut self, stream: &TcpStream, buffer: &mut [u8]) -> io::Result<usize> {
        let size = (Writes::Small.size(self.seed, self.turns) as usize).min(buffer.len());
        self.peeked.resize(size, 0);
        let peeked = recv(stream, &mut self.peeked, libc::MSG_PEEK)?;
        self.turns += 1;
        if peeked == 0 {
            return Ok(0);
        }
        let got = recv(stream, &mut buffer[..size], 0)?;
        if got < peeked {
            return Err(io::Error::other(format!(
                "at offset {}: recv returned {got} bytes after MSG_PEEK showed {peeked}",
                self.position
            )));
        }
        if let Some(at) = (0..peeked).find(|&at| buffer[at] != self.peeked[at]) {
            return Err(io::Error::other(format!(
                "at offset {}: recv returned other bytes than MSG_PEEK showed",
                self.position + at as u64
            )));
        }
        self.position += got as u64;
        Ok(got)
    }
}

/// Reads into the receiver until EOF, an error, no progress for
/// IDLE_LIMIT, or `deadline`; `watch` sees the bytes received after each read.
fn receive_stream(
    stream: &TcpStream,
    receiver: &mut Receiver,
    method: &mut ReadMethod,
    deadline: Option<Instant>,
    watch: &mut dyn FnMut(u64),
) -> Ending {
    let mut buffer = vec![0u8; READ_BUFFER];
    let mut progress = Instant::now();
    loop {
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            return Ending::Deadline;
        }
        match method.read(stream, &mut buffer) {
            Ok(0) => return Ending::Eof,
            Ok(count) => {
                receiver.take(&buffer[..count]);
                progress = Instant::now();
                watch(receiver.raw);
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if is_timeout(&error) && progress.elapsed() < IDLE_LIMIT => {}
            Err(error) if is_timeout(&error) => {
                return Ending::Stalled(format!("no data for {} s", IDLE_LIMIT.as_secs()));
            }
            Err(error) => return Ending::from_error(&error),
        }
    }
}

/// One blocking client connection that sends its stream from a second
/// thread while this one reads.
struct Exchange {
    sent: Sent,
    receiver: Receiver,
    ending: Ending,
    ms: u64,
    tcp: TcpCounters,
}

/// How the client side of an exchange reads and when it gives up; `watch`
/// sees the bytes received and sent so far.
struct Reading<'a> {
    method: ReadMethod,
    deadline: Option<Instant>,
    holds_report: bool,
    watch: &'a mut dyn FnMut(u64, u64),
}

fn exchange(addr: SocketAddr, header: &Header, mut reading: Reading) -> Result<Exchange, String> {
    let stream = connect(addr)?;
    write_all_patiently(&stream, &header.encode()).map_err(|error| format!("header: {error}"))?;
    let started = Instant::now();
    let stop = AtomicBool::new(false);
    let published = AtomicU64::new(0);
    let mut sender = Sender::new(header.seed, Direction::Up, header.writes, header.up);
    let verifier = Verifier::new(header.seed, Direction::Down, header.down);
    let mut receiver = Receiver::new(verifier, reading.holds_report);
    let (written, ending) = thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let written = send_stream(&stream, &mut sender, &stop, false, &published);
            let _ = stream.shutdown(Shutdown::Write);
            written
        });
        let mut watch = |received| (reading.watch)(received, published.load(Ordering::Relaxed));
        let ending = receive_stream(
            &stream,
            &mut receiver,
            &mut reading.method,
            reading.deadline,
            &mut watch,
        );
        stop.store(true, Ordering::Relaxed);
        if !matches!(ending, Ending::Eof) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let written = writer
            .join()
            .unwrap_or_else(|_| Err("the writer panicked".into()));
        (written, ending)
    });
    Ok(Exchange {
        sent: sender.account(written.err()),
        receiver,
        ending,
        ms: started.elapsed().as_millis() as u64,
        tcp: tcp_counters(&stream),
    })
}

/// What the connection's own TCP carried, from TCP_INFO: bytes the peer
/// acknowledged and bytes received. Data that sk_msg moved from socket to
/// socket counts in neither.
#[derive(Debug, Clone, Copy, Default)]
struct TcpCounters {
    bytes_acked: u64,
    bytes_received: u64,
}

fn tcp_counters(stream: &TcpStream) -> TcpCounters {
    // SAFETY: getsockopt(2) into a zeroed struct of the size passed.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut length = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    let result = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut length,
        )
    };
    if result != 0 {
        return TcpCounters::default();
    }
    TcpCounters {
        bytes_acked: info.tcpi_bytes_acked,
        bytes_received: info.tcpi_bytes_received,
    }
}

// ---------------------------------------------------------------------------
// The server.

/// How the first connections of `reset-by-client` ended, by token.
struct Victims {
    ends: Mutex<BTreeMap<u64, VictimEnd>>,
    arrived: Condvar,
}

static VICTIMS: Victims = Victims {
    ends: Mutex::new(BTreeMap::new()),
    arrived: Condvar::new(),
};

#[derive(Serialize, Deserialize)]
struct VictimEnd {
    /// As `Ending::name`.
    end: String,
    bytes: u64,
    prefix_ok: bool,
    problem: Option<String>,
    /// From the last byte read to the end of the connection.
    ms_after_last_byte: u64,
}

fn serve(listen: SocketAddr) -> ExitCode {
    socklb_tests::raise_open_files();
    let listener = match TcpListener::bind(listen) {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("streamcheck server: listening on {listen}: {error}");
            return ExitCode::from(2);
        }
    };
    // std listens with a backlog of 128; `many` connects a thousand at once.
    // listen(2) again raises it (the kernel caps it at somaxconn).
    // SAFETY: listen(2) on the listener's own descriptor.
    unsafe { libc::listen(listener.as_raw_fd(), 4096) };
    announce("listening");
    for incoming in listener.incoming() {
        match incoming {
            Ok(stream) => {
                let spawned = thread::Builder::new()
                    .name("connection".into())
                    .stack_size(THREAD_STACK)
                    .spawn(move || serve_connection(stream));
                if let Err(error) = spawned {
                    eprintln!("streamcheck server: no thread for a connection: {error}");
                }
            }
            Err(error) => {
                eprintln!("streamcheck server: accept: {error}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
    ExitCode::SUCCESS
}

fn serve_connection(stream: TcpStream) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "?".into(), |peer| peer.to_string());
    if let Err(error) = play(&stream) {
        eprintln!("streamcheck server: {peer}: {error}");
    }
}

/// Reads the header and plays the server's side of the connection.
fn play(stream: &TcpStream) -> Result<(), String> {
    prepare_blocking(stream)?;
    let mut bytes = [0u8; HEADER_LEN];
    read_exact_patiently(stream, &mut bytes).map_err(|error| format!("header: {error}"))?;
    let header = Header::decode(&bytes)?;
    match header.role {
        Role::Duplex => serve_duplex(stream, &header),
        Role::ResetByServer => serve_reset_by_server(stream, &header),
        Role::ResetVictim => serve_reset_victim(stream, &header),
        Role::ResetQuery => serve_reset_query(stream, &header),
        Role::Rcvlowat => serve_rcvlowat(stream, &header),
        Role::Pingpong => serve_pingpong(stream, &header),
    }
}

/// Sends the server's stream while reading the client's to EOF; then the
/// report, then EOF.
fn serve_duplex(stream: &TcpStream, header: &Header) -> Result<(), String> {
    let stop = AtomicBool::new(false);
    let published = AtomicU64::new(0);
    let mut sender =
        Sender::new(header.seed, Direction::Down, header.writes, header.down).paced(header.rate);
    let verifier = Verifier::new(header.seed, Direction::Up, header.up);
    let mut receiver = Receiver::new(verifier, false);
    let (written, ending) = thread::scope(|scope| {
        let writer = thread::Builder::new()
            .stack_size(THREAD_STACK)
            .spawn_scoped(scope, || {
                send_stream(stream, &mut sender, &stop, header.splice, &published)
            })
            .map_err(|error| format!("no writer thread: {error}"))?;
        let ending = receive_stream(
            stream,
            &mut receiver,
            &mut ReadMethod::Plain,
            None,
            &mut |_| {},
        );
        stop.store(true, Ordering::Relaxed);
        if !matches!(ending, Ending::Eof) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let written = writer
            .join()
            .unwrap_or_else(|_| Err("the writer panicked".into()));
        Ok::<_, String>((written, ending))
    })?;
    if !matches!(ending, Ending::Eof) {
        return Err(format!(
            "the client's stream ended with {} after {} bytes",
            ending.name(),
            receiver.raw
        ));
    }
    written?;
    let report = receiver.verifier.report(sender.sent);
    write_all_patiently(stream, &report.encode()).map_err(|error| format!("report: {error}"))?;
    let _ = stream.shutdown(Shutdown::Write);
    match receiver.verifier.prefix_problem("client to server") {
        Some(problem) => Err(problem),
        None => Ok(()),
    }
}

/// Sends the stream, then resets the connection (SO_LINGER 0 and close).
fn serve_reset_by_server(stream: &TcpStream, header: &Header) -> Result<(), String> {
    let mut sender = Sender::new(header.seed, Direction::Down, header.writes, header.down);
    send_stream(
        stream,
        &mut sender,
        &AtomicBool::new(false),
        false,
        &AtomicU64::new(0),
    )?;
    set_linger_zero(stream).map_err(|error| format!("SO_LINGER: {error}"))
}

/// Acknowledges the header, then reads until the client's reset and notes
/// how the reading ended for the query.
fn serve_reset_victim(stream: &TcpStream, header: &Header) -> Result<(), String> {
    write_all_patiently(stream, &[1]).map_err(|error| format!("acknowledging: {error}"))?;
    let verifier = Verifier::new(header.seed, Direction::Up, header.up);
    let mut receiver = Receiver::new(verifier, false);
    let mut last_byte = Instant::now();
    let mut told = false;
    // Once every byte is in, one more byte tells the client, which resets
    // the connection while this reader waits for more.
    let ending = receive_stream(
        stream,
        &mut receiver,
        &mut ReadMethod::Plain,
        None,
        &mut |received| {
            last_byte = Instant::now();
            if received >= header.up && !told {
                told = true;
                let _ = write_all_patiently(stream, &[2]);
            }
        },
    );
    let problem = receiver.verifier.prefix_problem("client to server");
    let end = VictimEnd {
        end: ending.name(),
        bytes: receiver.verifier.count,
        prefix_ok: problem.is_none(),
        problem,
        ms_after_last_byte: last_byte.elapsed().as_millis() as u64,
    };
    let mut ends = VICTIMS
        .ends
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    ends.insert(header.token, end);
    VICTIMS.arrived.notify_all();
    Ok(())
}

/// Answers how the connection with the header's token ended (one JSON
/// line), waiting up to QUERY_WAIT for it to end.
fn serve_reset_query(stream: &TcpStream, header: &Header) -> Result<(), String> {
    let deadline = Instant::now() + QUERY_WAIT;
    let mut ends = VICTIMS
        .ends
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let end = loop {
        if let Some(end) = ends.remove(&header.token) {
            break end;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break VictimEnd {
                end: format!("none within {} s", QUERY_WAIT.as_secs()),
                bytes: 0,
                prefix_ok: false,
                problem: None,
                ms_after_last_byte: 0,
            };
        }
        ends = VICTIMS
            .arrived
            .wait_timeout(ends, left)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0;
    };
    drop(ends);
    let line = serde_json::to_string(&end).expect("json") + "\n";
    write_all_patiently(stream, line.as_bytes())?;
    let _ = stream.shutdown(Shutdown::Write);
    Ok(())
}

/// Two rounds of 500 bytes, a pause, 500 bytes; the second 100 ms after
/// the client's go byte. Then waits for the client's EOF.
fn serve_rcvlowat(stream: &TcpStream, header: &Header) -> Result<(), String> {
    stream
        .set_nodelay(true)
        .map_err(|error| format!("TCP_NODELAY: {error}"))?;
    let seed = Direction::Down.seed(header.seed);
    let send_part = |index: usize| {
        let mut part = [0u8; LOWAT_PART];
        fill_stream(seed, (index * LOWAT_PART) as u64, &mut part);
        write_all_patiently(stream, &part)
    };
    for round in 0..2 {
        if round == 1 {
            read_exact_patiently(stream, &mut [0u8; 1]).map_err(|error| format!("go: {error}"))?;
            thread::sleep(LOWAT_SETTLE);
        }
        send_part(round * 2)?;
        thread::sleep(LOWAT_PAUSE);
        send_part(round * 2 + 1)?;
    }
    let rest = read_to_end_patiently(stream)?;
    match rest.is_empty() {
        true => Ok(()),
        false => Err(format!("{} unexpected bytes from the client", rest.len())),
    }
}

/// Echoes every byte (non-blocking, edge-triggered epoll) until EOF; then
/// the report.
fn serve_pingpong(stream: &TcpStream, header: &Header) -> Result<(), String> {
    stream
        .set_nodelay(true)
        .and_then(|()| stream.set_nonblocking(true))
        .map_err(|error| format!("socket: {error}"))?;
    let epoll = Epoll::new().map_err(|error| format!("epoll: {error}"))?;
    let edge = libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET;
    epoll
        .add(stream.as_raw_fd(), edge, 0)
        .map_err(|error| format!("epoll_ctl: {error}"))?;
    let mut verifier = Verifier::new(header.seed, Direction::Up, header.up);
    let mut events = no_events::<4>();
    let mut buffer = [0u8; 4096];
    loop {
        if drain_echoing(stream, &mut verifier, &mut buffer)? {
            break;
        }
        let ready = epoll
            .wait(&mut events, IDLE_LIMIT.as_millis() as i32)
            .map_err(|error| format!("epoll_wait: {error}"))?;
        if ready == 0 {
            return Err(format!(
                "no message for {} s after {} (bytes waiting: {:?})",
                IDLE_LIMIT.as_secs(),
                verifier.count,
                bytes_waiting(stream).ok()
            ));
        }
    }
    let report = verifier.report(verifier.count);
    write_all_polling(stream, &report.encode())?;
    let _ = stream.shutdown(Shutdown::Write);
    match verifier.prefix_problem("client to server") {
        Some(problem) => Err(problem),
        None => Ok(()),
    }
}

/// Reads until EAGAIN, echoing what came; true at EOF.
fn drain_echoing(
    mut stream: &TcpStream,
    verifier: &mut Verifier,
    buffer: &mut [u8],
) -> Result<bool, String> {
    loop {
        match stream.read(buffer) {
            Ok(0) => return Ok(true),
            Ok(count) => {
                verifier.feed(&buffer[..count]);
                write_all_polling(stream, &buffer[..count])?;
            }
            Err(error) if error.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => return Err(format!("read after {} bytes: {error}", verifier.count)),
        }
    }
}

// ---------------------------------------------------------------------------
// The client.

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Integrity,
    HalfClose,
    ResetByServer,
    ResetByClient,
    KilledServer,
    Peek,
    Rcvlowat,
    Pingpong,
    Splice,
    Many,
    Stream,
}

const MODES: [(Mode, &str); 11] = [
    (Mode::Integrity, "integrity"),
    (Mode::HalfClose, "half-close"),
    (Mode::ResetByServer, "reset-by-server"),
    (Mode::ResetByClient, "reset-by-client"),
    (Mode::KilledServer, "killed-server"),
    (Mode::Peek, "peek"),
    (Mode::Rcvlowat, "rcvlowat"),
    (Mode::Pingpong, "pingpong"),
    (Mode::Splice, "splice"),
    (Mode::Many, "many"),
    (Mode::Stream, "stream"),
];

impl Mode {
    fn parse(text: &str) -> Result<Self, String> {
        MODES
            .iter()
            .find(|(_, name)| *name == text)
            .map(|(mode, _)| *mode)
            .ok_or_else(|| format!("--mode: unknown mode {text}"))
    }

    fn name(self) -> &'static str {
        MODES
            .iter()
            .find(|(mode, _)| *mode == self)
            .map(|(_, name)| *name)
            .expect("every mode is named")
    }

    /// `--bytes` by default; None where it does not apply.
    fn default_bytes(self) -> Option<u64> {
        match self {
            Mode::Integrity => Some(256 * MIB),
            Mode::HalfClose | Mode::Peek => Some(MIB),
            Mode::ResetByServer | Mode::ResetByClient | Mode::Many => Some(64 * KIB),
            Mode::Splice => Some(64 * MIB),
            Mode::Pingpong => Some(100_000),
            Mode::KilledServer | Mode::Stream | Mode::Rcvlowat => None,
        }
    }

    /// `--connections` by default; None where it does not apply.
    fn default_connections(self) -> Option<u64> {
        match self {
            Mode::Many => Some(1000),
            Mode::Stream => Some(100),
            _ => None,
        }
    }

    fn default_seconds(self) -> Option<u64> {
        match self {
            Mode::KilledServer => Some(30),
            Mode::Stream => Some(600),
            _ => None,
        }
    }
}

struct ClientArgs {
    addr: SocketAddr,
    mode: Mode,
    bytes: u64,
    writes: Writes,
    connections: u64,
    /// The run's bound (killed-server), how long to stream at most
    /// (stream), or an extra bound on the reading (the other modes).
    seconds: Option<u64>,
    seed: u64,
    cgroup: Option<PathBuf>,
    /// Bytes per second each side of each connection sends at most
    /// (stream and many; 0: as fast as it can).
    rate: u64,
}

/// A size: digits with an optional k, m or g suffix (KiB, MiB, GiB).
fn parse_size(flag: &str, text: &str) -> Result<u64, String> {
    let (digits, unit) = match text.char_indices().last() {
        Some((at, 'k' | 'K')) => (&text[..at], KIB),
        Some((at, 'm' | 'M')) => (&text[..at], MIB),
        Some((at, 'g' | 'G')) => (&text[..at], 1024 * MIB),
        _ => (text, 1),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|number| number.checked_mul(unit))
        .ok_or_else(|| format!("{flag}: {text} is not a size"))
}

fn fresh_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64);
    mix(nanos ^ (u64::from(std::process::id()) << 32))
}

fn parse_client(words: impl Iterator<Item = String>) -> Result<ClientArgs, String> {
    let mut words = words;
    let (mut addr, mut mode, mut bytes, mut connections, mut seconds, mut seed) =
        (None, None, None, None, None, None);
    let mut writes = Writes::Small;
    let mut cgroup = None;
    let mut rate = 0;
    while let Some(flag) = words.next() {
        let mut value = || words.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => addr = Some(value()?.parse().map_err(|e| format!("--addr: {e}"))?),
            "--mode" => mode = Some(Mode::parse(&value()?)?),
            "--bytes" => bytes = Some(parse_size(&flag, &value()?)?),
            "--writes" => writes = Writes::parse(&value()?)?,
            "--connections" => connections = Some(parse_size(&flag, &value()?)?),
            "--seconds" => seconds = Some(parse_size(&flag, &value()?)?),
            "--seed" => seed = Some(parse_size(&flag, &value()?)?),
            "--rate" => rate = parse_size(&flag, &value()?)?,
            "--cgroup" => cgroup = Some(PathBuf::from(value()?)),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let mode: Mode = mode.ok_or("--mode is required")?;
    let defaults = (mode.default_bytes(), mode.default_connections());
    if bytes.is_some() && defaults.0.is_none() {
        return Err(format!("--bytes does not apply to {}", mode.name()));
    }
    if connections.is_some() && defaults.1.is_none() {
        return Err(format!(
            "--connections applies to many and stream, not {}",
            mode.name()
        ));
    }
    Ok(ClientArgs {
        addr: addr.ok_or("--addr is required")?,
        mode,
        bytes: bytes.or(defaults.0).unwrap_or(UNBOUNDED),
        writes,
        connections: connections.or(defaults.1).unwrap_or(1).max(1),
        seconds: seconds.or(mode.default_seconds()),
        seed: seed.unwrap_or_else(fresh_seed),
        cgroup,
        rate,
    })
}

/// The client's JSON line.
#[derive(Serialize)]
struct Summary {
    mode: &'static str,
    ok: bool,
    connections: u64,
    failed: u64,
    bytes_sent: u64,
    bytes_received: u64,
    errors: Vec<String>,
    ms: u64,
    seed: u64,
    #[serde(flatten)]
    figures: Map<String, Value>,
}

impl Summary {
    fn new(args: &ClientArgs) -> Self {
        Summary {
            mode: args.mode.name(),
            ok: false,
            connections: 0,
            failed: 0,
            bytes_sent: 0,
            bytes_received: 0,
            errors: Vec::new(),
            ms: 0,
            seed: args.seed,
            figures: Map::new(),
        }
    }

    /// One checked connection; `label` names it in the errors.
    fn connection(&mut self, label: Option<u64>, sent: u64, received: u64, problems: Vec<String>) {
        self.connections += 1;
        self.bytes_sent += sent;
        self.bytes_received += received;
        if !problems.is_empty() {
            self.failed += 1;
        }
        for problem in problems {
            self.error(match label {
                Some(index) => format!("connection {index}: {problem}"),
                None => problem,
            });
        }
    }

    fn error(&mut self, error: String) {
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(error);
        }
    }

    fn figure(&mut self, name: &str, value: impl Into<Value>) {
        self.figures.insert(name.into(), value.into());
    }
}

fn run_client(args: &ClientArgs) -> Summary {
    let started = Instant::now();
    let mut summary = Summary::new(args);
    summary.figure("writes", args.writes.name());
    let outcome = match args.mode {
        Mode::Integrity | Mode::HalfClose | Mode::Splice | Mode::Peek => {
            run_reported(args, &mut summary)
        }
        Mode::ResetByServer => run_reset_by_server(args, &mut summary),
        Mode::ResetByClient => run_reset_by_client(args, &mut summary),
        Mode::KilledServer => run_killed_server(args, &mut summary),
        Mode::Rcvlowat => run_rcvlowat(args, &mut summary),
        Mode::Pingpong => run_pingpong(args, &mut summary),
        Mode::Many | Mode::Stream => run_flows_mode(args, &mut summary),
    };
    if let Err(error) = outcome {
        // It could not run a connection to its check.
        summary.connections = summary.connections.max(1);
        summary.failed += 1;
        summary.error(error);
    }
    summary.ok = summary.connections > 0 && summary.failed == 0 && summary.errors.is_empty();
    summary.ms = started.elapsed().as_millis() as u64;
    summary
}

fn mib_per_second(bytes: u64, ms: u64) -> f64 {
    let rate = bytes as f64 / MIB as f64 / (ms.max(1) as f64 / 1000.0);
    (rate * 10.0).round() / 10.0
}

/// integrity, half-close, splice, peek: one exchange that ends with the
/// server's report.
fn run_reported(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
    let mut header = Header::new(Role::Duplex, args.seed);
    header.writes = args.writes;
    let mut method = ReadMethod::Plain;
    match args.mode {
        Mode::Integrity => (header.up, header.down) = (args.bytes, args.bytes),
        Mode::HalfClose => header.up = args.bytes,
        Mode::Splice => {
            header.down = args.bytes;
            header.splice = true;
            method = ReadMethod::Splice(SplicePipe::new().map_err(|e| format!("pipe: {e}"))?);
        }
        _ => {
            header.down = args.bytes;
            method = ReadMethod::Peek(Peeker::new(args.seed));
        }
    }
    let reading = Reading {
        method,
        deadline: args
            .seconds
            .map(|seconds| Instant::now() + Duration::from_secs(seconds)),
        holds_report: true,
        watch: &mut |_, _| {},
    };
    let done = exchange(args.addr, &header, reading)?;
    let problems = reported_problems(&done.sent, &done.receiver, &done.ending, header.down);
    let moved = done.sent.bytes + done.receiver.verifier.count;
    summary.connection(
        None,
        done.sent.bytes,
        done.receiver.verifier.count,
        problems,
    );
    summary.figure("transfer_ms", done.ms);
    summary.figure("mib_per_s", mib_per_second(moved, done.ms));
    summary.figure("tcp_bytes_acked", done.tcp.bytes_acked);
    summary.figure("tcp_bytes_received", done.tcp.bytes_received);
    Ok(())
}

/// killed-server: streams both ways until the connection ends.
fn run_killed_server(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
    let mut header = Header::new(Role::Duplex, args.seed);
    (header.writes, header.up, header.down) = (args.writes, UNBOUNDED, UNBOUNDED);
    let seconds = args.seconds.unwrap_or(30);
    let mut announced = false;
    let mut watch = |received: u64, sent: u64| {
        if !announced && received > 0 && sent > 0 {
            announce("streaming");
            announced = true;
        }
    };
    let reading = Reading {
        method: ReadMethod::Plain,
        deadline: Some(Instant::now() + Duration::from_secs(seconds)),
        holds_report: false,
        watch: &mut watch,
    };
    let done = exchange(args.addr, &header, reading)?;
    let mut problems = Vec::new();
    if !done.ending.ended() {
        problems.push(match &done.ending {
            Ending::Deadline => format!("the connection did not end within {seconds} s"),
            other => format!("the connection hung: {}", other.name()),
        });
    }
    problems.extend(done.receiver.verifier.prefix_problem("server to client"));
    summary.figure("end", done.ending.name());
    summary.figure("end_ms", done.ms);
    summary.figure(
        "sending_end",
        done.sent.error.clone().unwrap_or("none".into()),
    );
    summary.connection(
        None,
        done.sent.bytes,
        done.receiver.verifier.count,
        problems,
    );
    Ok(())
}

/// reset-by-server: reads until the server's reset.
fn run_reset_by_server(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
    let mut header = Header::new(Role::ResetByServer, args.seed);
    (header.writes, header.down) = (args.writes, args.bytes);
    let stream = connect(args.addr)?;
    write_all_patiently(&stream, &header.encode()).map_err(|error| format!("header: {error}"))?;
    let started = Instant::now();
    let verifier = Verifier::new(header.seed, Direction::Down, header.down);
    let mut receiver = Receiver::new(verifier, false);
    let deadline = Some(started + RESET_LIMIT);
    let ending = receive_stream(
        &stream,
        &mut receiver,
        &mut ReadMethod::Plain,
        deadline,
        &mut |_| {},
    );
    let mut problems = Vec::new();
    if !matches!(ending, Ending::Eof | Ending::Reset) {
        problems.push(format!(
            "the connection ended with {} instead of ECONNRESET or EOF within {} s",
            ending.name(),
            RESET_LIMIT.as_secs()
        ));
    }
    problems.extend(receiver.verifier.prefix_problem("server to client"));
    summary.figure("end", ending.name());
    summary.figure("end_ms", started.elapsed().as_millis() as u64);
    summary.connection(None, 0, receiver.verifier.count, problems);
    Ok(())
}

/// reset-by-client: sends, resets, then asks the server how its reader
/// ended.
fn run_reset_by_client(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
    let mut header = Header::new(Role::ResetVictim, args.seed);
    (header.writes, header.up, header.token) = (args.writes, args.bytes, word(args.seed, 1) | 1);
    let stream = connect(args.addr)?;
    write_all_patiently(&stream, &header.encode()).map_err(|error| format!("header: {error}"))?;
    read_exact_patiently(&stream, &mut [0u8; 1])
        .map_err(|error| format!("acknowledgement: {error}"))?;
    let mut sender = Sender::new(header.seed, Direction::Up, header.writes, header.up);
    send_stream(
        &stream,
        &mut sender,
        &AtomicBool::new(false),
        false,
        &AtomicU64::new(0),
    )?;
    // The server says when it has every byte; its reader then waits for
    // more, and the reset comes.
    read_exact_patiently(&stream, &mut [0u8; 1])
        .map_err(|error| format!("the server's receipt: {error}"))?;
    set_linger_zero(&stream).map_err(|error| format!("SO_LINGER: {error}"))?;
    drop(stream);
    let reset_at = Instant::now();
    let query = connect(args.addr)?;
    let asking = Header {
        role: Role::ResetQuery,
        ..header
    };
    write_all_patiently(&query, &asking.encode()).map_err(|error| format!("query: {error}"))?;
    let answer = read_to_end_patiently(&query).map_err(|error| format!("answer: {error}"))?;
    let answer_ms = reset_at.elapsed().as_millis() as u64;
    let end: VictimEnd = serde_json::from_slice(&answer)
        .map_err(|error| format!("answer {:?}: {error}", String::from_utf8_lossy(&answer)))?;
    let mut problems = Vec::new();
    if end.end != "reset" && end.end != "eof" {
        problems.push(format!(
            "the server's reader ended with {}, not ECONNRESET or EOF",
            end.end
        ));
    }
    if answer_ms > RESET_LIMIT.as_millis() as u64 {
        problems.push(format!(
            "the server's reader saw the end only after {answer_ms} ms"
        ));
    }
    if !end.prefix_ok || end.bytes > sender.sent {
        problems.push(end.problem.clone().unwrap_or(format!(
            "the server read {} bytes of the {} sent",
            end.bytes, sender.sent
        )));
    }
    summary.figure("server_end", end.end.clone());
    summary.figure("server_bytes", end.bytes);
    summary.figure("server_ms_after_last_byte", end.ms_after_last_byte);
    summary.figure("answer_ms", answer_ms);
    summary.connection(None, sender.sent, 0, problems);
    Ok(())
}

/// rcvlowat: SO_RCVLOWAT 1000 against 500 bytes, a pause, 500 bytes; first
/// with poll(2) and a non-blocking read, then with a blocking read.
fn run_rcvlowat(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
    let mut header = Header::new(Role::Rcvlowat, args.seed);
    header.down = 4 * LOWAT_PART as u64;
    let stream = connect(args.addr)?;
    let fd = stream.as_raw_fd();
    set_option(
        fd,
        libc::SOL_SOCKET,
        libc::SO_RCVLOWAT,
        RCVLOWAT as libc::c_int,
    )
    .map_err(|error| format!("SO_RCVLOWAT: {error}"))?;
    stream
        .set_read_timeout(Some(RESET_LIMIT))
        .map_err(|error| format!("SO_RCVTIMEO: {error}"))?;
    write_all_patiently(&stream, &header.encode()).map_err(|error| format!("header: {error}"))?;
    let sent_at = Instant::now();
    let mut verifier = Verifier::new(header.seed, Direction::Down, header.down);
    let mut buffer = [0u8; 4096];
    let failed = |what: &str, error: io::Error| format!("{what}: {error}");

    // Round 1: poll must wait for the second part.
    let early = poll_one(fd, libc::POLLIN, LOWAT_PROBE_MS).map_err(|e| failed("poll", e))?;
    let early_waiting = bytes_waiting(&stream).map_err(|e| failed("FIONREAD", e))?;
    let readable = early != 0
        || poll_one(fd, libc::POLLIN, RESET_LIMIT.as_millis() as i32)
            .map_err(|e| failed("poll", e))?
            != 0;
    let poll_ms = sent_at.elapsed().as_millis() as u64;
    let poll_waiting = bytes_waiting(&stream).map_err(|e| failed("FIONREAD", e))?;
    let first = match readable {
        true => recv(&stream, &mut buffer, libc::MSG_DONTWAIT).map_err(|e| failed("read", e))?,
        false => 0,
    };
    verifier.feed(&buffer[..first]);

    // Round 2: a blocking read, asleep before any byte comes, must wait for
    // SO_RCVLOWAT bytes and then wake. (Linux wakes a reader only when the
    // bytes queued since its last copy reach SO_RCVLOWAT: a read that found
    // 500 bytes, copied them and slept is not woken by 500 more and sleeps
    // to its timeout. The server's 100 ms settle keeps this round clear of
    // that case.)
    write_all_patiently(&stream, &[1]).map_err(|error| format!("go: {error}"))?;
    let asked_at = Instant::now();
    let queued_before = bytes_waiting(&stream).map_err(|e| failed("FIONREAD", e))?;
    let second = recv(&stream, &mut buffer, 0).map_err(|e| failed("blocking read", e))?;
    let blocking_ms = asked_at.elapsed().as_millis() as u64;
    verifier.feed(&buffer[..second]);

    let _ = stream.shutdown(Shutdown::Write);
    prepare_blocking(&stream)?;
    let rest = read_to_end_patiently(&stream)?;
    verifier.feed(&rest);

    let mut problems = Vec::new();
    if early != 0 {
        problems.push(format!(
            "poll said readable within {LOWAT_PROBE_MS} ms with {early_waiting} bytes waiting (SO_RCVLOWAT {RCVLOWAT})"
        ));
    }
    if first != RCVLOWAT {
        problems.push(format!(
            "the read after poll returned {first} bytes, not {RCVLOWAT} (readable: {readable} after {poll_ms} ms, {poll_waiting} bytes waiting)"
        ));
    }
    if second != RCVLOWAT {
        problems.push(format!(
            "the blocking read returned {second} bytes after {blocking_ms} ms, not {RCVLOWAT}"
        ));
    } else if queued_before == 0 && blocking_ms > LOWAT_WAKE_LIMIT.as_millis() as u64 {
        problems.push(format!(
            "the blocking read was woken only after {blocking_ms} ms (a lost wakeup: both parts come within about {} ms)",
            (LOWAT_SETTLE + LOWAT_PAUSE).as_millis()
        ));
    }
    problems.extend(verifier.prefix_problem("server to client"));
    if verifier.count != header.down {
        problems.push(format!(
            "received {} of {} bytes",
            verifier.count, header.down
        ));
    }
    summary.figure("probe_readable", early != 0);
    summary.figure("probe_waiting", early_waiting);
    summary.figure("poll_ms", poll_ms);
    summary.figure("poll_waiting", poll_waiting);
    summary.figure("first_read", first);
    summary.figure("blocking_read", second);
    summary.figure("blocking_ms", blocking_ms);
    summary.figure("blocking_queued_before", queued_before);
    summary.connection(None, 0, verifier.count, problems);
    Ok(())
}

/// pingpong's waits.
#[derive(Default)]
struct PingStats {
    /// Wakeups that found nothing to read.
    spurious: u64,
    longest_wait: Duration,
}

/// pingpong: one byte out, wait (edge-triggered) for its echo, and again.
fn run_pingpong(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
    let messages = args.bytes;
    let mut header = Header::new(Role::Pingpong, args.seed);
    (header.up, header.down) = (messages, messages);
    let stream = connect(args.addr)?;
    stream
        .set_nodelay(true)
        .map_err(|error| format!("TCP_NODELAY: {error}"))?;
    write_all_patiently(&stream, &header.encode()).map_err(|error| format!("header: {error}"))?;
    stream
        .set_nonblocking(true)
        .map_err(|error| format!("O_NONBLOCK: {error}"))?;
    let epoll = Epoll::new().map_err(|error| format!("epoll: {error}"))?;
    let edge = libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET;
    epoll
        .add(stream.as_raw_fd(), edge, 0)
        .map_err(|error| format!("epoll_ctl: {error}"))?;
    // The echo is the client's own stream.
    let mut receiver = Receiver::new(Verifier::new(header.seed, Direction::Up, messages), true);
    let up_seed = Direction::Up.seed(header.seed);
    let mut hash = Context::new(&SHA256);
    let mut stats = PingStats::default();
    let started = Instant::now();
    let mut failure = None;
    let mut sent = 0;
    while sent < messages && failure.is_none() {
        let mut byte = [0u8; 1];
        fill_stream(up_seed, sent, &mut byte);
        failure = write_all_polling(&stream, &byte).err();
        if failure.is_none() {
            hash.update(&byte);
            sent += 1;
            failure = await_echo(&stream, &epoll, &mut receiver, sent - 1, &mut stats).err();
        }
    }
    let ms = started.elapsed().as_millis() as u64;
    let sent = Sent {
        bytes: sent,
        digest: finish_digest(hash),
        error: None,
    };
    let problems = match failure {
        Some(error) => {
            let prefix = receiver.verifier.prefix_problem("echo");
            std::iter::once(error).chain(prefix).collect()
        }
        None => {
            let ending = finish_pingpong(&stream, &epoll, &mut receiver);
            reported_problems(&sent, &receiver, &ending, messages)
        }
    };
    summary.figure("messages", sent.bytes);
    summary.figure("pingpong_ms", ms);
    summary.figure("us_per_message", ms * 1000 / sent.bytes.max(1));
    summary.figure("longest_wait_ms", stats.longest_wait.as_millis() as u64);
    summary.figure("spurious_wakeups", stats.spurious);
    summary.connection(None, sent.bytes, receiver.verifier.count, problems);
    Ok(())
}

/// Waits (edge-triggered, at most 5 s a wait) for the echo of message
/// `index` and reads it.
fn await_echo(
    stream: &TcpStream,
    epoll: &Epoll,
    receiver: &mut Receiver,
    index: u64,
    stats: &mut PingStats,
) -> Result<(), String> {
    let before = receiver.raw;
    let started = Instant::now();
    let mut events = no_events::<4>();
    loop {
        let ready = epoll
            .wait(&mut events, PINGPONG_WAIT_MS)
            .map_err(|error| format!("epoll_wait: {error}"))?;
        if ready == 0 {
            return Err(match bytes_waiting(stream) {
                Ok(waiting) if waiting > 0 => format!(
                    "lost wakeup after {index} messages: the echo was readable here ({waiting} bytes) but epoll_wait saw no event for {PINGPONG_WAIT_MS} ms"
                ),
                _ => format!(
                    "lost wakeup after {index} messages: no echo within {PINGPONG_WAIT_MS} ms (nothing readable here: the server missed the message or its echo was lost)"
                ),
            });
        }
        if drain(stream, receiver)? {
            return Err(format!("EOF after {index} messages"));
        }
        match receiver.raw - before {
            0 => stats.spurious += 1,
            1 => break,
            more => return Err(format!("{more} bytes came back for message {index}")),
        }
    }
    stats.longest_wait = stats.longest_wait.max(started.elapsed());
    Ok(())
}

/// Reads a non-blocking socket until EAGAIN; true at EOF.
fn drain(mut stream: &TcpStream, receiver: &mut Receiver) -> Result<bool, String> {
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return Ok(true),
            Ok(count) => receiver.take(&buffer[..count]),
            Err(error) if error.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => return Err(format!("read after {} bytes: {error}", receiver.raw)),
        }
    }
}

/// Half-closes and reads the report and EOF.
fn finish_pingpong(stream: &TcpStream, epoll: &Epoll, receiver: &mut Receiver) -> Ending {
    if let Err(error) = stream.shutdown(Shutdown::Write) {
        return Ending::Error(format!("shutdown: {error}"));
    }
    let mut events = no_events::<4>();
    loop {
        match drain(stream, receiver) {
            Ok(true) => return Ending::Eof,
            Ok(false) => {}
            Err(error) => return Ending::Error(error),
        }
        match epoll.wait(&mut events, PINGPONG_WAIT_MS) {
            Ok(0) => {
                return Ending::Stalled(format!("no report or EOF within {PINGPONG_WAIT_MS} ms"));
            }
            Ok(_) => {}
            Err(error) => return Ending::Error(format!("epoll_wait: {error}")),
        }
    }
}

// ---------------------------------------------------------------------------
// many and stream: non-blocking connections in one epoll loop.

/// One non-blocking connection of `many` or `stream`.
struct Flow {
    stream: TcpStream,
    header: [u8; HEADER_LEN],
    header_sent: usize,
    sender: Sender,
    receiver: Receiver,
    down_limit: u64,
    /// Half-closed: the stream is all sent, or stopped.
    shut: bool,
    /// Ahead of its rate: no write until it is due.
    paced: bool,
    stopping: bool,
    write_error: Option<String>,
    ending: Option<Ending>,
    progress: Instant,
    readable: bool,
    writable: bool,
    queued: bool,
}

impl Flow {
    fn new(stream: TcpStream, header: &Header) -> Self {
        Flow {
            stream,
            header: header.encode(),
            header_sent: 0,
            sender: Sender::new(header.seed, Direction::Up, header.writes, header.up)
                .paced(header.rate),
            receiver: Receiver::new(
                Verifier::new(header.seed, Direction::Down, header.down),
                true,
            ),
            down_limit: header.down,
            shut: false,
            paced: false,
            stopping: false,
            write_error: None,
            ending: None,
            progress: Instant::now(),
            readable: true,
            writable: true,
            queued: true,
        }
    }

    fn done(&self) -> bool {
        self.ending.is_some()
    }

    /// Bytes have moved both ways.
    fn flowing(&self) -> bool {
        self.sender.sent > 0 && self.receiver.raw > 0
    }

    /// Has work it has not done for want of budget.
    fn busy(&self) -> bool {
        !self.done() && (self.readable || (self.writable && !self.shut && !self.paced))
    }

    fn turn(&mut self, buffer: &mut [u8]) {
        self.write_some();
        self.read_some(buffer);
    }

    /// Writes until the socket is full, the budget is spent, or the stream
    /// is all sent (then half-closes).
    fn write_some(&mut self) {
        let mut spent = 0;
        self.paced = false;
        while self.writable && !self.shut && !self.done() && spent < TURN_BUDGET {
            let stopped = self.stopping && self.sender.limit == UNBOUNDED;
            let written = if self.header_sent < HEADER_LEN {
                let written = (&self.stream).write(&self.header[self.header_sent..]);
                if let Ok(count) = written {
                    self.header_sent += count;
                }
                written
            } else if self.sender.done() || stopped {
                let _ = self.stream.shutdown(Shutdown::Write);
                self.shut = true;
                break;
            } else if self.sender.ahead().is_some() {
                // Paced: the loop queues it again once it is due.
                self.paced = true;
                break;
            } else {
                let written = (&self.stream).write(self.sender.pending());
                if let Ok(count) = written {
                    self.sender.advance(count);
                }
                written
            };
            match written {
                Ok(0) => self.writable = false,
                Ok(count) => {
                    spent += count;
                    self.progress = Instant::now();
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => self.writable = false,
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(error) => {
                    // Reading goes on, to see how the connection ended.
                    self.write_error = Some(format!("after {} bytes: {error}", self.sender.sent));
                    self.shut = true;
                }
            }
        }
    }

    fn read_some(&mut self, buffer: &mut [u8]) {
        let mut spent = 0;
        while self.readable && !self.done() && spent < TURN_BUDGET {
            match (&self.stream).read(buffer) {
                Ok(0) => self.ending = Some(Ending::Eof),
                Ok(count) => {
                    self.receiver.take(&buffer[..count]);
                    spent += count;
                    self.progress = Instant::now();
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => self.readable = false,
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(error) => self.ending = Some(Ending::from_error(&error)),
            }
        }
    }

    fn stall_check(&mut self) {
        if !self.done() && self.progress.elapsed() >= IDLE_LIMIT {
            self.ending = Some(Ending::Stalled(format!(
                "no progress either way for {} s, {} bytes sent",
                IDLE_LIMIT.as_secs(),
                self.sender.sent
            )));
        }
    }

    fn problems(&self) -> Vec<String> {
        let sent = self.sender.account(self.write_error.clone());
        let ending = self
            .ending
            .clone()
            .unwrap_or(Ending::Error("never ended".into()));
        reported_problems(&sent, &self.receiver, &ending, self.down_limit)
    }
}

/// Runs the flows to their ends with one edge-triggered epoll instance,
/// each connection moving at most TURN_BUDGET a turn so none starves the
/// others. `stop` (or `deadline`) half-closes the unbounded ones; `on_turn`
/// sees the flows after each turn.
fn run_flows(
    flows: &mut [Flow],
    stop: &AtomicBool,
    deadline: Option<Instant>,
    on_turn: &mut dyn FnMut(&[Flow]),
) -> Result<(), String> {
    let epoll = Epoll::new().map_err(|error| format!("epoll: {error}"))?;
    let edge = libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET;
    for (index, flow) in flows.iter().enumerate() {
        epoll
            .add(flow.stream.as_raw_fd(), edge, index as u64)
            .map_err(|error| format!("epoll_ctl: {error}"))?;
    }
    let mut queue: VecDeque<usize> = (0..flows.len()).collect();
    let mut buffer = vec![0u8; READ_BUFFER];
    let mut events = no_events::<1024>();
    let mut stopping = false;
    let mut checked = Instant::now();
    let mut open = flows.len();
    while open > 0 {
        let paced = flows.iter().any(|flow| flow.paced && !flow.done());
        let timeout = match (queue.is_empty(), paced) {
            (false, _) => 0,
            (true, true) => 5,
            (true, false) => 200,
        };
        let ready = epoll
            .wait(&mut events, timeout)
            .map_err(|error| format!("epoll_wait: {error}"))?;
        if paced {
            for (index, flow) in flows.iter_mut().enumerate() {
                if flow.paced && flow.sender.ahead().is_none() {
                    flow.paced = false;
                    enqueue(flow, index, &mut queue);
                }
            }
        }
        for event in &events[..ready] {
            let (bits, index) = (event.events as libc::c_int, event.u64 as usize);
            let flow = &mut flows[index];
            flow.readable |=
                bits & (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) != 0;
            flow.writable |= bits & (libc::EPOLLOUT | libc::EPOLLHUP | libc::EPOLLERR) != 0;
            enqueue(flow, index, &mut queue);
        }
        for _ in 0..queue.len() {
            let index = queue.pop_front().expect("queued");
            let flow = &mut flows[index];
            flow.queued = false;
            let was_done = flow.done();
            flow.turn(&mut buffer);
            if flow.done() && !was_done {
                open -= 1;
            }
            if flow.busy() {
                enqueue(flow, index, &mut queue);
            }
        }
        let time_is_up = deadline.is_some_and(|deadline| Instant::now() >= deadline);
        if !stopping && (stop.load(Ordering::Relaxed) || time_is_up) {
            stopping = true;
            for (index, flow) in flows.iter_mut().enumerate() {
                (flow.stopping, flow.writable) = (true, true);
                enqueue(flow, index, &mut queue);
            }
        }
        if checked.elapsed() >= SLICE {
            checked = Instant::now();
            for flow in flows.iter_mut().filter(|flow| !flow.done()) {
                flow.stall_check();
                open -= flow.done() as usize;
            }
        }
        on_turn(flows);
    }
    Ok(())
}

fn enqueue(flow: &mut Flow, index: usize, queue: &mut VecDeque<usize>) {
    if !flow.queued && !flow.done() {
        flow.queued = true;
        queue.push_back(index);
    }
}

/// Sets `stop` when stdin closes or has a line `stop`.
fn watch_stdin(stop: Arc<AtomicBool>) {
    thread::spawn(move || {
        let mut stdin = io::stdin().lock();
        // The current line's start; a longer line is not `stop` anyway.
        let mut line = Vec::with_capacity(64);
        let mut chunk = [0u8; 256];
        'reading: while let Ok(count @ 1..) = stdin.read(&mut chunk) {
            for &byte in &chunk[..count] {
                if byte == b'\n' {
                    if line.trim_ascii() == b"stop" {
                        break 'reading;
                    }
                    line.clear();
                } else if line.len() < 64 {
                    line.push(byte);
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
}

/// many and stream: opens all connections, then runs them in one loop.
fn run_flows_mode(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
    socklb_tests::raise_open_files();
    let streaming = args.mode == Mode::Stream;
    let bytes = if streaming { UNBOUNDED } else { args.bytes };
    let started = Instant::now();
    let mut flows = Vec::new();
    for index in 0..args.connections {
        let mut header = Header::new(Role::Duplex, connection_seed(args.seed, index));
        (header.writes, header.up, header.down) = (args.writes, bytes, bytes);
        header.rate = args.rate;
        let opened = connect(args.addr).and_then(|stream| {
            stream
                .set_nonblocking(true)
                .map_err(|error| format!("O_NONBLOCK: {error}"))?;
            Ok(stream)
        });
        match opened {
            Ok(stream) => flows.push((index, Flow::new(stream, &header))),
            Err(error) => summary.connection(Some(index), 0, 0, vec![error]),
        }
    }
    summary.figure("connect_ms", started.elapsed().as_millis() as u64);
    let (labels, mut flows): (Vec<u64>, Vec<Flow>) = flows.into_iter().unzip();
    let stop = Arc::new(AtomicBool::new(false));
    let mut deadline = None;
    if streaming {
        watch_stdin(Arc::clone(&stop));
        deadline = args
            .seconds
            .map(|seconds| Instant::now() + Duration::from_secs(seconds));
    }
    let transfer = Instant::now();
    let mut streaming_ms = None;
    let mut on_turn = |flows: &[Flow]| {
        if streaming && streaming_ms.is_none() && flows.iter().all(Flow::flowing) {
            streaming_ms = Some(transfer.elapsed().as_millis() as u64);
            announce("streaming");
        }
    };
    run_flows(&mut flows, &stop, deadline, &mut on_turn)?;
    summary.figure("transfer_ms", transfer.elapsed().as_millis() as u64);
    if streaming {
        summary.figure("streaming_ms", streaming_ms);
        if streaming_ms.is_none() {
            summary.error("not every connection moved bytes both ways before the stop".into());
        }
    }
    per_connection_figures(&flows, summary);
    for (label, flow) in labels.into_iter().zip(&flows) {
        summary.connection(
            Some(label),
            flow.sender.sent,
            flow.receiver.verifier.count,
            flow.problems(),
        );
    }
    Ok(())
}

/// The smallest and largest bytes a connection sent and received.
fn per_connection_figures(flows: &[Flow], summary: &mut Summary) {
    let sent = flows.iter().map(|flow| flow.sender.sent);
    let received = flows.iter().map(|flow| flow.receiver.verifier.count);
    summary.figure("sent_min", sent.clone().min().unwrap_or(0));
    summary.figure("sent_max", sent.max().unwrap_or(0));
    summary.figure("received_min", received.clone().min().unwrap_or(0));
    summary.figure("received_max", received.max().unwrap_or(0));
}

// ---------------------------------------------------------------------------
// main.

/// Prints one line on stdout at once (a parent waits for it).
fn announce(line: &str) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn join_cgroup(cgroup: Option<&Path>) -> Result<(), String> {
    let Some(dir) = cgroup else {
        return Ok(());
    };
    std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
        .map_err(|error| format!("joining cgroup {}: {error}", dir.display()))
}

fn parse_server(
    words: impl Iterator<Item = String>,
) -> Result<(SocketAddr, Option<PathBuf>), String> {
    let mut words = words;
    let (mut listen, mut cgroup) = (None, None);
    while let Some(flag) = words.next() {
        let mut value = || words.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => listen = Some(value()?.parse().map_err(|e| format!("--listen: {e}"))?),
            "--cgroup" => cgroup = Some(PathBuf::from(value()?)),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok((listen.ok_or("--listen is required")?, cgroup))
}

fn server_main(words: impl Iterator<Item = String>) -> ExitCode {
    let (listen, cgroup) = match parse_server(words) {
        Ok(parsed) => parsed,
        Err(message) => return usage_error(&message),
    };
    if let Err(message) = join_cgroup(cgroup.as_deref()) {
        eprintln!("streamcheck: {message}");
        return ExitCode::from(2);
    }
    serve(listen)
}

fn client_main(words: impl Iterator<Item = String>) -> ExitCode {
    let args = match parse_client(words) {
        Ok(args) => args,
        Err(message) => return usage_error(&message),
    };
    if let Err(message) = join_cgroup(args.cgroup.as_deref()) {
        eprintln!("streamcheck: {message}");
        return ExitCode::from(2);
    }
    let summary = run_client(&args);
    announce(&serde_json::to_string(&summary).expect("json"));
    if summary.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn usage_error(message: &str) -> ExitCode {
    eprintln!("streamcheck: {message}");
    eprintln!("usage: streamcheck server --listen ADDR:PORT [--cgroup DIR]");
    eprintln!(
        "       streamcheck client --addr ADDR:PORT --mode MODE [--bytes N] [--writes small|large]"
    );
    eprintln!("                  [--connections K] [--seconds S] [--seed S] [--cgroup DIR]");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut words = std::env::args().skip(1);
    match words.next().as_deref() {
        Some("server") => server_main(words),
        Some("client") => client_main(words),
        _ => usage_error("the first argument is server or client"),
    }
}
