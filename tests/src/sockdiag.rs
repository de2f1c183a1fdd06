//! The kernel's own view of TCP sockets, through sock_diag, for the soak's
//! checks: where a client's connect really went (the connect hook
//! rewrote the destination; getpeername shows the VIP, the kernel's socket
//! does not), and which sockets of a cgroup are open to which backend.
//!
//! This reads only the kernel's socket tables, never socklb's maps: it is
//! the independent side of the soak's comparisons. socklb's own dump
//! (`socklb::sockets`) asks for its socket records and closes sockets; this
//! one asks for neither.

use std::{
    io,
    net::{IpAddr, SocketAddr},
};

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::{
    SockDiagMessage,
    constants::{AF_INET, IPPROTO_TCP},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags, nlas::Nla},
};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_SOCK_DIAG};

/// `INET_DIAG_CGROUP_ID` (linux/inet_diag.h, Linux 5.7): the cgroup v2 id
/// of the socket's creator, in every full socket's dump entry.
const INET_DIAG_CGROUP_ID: u16 = 21;

/// TCP states in which the connect hook's sock_ops counts a connection
/// live: from ACTIVE_ESTABLISHED until the socket reaches TCP_CLOSE (a
/// socket moving to TIME_WAIT is closed and replaced by a timewait entry).
pub const LIVE_STATES: [u8; 6] = [
    1,  // ESTABLISHED
    4,  // FIN_WAIT1
    5,  // FIN_WAIT2
    8,  // CLOSE_WAIT
    9,  // LAST_ACK
    11, // CLOSING
];

/// `INET_DIAG_REQ_SK_BPF_STORAGES` (request) and, nested in it,
/// `SK_DIAG_BPF_STORAGE_REQ_MAP_FD`; `INET_DIAG_SK_BPF_STORAGES` in a
/// response (linux/inet_diag.h, linux/sock_diag.h).
const INET_DIAG_REQ_SK_BPF_STORAGES: u16 = 2;
const SK_DIAG_BPF_STORAGE_REQ_MAP_FD: u16 = 1;
const INET_DIAG_SK_BPF_STORAGES: u16 = 20;
const NLA_F_NESTED: u16 = 1 << 15;
const NLA_TYPE_MASK: u16 = 0x3fff;

/// One socket of a dump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpedSocket {
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub state: u8,
    /// None for a timewait entry (it has no cgroup).
    pub cgroup_id: Option<u64>,
    /// The socket has a value in the socket-storage map the dump asked
    /// about (`dump_v4_with_storage`).
    pub has_storage: bool,
}

impl DumpedSocket {
    /// Counted live by socklb's sock_ops: a full socket in a live state.
    pub fn is_live(&self) -> bool {
        self.cgroup_id.is_some() && LIVE_STATES.contains(&self.state)
    }
}

fn open() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    Ok(socket)
}

fn encode(flags: u16, request: InetRequest) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    let mut packet = NetlinkMessage::new(
        header,
        NetlinkPayload::InnerMessage(SockDiagMessage::InetRequest(request)),
    );
    packet.finalize();
    let mut buffer = vec![0; packet.buffer_len()];
    packet.serialize(&mut buffer);
    buffer
}

fn invalid(error: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, error.to_string())
}

fn cgroup_of(nlas: &[Nla]) -> Option<u64> {
    nlas.iter().find_map(|nla| match nla {
        Nla::Other(other) if netlink_packet_core::Nla::kind(other) == INET_DIAG_CGROUP_ID => {
            let mut bytes = [0u8; 8];
            if netlink_packet_core::Nla::value_len(other) != 8 {
                return None;
            }
            netlink_packet_core::Nla::emit_value(other, &mut bytes);
            Some(u64::from_ne_bytes(bytes))
        }
        _ => None,
    })
}

/// Sends one request and collects every socket it answers, until the
/// dump ends (or, for an exact lookup, the one answer or its error).
fn exchange(socket: &Socket, message: &[u8], dump: bool) -> io::Result<Vec<DumpedSocket>> {
    socket.send(message, 0)?;
    let mut sockets = Vec::new();
    let mut buffer = vec![0u8; 1 << 16];
    // A dump ends with NLMSG_DONE; the bound guards against one that never
    // does (each read carries many entries).
    for _ in 0..100_000 {
        let size = socket.recv(&mut &mut buffer[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let message = NetlinkMessage::<SockDiagMessage>::deserialize(&buffer[offset..size])
                .map_err(invalid)?;
            let length = message.header.length as usize;
            match message.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                    let id = &response.header.socket_id;
                    sockets.push(DumpedSocket {
                        local: SocketAddr::new(id.source_address, id.source_port),
                        peer: SocketAddr::new(id.destination_address, id.destination_port),
                        state: response.header.state,
                        cgroup_id: cgroup_of(&response.nlas),
                        has_storage: response.nlas.iter().any(|nla| {
                            netlink_packet_core::Nla::kind(nla) & NLA_TYPE_MASK
                                == INET_DIAG_SK_BPF_STORAGES
                        }),
                    });
                    if !dump {
                        return Ok(sockets);
                    }
                }
                NetlinkPayload::Done(_) => return Ok(sockets),
                NetlinkPayload::Error(error) => {
                    // An exact lookup of a socket that is not there.
                    return if !dump && error.raw_code().abs() == libc::ENOENT {
                        Ok(sockets)
                    } else {
                        Err(error.to_io())
                    };
                }
                _ => {}
            }
            if length == 0 {
                break;
            }
            offset += length;
        }
    }
    Err(invalid("sock_diag did not end its answer"))
}

