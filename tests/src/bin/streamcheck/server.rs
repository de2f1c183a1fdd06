//! The server: plays its side of each connection on its own thread.

use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    process::ExitCode,
    sync::{
        Condvar, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::{
    IDLE_LIMIT, LOWAT_PART, LOWAT_PAUSE, LOWAT_SETTLE, QUERY_WAIT, THREAD_STACK, announce,
    blocking::{ReadMethod, receive_stream, send_stream},
    check::{Ending, Receiver, Sender, Verifier},
    sockets::{
        Epoll, bytes_waiting, no_events, prepare_blocking, read_exact_patiently,
        read_to_end_patiently, set_linger_zero, write_all_patiently, write_all_polling,
    },
    stream::{Direction, fill_stream},
    wire::{HEADER_LEN, Header, Role},
};

/// The longest a client may ask the server to take to answer.
const ANSWER_DELAY_LIMIT_MS: u64 = 10_000;

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
pub struct VictimEnd {
    /// As `Ending::name`.
    pub end: String,
    pub bytes: u64,
    pub prefix_ok: bool,
    pub problem: Option<String>,
    /// From the last byte read to the end of the connection.
    pub ms_after_last_byte: u64,
}

pub fn serve(listen: SocketAddr) -> ExitCode {
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
    thread::sleep(Duration::from_millis(
        header.answer_delay_ms.min(ANSWER_DELAY_LIMIT_MS),
    ));
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
