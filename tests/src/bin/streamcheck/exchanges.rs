//! The client's modes of one blocking connection: integrity, half-close,
//! splice, peek (one exchange ending with the server's report),
//! killed-server, the two resets, and rcvlowat.

use std::{
    io,
    net::Shutdown,
    os::fd::AsRawFd,
    sync::atomic::{AtomicBool, AtomicU64},
    time::{Duration, Instant},
};

use crate::{
    LOWAT_PART, LOWAT_PAUSE, LOWAT_PROBE_MS, LOWAT_SETTLE, LOWAT_WAKE_LIMIT, RCVLOWAT, RESET_LIMIT,
    announce,
    blocking::{Peeker, ReadMethod, Reading, exchange, receive_stream, send_stream},
    check::{Ending, Receiver, Sender, Verifier, reported_problems},
    client::{ClientArgs, Mode, Summary, mib_per_second},
    server::VictimEnd,
    sockets::{
        SplicePipe, bytes_waiting, connect, poll_one, prepare_blocking, read_exact_patiently,
        read_to_end_patiently, recv, set_linger_zero, set_option, write_all_patiently,
    },
    stream::{Direction, word},
    wire::{Header, Role, UNBOUNDED},
};

/// integrity, half-close, splice, peek: one exchange that ends with the
/// server's report.
pub fn run_reported(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
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
pub fn run_killed_server(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
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
pub fn run_reset_by_server(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
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
pub fn run_reset_by_client(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
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
pub fn run_rcvlowat(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
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
