//! The client: its modes and arguments, its JSON summary, and the run of a
//! mode.

use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Instant, SystemTime},
};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::{
    KIB, MAX_ERRORS, MIB,
    exchanges::{
        run_killed_server, run_rcvlowat, run_reported, run_reset_by_client, run_reset_by_server,
    },
    flows::run_flows_mode,
    half_close::run_blocking_half_close,
    pingpong::run_pingpong,
    stream::{Writes, mix},
    wire::UNBOUNDED,
};

/// What the client checks (see the module documentation of main.rs).
#[derive(Clone, Copy, PartialEq, Debug, clap::ValueEnum)]
pub enum Mode {
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
    BlockingHalfClose,
}

impl Mode {
    /// The mode's name on the command line and in the summary.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Integrity => "integrity",
            Mode::HalfClose => "half-close",
            Mode::ResetByServer => "reset-by-server",
            Mode::ResetByClient => "reset-by-client",
            Mode::KilledServer => "killed-server",
            Mode::Peek => "peek",
            Mode::Rcvlowat => "rcvlowat",
            Mode::Pingpong => "pingpong",
            Mode::Splice => "splice",
            Mode::Many => "many",
            Mode::Stream => "stream",
            Mode::BlockingHalfClose => "blocking-half-close",
        }
    }

    /// `--bytes` by default; None where it does not apply.
    fn default_bytes(self) -> Option<u64> {
        match self {
            Mode::Integrity => Some(256 * MIB),
            Mode::HalfClose | Mode::Peek => Some(MIB),
            Mode::ResetByServer | Mode::ResetByClient | Mode::Many => Some(64 * KIB),
            Mode::Splice => Some(64 * MIB),
            Mode::Pingpong => Some(100_000),
            Mode::BlockingHalfClose => Some(KIB),
            Mode::KilledServer | Mode::Stream | Mode::Rcvlowat => None,
        }
    }

    /// `--connections` by default; None where it does not apply.
    fn default_connections(self) -> Option<u64> {
        match self {
            Mode::Many => Some(1000),
            Mode::Stream => Some(100),
            Mode::BlockingHalfClose => Some(250),
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

pub struct ClientArgs {
    pub addr: SocketAddr,
    pub mode: Mode,
    pub bytes: u64,
    pub writes: Writes,
    pub connections: u64,
    /// The run's bound (killed-server), how long to stream at most
    /// (stream), or an extra bound on the reading (the other modes).
    pub seconds: Option<u64>,
    pub seed: u64,
    /// Bytes per second each side of each connection sends at most
    /// (stream and many; 0: as fast as it can).
    pub rate: u64,
    /// How long the server takes to answer (blocking-half-close).
    pub answer_delay_ms: u64,
}

/// The client's command line: `streamcheck client …`.
#[derive(Debug, clap::Args)]
pub struct ClientFlags {
    /// Where to connect (a VIP, or the server).
    #[arg(long)]
    addr: SocketAddr,
    /// What to check.
    #[arg(long, value_enum)]
    mode: Mode,
    /// Bytes of each direction (messages for pingpong); the mode's default.
    #[arg(long, value_name = "N", value_parser = size)]
    bytes: Option<u64>,
    /// Write sizes: small (1 byte to 4 KiB) or large (1 MiB).
    #[arg(long, value_enum, default_value_t = Writes::Small)]
    writes: Writes,
    /// Connections of many and stream; the mode's default.
    #[arg(long, value_name = "K", value_parser = size)]
    connections: Option<u64>,
    /// The run's bound (killed-server), how long to stream at most
    /// (stream), or an extra bound on the reading (the other modes).
    #[arg(long, value_name = "S", value_parser = size)]
    seconds: Option<u64>,
    /// The seed of the streams; a fresh one by default.
    #[arg(long, value_parser = size)]
    seed: Option<u64>,
    /// Bytes per second each side of each connection sends at most
    /// (stream and many; 0: as fast as it can).
    #[arg(long, value_name = "N", default_value = "0", value_parser = size)]
    rate: u64,
    /// How long the server takes to answer after the client's EOF
    /// (blocking-half-close).
    #[arg(long, value_name = "MS", default_value = "0", value_parser = size)]
    answer_delay_ms: u64,
    /// A cgroup v2 directory to join first.
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
}

impl ClientFlags {
    /// The arguments of a run: the mode's defaults where a flag is not
    /// given; an error for a flag that does not apply to the mode.
    pub fn resolve(self) -> Result<ClientArgs, String> {
        let mode = self.mode;
        let defaults = (mode.default_bytes(), mode.default_connections());
        if self.bytes.is_some() && defaults.0.is_none() {
            return Err(format!("--bytes does not apply to {}", mode.name()));
        }
        if self.connections.is_some() && defaults.1.is_none() {
            return Err(format!(
                "--connections applies to many, stream and blocking-half-close, not {}",
                mode.name()
            ));
        }
        if self.answer_delay_ms != 0 && mode != Mode::BlockingHalfClose {
            return Err(format!(
                "--answer-delay-ms applies to blocking-half-close, not {}",
                mode.name()
            ));
        }
        Ok(ClientArgs {
            addr: self.addr,
            mode,
            bytes: self.bytes.or(defaults.0).unwrap_or(UNBOUNDED),
            writes: self.writes,
            connections: self.connections.or(defaults.1).unwrap_or(1).max(1),
            seconds: self.seconds.or(mode.default_seconds()),
            seed: self.seed.unwrap_or_else(fresh_seed),
            rate: self.rate,
            answer_delay_ms: self.answer_delay_ms,
        })
    }
}

/// A size: digits with an optional k, m or g suffix (KiB, MiB, GiB).
fn size(text: &str) -> Result<u64, String> {
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
        .ok_or_else(|| format!("{text} is not a size"))
}

fn fresh_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64);
    mix(nanos ^ (u64::from(std::process::id()) << 32))
}

