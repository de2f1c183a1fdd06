//! many and stream: non-blocking connections in one edge-triggered epoll
//! loop, each moving at most TURN_BUDGET a turn.

use std::{
    collections::VecDeque,
    io::{self, ErrorKind, Read, Write},
    net::{Shutdown, TcpStream},
    os::fd::AsRawFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use crate::{
    IDLE_LIMIT, READ_BUFFER, SLICE, TURN_BUDGET, announce,
    check::{Ending, Receiver, Sender, Verifier, reported_problems},
    client::{ClientArgs, Mode, Summary},
    sockets::{Epoll, connect, no_events},
    stream::{Direction, connection_seed},
    wire::{HEADER_LEN, Header, Role, UNBOUNDED},
};

/// One non-blocking connection of `many` or `stream`.
struct Flow {
    pub stream: TcpStream,
    pub header: [u8; HEADER_LEN],
    header_sent: usize,
    pub sender: Sender,
    pub receiver: Receiver,
    pub down_limit: u64,
    /// Half-closed: the stream is all sent, or stopped.
    shut: bool,
    /// Ahead of its rate: no write until it is due.
    pub paced: bool,
    stopping: bool,
    write_error: Option<String>,
    pub ending: Option<Ending>,
    progress: Instant,
    pub readable: bool,
    writable: bool,
    queued: bool,
}

impl Flow {
    pub fn new(stream: TcpStream, header: &Header) -> Self {
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

    pub fn done(&self) -> bool {
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
pub fn run_flows_mode(args: &ClientArgs, summary: &mut Summary) -> Result<(), String> {
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
