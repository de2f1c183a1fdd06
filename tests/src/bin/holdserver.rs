//! A backend for connection-count tests: accepts every connection and keeps
//! it open, many thousands of them (it raises its open-files limit to the
//! hard limit). Prints the bound address on its first line, then runs
//! until its stdin closes or the bound passes.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener},
    time::{Duration, Instant},
};

use clap::Parser;
use socklb_tests::cli::seconds;

/// Accepts every connection and keeps it open.
#[derive(Debug, Parser)]
#[command(name = "holdserver")]
struct Args {
    /// Where to listen (port 0: any free port; the first line says which).
    #[arg(long)]
    listen: SocketAddr,
    /// The run's bound.
    #[arg(long = "max-seconds", value_name = "S", default_value = "300", value_parser = seconds)]
    max: Duration,
}

fn main() {
    let Args { listen, max } = Args::parse();
    socklb_tests::raise_open_files();
    let listener = TcpListener::bind(listen).unwrap_or_else(|error| {
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
