//! Blocking streams, both sides: a sender thread and a reading loop over
//! one connection.

use std::{
    io::{self, ErrorKind, Read, Write},
    net::{Shutdown, SocketAddr, TcpStream},
    os::fd::AsRawFd,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    thread,
    time::{Duration, Instant},
};

use crate::{
    IDLE_LIMIT, READ_BUFFER,
    check::{Ending, Receiver, Sender, Sent, Verifier},
    sockets::{SplicePipe, connect, is_timeout, recv, write_all_patiently},
    stream::{Direction, Writes, mix},
    wire::{Header, UNBOUNDED},
};

/// Sends the sender's stream until its limit, until `stop` (an unbounded
/// one), or an error; `published` follows the bytes sent.
pub fn send_stream(
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
pub enum ReadMethod {
    Plain,
    Splice(SplicePipe),
    Peek(Peeker),
}

impl ReadMethod {
    pub fn read(&mut self, mut stream: &TcpStream, buffer: &mut [u8]) -> io::Result<usize> {
        match self {
            ReadMethod::Plain => stream.read(buffer),
            ReadMethod::Splice(pipe) => pipe.receive(stream, buffer),
            ReadMethod::Peek(peeker) => peeker.read(stream, buffer),
        }
    }
}

/// Reads in turns of recv(MSG_PEEK) and recv of the same random size, and
/// checks that the second returns what the first showed.
pub struct Peeker {
    pub seed: u64,
    turns: u64,
    pub position: u64,
    peeked: Vec<u8>,
}

impl Peeker {
    pub fn new(seed: u64) -> Self {
        Peeker {
            seed: mix(seed ^ 0x7065_656b),
            turns: 0,
            position: 0,
            peeked: Vec::new(),
        }
    }

    pub fn read(&mut self, stream: &TcpStream, buffer: &mut [u8]) -> io::Result<usize> {
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
pub fn receive_stream(
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
pub struct Exchange {
    pub sent: Sent,
    pub receiver: Receiver,
    pub ending: Ending,
    pub ms: u64,
    pub tcp: TcpCounters,
}

/// How the client side of an exchange reads and when it gives up; `watch`
/// sees the bytes received and sent so far.
pub struct Reading<'a> {
    pub method: ReadMethod,
    pub deadline: Option<Instant>,
    pub holds_report: bool,
    pub watch: &'a mut dyn FnMut(u64, u64),
}

pub fn exchange(
    addr: SocketAddr,
    header: &Header,
    mut reading: Reading,
) -> Result<Exchange, String> {
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
pub struct TcpCounters {
    pub bytes_acked: u64,
    pub bytes_received: u64,
}

fn tcp_counters(stream: &TcpStream) -> TcpCounters {
    let Some(info) = tcp_info(stream) else {
        return TcpCounters::default();
    };
    TcpCounters {
        bytes_acked: info.tcpi_bytes_acked,
        bytes_received: info.tcpi_bytes_received,
    }
}

/// The socket's TCP_INFO, if getsockopt(2) gives it.
pub fn tcp_info(stream: &TcpStream) -> Option<libc::tcp_info> {
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
    (result == 0).then_some(info)
}
