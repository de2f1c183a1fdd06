//! A backend for connection-count tests: accepts every connection and keeps
//! it open, many thousands of them (it raises its open-files limit to the
//! hard limit). Prints the bound address on its first line, then runs
//! until its stdin closes or the bound passes.
//!
//! Usage: holdserver --listen IP:PORT [--max-seconds S]

use std::{
    io::{Read, Write},
    net::TcpListener,
    time::{Duration, Instant},
};

fn main() {
    let mut listen = None;
    let mut max = Duration::from_secs(300);
    let mut words = std::env::args().skip(1);
    while let Some(flag) = words.next() {
        match flag.as_str() {
            "--listen" => listen = words.next(),
            "--max-seconds" => {
                max = Duration::from_secs(words.next().and_then(|s| s.parse().ok()).unwrap_or(300))
            }
            other => {
                eprintln!("holdserver: unknown argument {other}");
                std::process::exit(2);
            }
        }
    }
    let Some(listen) = listen else {
        eprintln!("holdserver: --listen IP:PORT is required");
        std::process::exit(2);
    };
    socklb_tests::raise_open_files();
    let listener = TcpListener::bind(&listen).unwrap_or_else(|error| {
        eprintln!("holdserver: listening on {listen}: {error}");
        std::process::exit(1);
    });
    // std listens with a backlog of 128; a burst of thousands of connects
    // would overflow it and turn into retried or reset SYNs. listen(2)
    // again raises it (the kernel caps it at net.core.somaxconn).
    // SAFETY: listen(2) on the listener's own descriptor.
    unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&listener), 65_535) };
    let addr = listener.local_addr().expect("bound address");
    println!("{addr}");
    let _ = std::io::stdout().flush();
    // The parent closing our stdin ends the run.
    let (done_tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = [0u8; 64];
        while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
        let _ = done_tx.send(());
    });
    listener.set_nonblocking(true).expect("nonblocking");
    let started = Instant::now();
    let mut held = Vec::new();
    while started.elapsed() < max && done.try_recv().is_err() {
        // Accept everything queued, then rest a moment.
        while let Ok((stream, _)) = listener.accept() {
            held.push(stream);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