/// The client's JSON line.
#[derive(Serialize)]
pub struct Summary {
    pub mode: &'static str,
    pub ok: bool,
    pub connections: u64,
    failed: u64,
    bytes_sent: u64,
    pub bytes_received: u64,
    errors: Vec<String>,
    pub ms: u64,
    pub seed: u64,
    #[serde(flatten)]
    figures: Map<String, Value>,
}

impl Summary {
    pub fn new(args: &ClientArgs) -> Self {
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
    pub fn connection(
        &mut self,
        label: Option<u64>,
        sent: u64,
        received: u64,
        problems: Vec<String>,
    ) {
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

    pub fn error(&mut self, error: String) {
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(error);
        }
    }

    pub fn figure(&mut self, name: &str, value: impl Into<Value>) {
        self.figures.insert(name.into(), value.into());
    }
}

pub fn run_client(args: &ClientArgs) -> Summary {
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
        Mode::BlockingHalfClose => run_blocking_half_close(args, &mut summary),
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

pub fn mib_per_second(bytes: u64, ms: u64) -> f64 {
    let rate = bytes as f64 / MIB as f64 / (ms.max(1) as f64 / 1000.0);
    (rate * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use clap::ValueEnum;

    use super::*;

    #[test]
    fn every_mode_and_write_size_is_named_as_on_the_command_line() {
        for mode in Mode::value_variants() {
            let flag = mode.to_possible_value().expect("a value");
            assert_eq!(flag.get_name(), mode.name());
        }
        for writes in Writes::value_variants() {
            let flag = writes.to_possible_value().expect("a value");
            assert_eq!(flag.get_name(), writes.name());
        }
    }

    #[test]
    fn sizes_take_a_binary_suffix() {
        assert_eq!(size("100"), Ok(100));
        assert_eq!(size("64k"), Ok(64 * KIB));
        assert_eq!(size("256M"), Ok(256 * MIB));
        assert_eq!(size("1g"), Ok(1024 * MIB));
        for bad in ["", "k", "1.5m", "-1", "99999999999999g"] {
            assert!(size(bad).is_err(), "{bad:?}");
        }
    }
}
