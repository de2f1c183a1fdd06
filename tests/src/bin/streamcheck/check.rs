//! Sending a stream and checking a received one, byte by byte, with its
//! SHA-256; how a reading loop ended and what is wrong with it.

use std::{
    io,
    time::{Duration, Instant},
};

use ring::digest::{Context, SHA256};

use crate::{
    stream::{Direction, Writes, fill_stream},
    wire::{NO_MISMATCH, REPORT_LEN, Report, UNBOUNDED, finish_digest},
};

/// One direction's sending side: the stream cut into writes, and the
/// SHA-256 of what went out.
pub struct Sender {
    pub seed: u64,
    sizes_seed: u64,
    pub writes: Writes,
    pub limit: u64,
    /// Bytes the socket took.
    pub sent: u64,
    /// Writes begun.
    started: u64,
    /// The current write and how much of it the socket took.
    chunk: Vec<u8>,
    offset: usize,
    hash: Context,
    /// Bytes per second at most (0: no pacing), from when it first sent.
    pub rate: u64,
    begun: Option<Instant>,
}

impl Sender {
    pub fn new(seed: u64, direction: Direction, writes: Writes, limit: u64) -> Self {
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

    pub fn paced(mut self, rate: u64) -> Self {
        self.rate = rate;
        self
    }

    /// How long to wait before the next write to keep to the rate, if it
    /// is ahead of it.
    pub fn ahead(&mut self) -> Option<Duration> {
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
    pub fn pending(&mut self) -> &[u8] {
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
    pub fn advance(&mut self, count: usize) {
        self.hash
            .update(&self.chunk[self.offset..self.offset + count]);
        self.offset += count;
        self.sent += count as u64;
    }

    pub fn done(&self) -> bool {
        self.sent >= self.limit
    }

    pub fn account(&self, error: Option<String>) -> Sent {
        Sent {
            bytes: self.sent,
            digest: finish_digest(self.hash.clone()),
            error,
        }
    }
}

/// What one side sent, for checking the other side's report.
pub struct Sent {
    pub bytes: u64,
    pub digest: [u8; 32],
    pub error: Option<String>,
}

/// Checks a received stream against the expected one, byte by byte, and
/// hashes it.
pub struct Verifier {
    pub seed: u64,
    pub limit: u64,
    pub count: u64,
    pub mismatch: Option<u64>,
    hash: Context,
}

impl Verifier {
    pub fn new(seed: u64, direction: Direction, limit: u64) -> Self {
        Verifier {
            seed: direction.seed(seed),
            limit,
            count: 0,
            mismatch: None,
            hash: Context::new(&SHA256),
        }
    }

    pub fn feed(&mut self, data: &[u8]) {
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
    pub fn prefix_problem(&self, whose: &str) -> Option<String> {
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

    pub fn digest(&self) -> [u8; 32] {
        finish_digest(self.hash.clone())
    }

    pub fn report(&self, sent: u64) -> Report {
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
pub struct Receiver {
    pub verifier: Verifier,
    pub holds_report: bool,
    held: Vec<u8>,
    /// Every byte received, report included.
    pub raw: u64,
}

impl Receiver {
    pub fn new(verifier: Verifier, holds_report: bool) -> Self {
        Receiver {
            verifier,
            holds_report,
            held: Vec::with_capacity(REPORT_LEN),
            raw: 0,
        }
    }

    pub fn take(&mut self, data: &[u8]) {
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
    pub fn report(&self) -> Option<Report> {
        Report::decode(&self.held)
    }
}

/// How a reading loop ended.
#[derive(Clone, Debug)]
pub enum Ending {
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
    pub fn from_error(error: &io::Error) -> Self {
        if error.raw_os_error() == Some(libc::ECONNRESET) {
            Ending::Reset
        } else {
            Ending::Error(error.to_string())
        }
    }

    pub fn name(&self) -> String {
        match self {
            Ending::Eof => "eof".into(),
            Ending::Reset => "reset".into(),
            Ending::Error(error) => format!("error: {error}"),
            Ending::Stalled(what) => format!("stalled: {what}"),
            Ending::Deadline => "deadline".into(),
        }
    }

    /// The connection ended (rather than hung or ran out of time).
    pub fn ended(&self) -> bool {
        matches!(self, Ending::Eof | Ending::Reset | Ending::Error(_))
    }
}

/// What is wrong with a connection that should have ended with the server's
/// report and EOF, after `down_limit` bytes from the server.
pub fn reported_problems(
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
