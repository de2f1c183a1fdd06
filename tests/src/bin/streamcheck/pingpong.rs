//! pingpong: one byte each way per message, non-blocking with
//! edge-triggered epoll on both ends; a wait of 5 s is a lost wakeup.

use std::{
    io::{ErrorKind, Read},
    net::{Shutdown, TcpStream},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use ring::digest::{Context, SHA256};

use crate::{
    PINGPONG_WAIT_MS,
    check::{Ending, Receiver, Sent, Verifier, reported_problems},
    client::{ClientArgs, Summary},
    sockets::{Epoll, bytes_waiting, connect, no_events, write_all_patiently, write_all_polling},
    stream::{Direction, fill_stream},
    wire::{Header, Role, finish_digest},
};

/// pingpong's waits.
#[derive(Default)]
struct PingStats {
    /// Wakeups that found nothing to read.
    spurious: u64,
    longest_wait: Duration,
}

/// pingpong: one byte out, wait (edge-triggered) for its echo, and again.
pub fn run_pingpong(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
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
pub fn drain(mut stream: &TcpStream, receiver: &mut Receiver) -> Result<bool, String> {
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
