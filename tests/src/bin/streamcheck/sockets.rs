//! Socket helpers: options, poll(2), epoll, splice(2), and blocking reads
//! and writes bounded by IDLE_LIMIT without progress.

use std::{
    fs::File,
    io::{self, ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    time::Instant,
};

use crate::{CONNECT_TIMEOUT, IDLE_LIMIT, SLICE, stream::LARGE_WRITE};

pub fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

fn check_size(result: isize) -> io::Result<usize> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result as usize)
    }
}

pub fn set_option(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: setsockopt reads one c_int.
    check(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// SO_LINGER {on, 0}: closing the socket then resets the connection.
pub fn set_linger_zero(stream: &TcpStream) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads one struct linger.
    check(unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    })
    .map(drop)
}

/// Bytes waiting in the socket's receive queue (FIONREAD).
pub fn bytes_waiting(stream: &TcpStream) -> io::Result<usize> {
    let mut count: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int.
    check(unsafe { libc::ioctl(stream.as_raw_fd(), libc::FIONREAD, &mut count) })?;
    Ok(count as usize)
}

/// poll(2) on one descriptor; the events it reports (0 on timeout).
pub fn poll_one(fd: RawFd, events: libc::c_short, timeout_ms: i32) -> io::Result<libc::c_short> {
    let mut entry = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    loop {
        // SAFETY: poll(2) on one pollfd we own.
        match check(unsafe { libc::poll(&mut entry, 1, timeout_ms) }) {
            Ok(_) => return Ok(entry.revents),
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
}

/// recv(2) with flags.
pub fn recv(stream: &TcpStream, buffer: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: recv(2) into a buffer of the length it is given.
    check_size(unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buffer.as_mut_ptr().cast(),
            buffer.len(),
            flags,
        )
    })
}

pub fn is_timeout(error: &io::Error) -> bool {
    matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Blocking calls on the socket return every SLICE, so loops can check
/// their limits.
pub fn prepare_blocking(stream: &TcpStream) -> Result<(), String> {
    stream
        .set_read_timeout(Some(SLICE))
        .and_then(|()| stream.set_write_timeout(Some(SLICE)))
        .map_err(|error| format!("socket timeouts: {error}"))
}

pub fn connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
        .map_err(|error| format!("connect to {addr}: {error}"))?;
    prepare_blocking(&stream)?;
    Ok(stream)
}

/// Writes all of `data` to a blocking socket, with at most IDLE_LIMIT
/// without progress.
pub fn write_all_patiently(mut stream: &TcpStream, mut data: &[u8]) -> Result<(), String> {
    let mut progress = Instant::now();
    while !data.is_empty() {
        match stream.write(data) {
            Ok(0) => return Err("write returned 0".into()),
            Ok(count) => {
                data = &data[count..];
                progress = Instant::now();
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if is_timeout(&error) && progress.elapsed() < IDLE_LIMIT => {}
            Err(error) => return Err(format!("write: {error}")),
        }
    }
    Ok(())
}

/// Reads all of `buffer` from a blocking socket, with at most IDLE_LIMIT
/// without progress.
pub fn read_exact_patiently(mut stream: &TcpStream, buffer: &mut [u8]) -> Result<(), String> {
    let mut filled = 0;
    let mut progress = Instant::now();
    while filled < buffer.len() {
        match stream.read(&mut buffer[filled..]) {
            Ok(0) => return Err(format!("EOF after {filled} of {} bytes", buffer.len())),
            Ok(count) => {
                filled += count;
                progress = Instant::now();
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if is_timeout(&error) && progress.elapsed() < IDLE_LIMIT => {}
            Err(error) => return Err(format!("read: {error}")),
        }
    }
    Ok(())
}

/// Reads a blocking socket to EOF, with at most IDLE_LIMIT without progress.
pub fn read_to_end_patiently(mut stream: &TcpStream) -> Result<Vec<u8>, String> {
    let mut all = Vec::new();
    let mut buffer = [0u8; 4096];
    let mut progress = Instant::now();
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return Ok(all),
            Ok(count) => {
                all.extend_from_slice(&buffer[..count]);
                progress = Instant::now();
            }
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if is_timeout(&error) && progress.elapsed() < IDLE_LIMIT => {}
            Err(error) => return Err(format!("read after {} bytes: {error}", all.len())),
        }
    }
}

