//! blocking-half-close: the client of a request/response protocol that
//! ends its request with a half-close, on a plain blocking socket (no
//! SO_RCVTIMEO, no O_NONBLOCK), as Python's `makefile().read()` or a Rust
//! `read_to_end` does: send the request, shutdown(SHUT_WR), read the
//! answer to EOF. On such a socket a read must block until data or EOF;
//! every EAGAIN it returns is a failure of the kernel's socket semantics,
//! which a real client does not retry. This mode counts them per
//! connection, retries (so that the bytes can still be checked, and the
//! run goes on), and checks that the answer arrived intact.

use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::{Shutdown, SocketAddr, TcpStream},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use crate::{
    CONNECT_TIMEOUT, IDLE_LIMIT,
    blocking::tcp_info,
    check::{Ending, Receiver, Sender, Verifier, reported_problems},
    client::{ClientArgs, Summary},
    stream::{Direction, Writes, mix},
    wire::{Header, Role},
};

/// How many EAGAINs one connection may see before it counts as spinning.
const EAGAIN_LIMIT: u32 = 10_000;

/// What one connection saw.
struct Outcome {
    problems: Vec<String>,
    sent: u64,
    received: u64,
    eagains: u32,
    /// From the half-close to the first EAGAIN.
    first_eagain_ms: Option<u64>,
    /// The socket's TCP state right after the first EAGAIN.
    state_at_first_eagain: Option<&'static str>,
}

pub fn run_blocking_half_close(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
    let mut with_eagain = 0u64;
    let mut eagains = 0u64;
    let mut most = 0u32;
    let mut first_eagain_ms = Vec::new();
    let mut states: BTreeMap<&str, u64> = BTreeMap::new();
    for index in 0..args.connections {
        let mut header = Header::new(Role::Duplex, mix(args.seed ^ index));
        (header.writes, header.up, header.answer_delay_ms) =
            (Writes::Small, args.bytes, args.answer_delay_ms);
        let outcome = one_request(args.addr, &header)?;
        if outcome.eagains > 0 {
            with_eagain += 1;
            summary.error(format!(
                "connection {index}: a blocking read returned EAGAIN {} times",
                outcome.eagains
            ));
        }
        eagains += u64::from(outcome.eagains);
        most = most.max(outcome.eagains);
        first_eagain_ms.extend(outcome.first_eagain_ms);
        if let Some(state) = outcome.state_at_first_eagain {
            *states.entry(state).or_default() += 1;
        }
        summary.connection(
            Some(index),
            outcome.sent,
            outcome.received,
            outcome.problems,
        );
    }
    first_eagain_ms.sort_unstable();
    summary.figure("connections_with_eagain", with_eagain);
    summary.figure("eagain_total", eagains);
    summary.figure("eagain_most_per_connection", most);
    summary.figure(
        "first_eagain_ms_median",
        first_eagain_ms.get(first_eagain_ms.len() / 2).copied(),
    );
    summary.figure("first_eagain_ms_min", first_eagain_ms.first().copied());
    summary.figure("answer_delay_ms", args.answer_delay_ms);
    summary.figure(
        "states_at_first_eagain",
        serde_json::to_value(&states).expect("json"),
    );
    Ok(())
}

/// One connection: the request, the half-close, the answer read to EOF.
/// A watchdog shuts the socket down if it makes no progress for
/// IDLE_LIMIT, so that a blocking call cannot hang the run.
fn one_request(addr: SocketAddr, header: &Header) -> Result<Outcome, String> {
    let stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|error| format!("connect to {addr}: {error}"))?;
    let (done, finished) = mpsc::channel::<()>();
    thread::scope(|scope| {
        let stream = &stream;
        scope.spawn(move || {
            if finished.recv_timeout(IDLE_LIMIT).is_err() {
                let _ = stream.shutdown(Shutdown::Both);
            }
        });
        let outcome = exchange(stream, header);
        let _ = done.send(());
        outcome
    })
}

fn exchange(mut stream: &TcpStream, header: &Header) -> Result<Outcome, String> {
    stream
        .write_all(&header.encode())
        .map_err(|error| format!("header: {error}"))?;
    let mut sender = Sender::new(header.seed, Direction::Up, header.writes, header.up);
    let mut sending_error = None;
    while !sender.pending().is_empty() {
        match stream.write(sender.pending()) {
            Ok(0) => sending_error = Some("write returned 0".to_string()),
            Ok(count) => sender.advance(count),
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(error) => sending_error = Some(format!("write: {error}")),
        }
        if sending_error.is_some() {
            break;
        }
    }
    stream
        .shutdown(Shutdown::Write)
        .map_err(|error| format!("shutdown(SHUT_WR): {error}"))?;
    let half_closed = Instant::now();
    let verifier = Verifier::new(header.seed, Direction::Down, header.down);
    let mut receiver = Receiver::new(verifier, true);
    let reading = read_to_eof(stream, &mut receiver, half_closed);
    let sent = sender.account(sending_error);
    Ok(Outcome {
        problems: reported_problems(&sent, &receiver, &reading.ending, header.down),
        sent: sent.bytes,
        received: receiver.verifier.count,
        eagains: reading.eagains,
        first_eagain_ms: reading.first_eagain.map(|at| at.as_millis() as u64),
        state_at_first_eagain: reading.state_at_first_eagain,
    })
}

/// How the reading ended, and the EAGAINs on the way.
struct Reading {
    ending: Ending,
    eagains: u32,
    first_eagain: Option<Duration>,
    state_at_first_eagain: Option<&'static str>,
}

/// Blocking reads to EOF; an EAGAIN is counted and the read repeated.
fn read_to_eof(mut stream: &TcpStream, receiver: &mut Receiver, half_closed: Instant) -> Reading {
    let mut buffer = [0u8; 4096];
    let mut reading = Reading {
        ending: Ending::Eof,
        eagains: 0,
        first_eagain: None,
        state_at_first_eagain: None,
    };
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return reading,
            Ok(count) => receiver.take(&buffer[..count]),
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error)
                if error.kind() == ErrorKind::WouldBlock && reading.eagains < EAGAIN_LIMIT =>
            {
                reading.eagains += 1;
                if reading.first_eagain.is_none() {
                    reading.first_eagain = Some(half_closed.elapsed());
                    reading.state_at_first_eagain = Some(
                        tcp_info(stream).map_or("unknown", |info| state_name(info.tcpi_state)),
                    );
                }
            }
            Err(error) => {
                reading.ending = Ending::from_error(&error);
                return reading;
            }
        }
    }
}

/// The name of a TCP state of TCP_INFO (include/net/tcp_states.h).
fn state_name(state: u8) -> &'static str {
    const NAMES: [&str; 12] = [
        "unknown",
        "ESTABLISHED",
        "SYN_SENT",
        "SYN_RECV",
        "FIN_WAIT1",
        "FIN_WAIT2",
        "TIME_WAIT",
        "CLOSE",
        "CLOSE_WAIT",
        "LAST_ACK",
        "LISTEN",
        "CLOSING",
    ];
    NAMES.get(usize::from(state)).copied().unwrap_or("unknown")
}