/// Every IPv4 TCP socket of this network namespace but listeners.
pub fn dump_v4() -> io::Result<Vec<DumpedSocket>> {
    let request = InetRequest {
        family: AF_INET,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::all() & !StateFlags::LISTEN,
        socket_id: SocketId::new_v4(),
    };
    exchange(&open()?, &encode(NLM_F_REQUEST | NLM_F_DUMP, request), true)
}

/// Like `dump_v4`, also asking for each socket's value in the
/// socket-storage map `storage` (`BPF_MAP_TYPE_SK_STORAGE`). The crate has
/// no field for request attributes: the attribute is appended to its
/// encoding and the message length fixed, as socklb's own dump does.
pub fn dump_v4_with_storage(storage: std::os::fd::BorrowedFd<'_>) -> io::Result<Vec<DumpedSocket>> {
    use std::os::fd::AsRawFd;
    let request = InetRequest {
        family: AF_INET,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::all() & !StateFlags::LISTEN,
        socket_id: SocketId::new_v4(),
    };
    let mut message = encode(NLM_F_REQUEST | NLM_F_DUMP, request);
    let inner_len: u16 = 4 + 4;
    message.extend((4 + inner_len).to_ne_bytes());
    message.extend((INET_DIAG_REQ_SK_BPF_STORAGES | NLA_F_NESTED).to_ne_bytes());
    message.extend(inner_len.to_ne_bytes());
    message.extend(SK_DIAG_BPF_STORAGE_REQ_MAP_FD.to_ne_bytes());
    message.extend((storage.as_raw_fd() as u32).to_ne_bytes());
    let total = (message.len() as u32).to_ne_bytes();
    message[..4].copy_from_slice(&total);
    exchange(&open()?, &message, true)
}

/// The socket cookie of a socket (`SO_COOKIE`).
pub fn cookie_of(socket: std::os::fd::BorrowedFd<'_>) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    let mut cookie: u64 = 0;
    let mut size = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt(2) into a u64 we own, with its size.
    let done = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&raw mut cookie).cast(),
            &mut size,
        )
    };
    if done != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// An open sock_diag socket for many exact lookups.
pub struct Lookup {
    socket: Socket,
}

impl Lookup {
    pub fn new() -> io::Result<Self> {
        Ok(Self { socket: open()? })
    }

    /// Where the socket with this cookie, bound to `local`, really goes:
    /// the one of `candidates` for which the kernel has that socket
    /// (local, candidate), in any state but LISTEN. The cookie tells it
    /// from another socket on the same local port (the kernel shares an
    /// ephemeral port between connections to different destinations).
    /// One hash lookup per candidate, so that a client can ask for each of
    /// its connects (a dump walks every bucket of the socket hash).
    pub fn destination(
        &self,
        local: SocketAddr,
        cookie: u64,
        candidates: &[SocketAddr],
    ) -> io::Result<Option<SocketAddr>> {
        // The kernel splits the cookie in two native u32 words.
        let mut cookie_words = [0u8; 8];
        cookie_words[..4].copy_from_slice(&(cookie as u32).to_ne_bytes());
        cookie_words[4..].copy_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
        for candidate in candidates {
            let (IpAddr::V4(_), IpAddr::V4(_)) = (local.ip(), candidate.ip()) else {
                continue;
            };
            let request = InetRequest {
                family: AF_INET,
                protocol: IPPROTO_TCP,
                extensions: ExtensionFlags::empty(),
                states: StateFlags::all() & !StateFlags::LISTEN,
                socket_id: SocketId {
                    source_port: local.port(),
                    destination_port: candidate.port(),
                    source_address: local.ip(),
                    destination_address: candidate.ip(),
                    interface_id: 0,
                    cookie: cookie_words,
                },
            };
            let found = exchange(&self.socket, &encode(NLM_F_REQUEST, request), false)?;
            if found
                .iter()
                .any(|socket| socket.local == local && socket.peer == *candidate)
            {
                return Ok(Some(*candidate));
            }
        }
        Ok(None)
    }
}