/// Writes all of `data` to a non-blocking socket, waiting with poll(2)
/// while it is full.
pub fn write_all_polling(mut stream: &TcpStream, mut data: &[u8]) -> Result<(), String> {
    while !data.is_empty() {
        match stream.write(data) {
            Ok(count) => data = &data[count..],
            Err(error) if error.kind() == ErrorKind::Interrupted => {}
            Err(error) if error.kind() == ErrorKind::WouldBlock => {
                let ready = poll_one(
                    stream.as_raw_fd(),
                    libc::POLLOUT,
                    IDLE_LIMIT.as_millis() as i32,
                )
                .map_err(|error| format!("poll: {error}"))?;
                if ready == 0 {
                    return Err(format!(
                        "the socket stayed full for {} s",
                        IDLE_LIMIT.as_secs()
                    ));
                }
            }
            Err(error) => return Err(format!("write: {error}")),
        }
    }
    Ok(())
}

/// An epoll instance.
pub struct Epoll(OwnedFd);

impl Epoll {
    pub fn new() -> io::Result<Self> {
        // SAFETY: epoll_create1(2); the descriptor is owned at once.
        let fd = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `fd` is a new descriptor nothing else owns.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn add(&self, fd: RawFd, events: libc::c_int, token: u64) -> io::Result<()> {
        let mut event = libc::epoll_event {
            events: events as u32,
            u64: token,
        };
        // SAFETY: epoll_ctl(2) reads one epoll_event.
        check(unsafe { libc::epoll_ctl(self.0.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) })
            .map(drop)
    }

    /// Waits up to `timeout_ms` for events; how many came.
    pub fn wait(&self, events: &mut [libc::epoll_event], timeout_ms: i32) -> io::Result<usize> {
        loop {
            // SAFETY: epoll_wait(2) fills at most `events.len()` entries.
            let ready = unsafe {
                libc::epoll_wait(
                    self.0.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as libc::c_int,
                    timeout_ms,
                )
            };
            match check(ready) {
                Ok(ready) => return Ok(ready as usize),
                Err(error) if error.kind() == ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
    }
}

pub fn no_events<const N: usize>() -> [libc::epoll_event; N] {
    [libc::epoll_event { events: 0, u64: 0 }; N]
}

/// A pipe for splice(2): bytes go through it between a socket and memory.
pub struct SplicePipe {
    pub read: File,
    pub write: File,
    capacity: usize,
    /// Bytes in the pipe that the socket has not taken yet (sending).
    in_pipe: usize,
}

impl SplicePipe {
    pub fn new() -> io::Result<Self> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2(2) writes two descriptors, owned at once.
        check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
        // SAFETY: both are new descriptors nothing else owns.
        let (read, write) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        // 1 MiB, so a large write fits (the unprivileged maximum); a smaller
        // pipe only means more splices.
        // SAFETY: fcntl(2) on our own pipe.
        unsafe {
            libc::fcntl(
                write.as_raw_fd(),
                libc::F_SETPIPE_SZ,
                LARGE_WRITE as libc::c_int,
            )
        };
        // SAFETY: as above.
        let capacity = check(unsafe { libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ) })?;
        Ok(SplicePipe {
            read,
            write,
            capacity: capacity as usize,
            in_pipe: 0,
        })
    }

    /// Sends the start of `data` to the socket through the pipe; how many
    /// bytes the socket took. What it did not take stays in the pipe: the
    /// first bytes of the next call's `data`.
    pub fn send(&mut self, socket: &TcpStream, data: &[u8]) -> io::Result<usize> {
        if self.in_pipe == 0 {
            let take = data.len().min(self.capacity);
            (&self.write).write_all(&data[..take])?;
            self.in_pipe = take;
        }
        let moved = splice(self.read.as_raw_fd(), socket.as_raw_fd(), self.in_pipe)?;
        self.in_pipe -= moved;
        Ok(moved)
    }

    /// Splices what the socket has (up to `buffer`'s size) into the pipe and
    /// reads it out into `buffer`; 0 at EOF.
    pub fn receive(&mut self, socket: &TcpStream, buffer: &mut [u8]) -> io::Result<usize> {
        let moved = splice(
            socket.as_raw_fd(),
            self.write.as_raw_fd(),
            buffer.len().min(self.capacity),
        )?;
        (&self.read).read_exact(&mut buffer[..moved])?;
        Ok(moved)
    }
}

pub fn splice(from: RawFd, to: RawFd, length: usize) -> io::Result<usize> {
    // SAFETY: splice(2) between two descriptors we own, without offsets.
    check_size(unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            length,
            libc::SPLICE_F_MOVE,
        )
    })
}
