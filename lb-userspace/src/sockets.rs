//! Closing established connections to a failed backend, so that long-lived
//! watches reconnect (through the VIP) to a healthy one.
//!
//! Uses sock_diag: a dump of the TCP sockets of this network namespace that
//! asks the kernel for each socket's record in socklb's socket storage
//! (`INET_DIAG_REQ_SK_BPF_STORAGES`), then SOCK_DESTROY for each one that
//! goes to the backend and that socklb redirected there (its record says
//! so, or, for a socket redirected before an upgrade, the legacy map does).
//! A process that dialled the backend directly keeps its connection. The
//! client's socket is aborted with ECONNABORTED, as `ss -K` does.
//!
//! Why sock_diag and not a BPF socket iterator with `bpf_sock_destroy`:
//! the dump with storages needs Linux 5.2 and no kfunc, which aya-ebpf
//! cannot call yet; it walks the sockets once per failed backend, which is
//! rare, at about a microsecond per socket.

use std::{
    io,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, BorrowedFd},
};

use lb_common::SocketRecord;
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla,
    NlaBuffer, NlasIterator,
};
use netlink_packet_sock_diag::{
    SockDiagDestroy, SockDiagMessage,
    constants::{AF_INET, AF_INET6, IPPROTO_TCP},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_SOCK_DIAG};

/// What one sweep did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Sockets to the backend that socklb had redirected.
    pub matched: usize,
    pub destroyed: usize,
    /// First error of a failed destroy, if any (for the log).
    pub failed: usize,
}

/// The states a destroyable connection can be in (not LISTEN, not
/// TIME_WAIT, which SOCK_DESTROY does not take).
fn live_states() -> StateFlags {
    StateFlags::ESTABLISHED
        | StateFlags::SYN_SENT
        | StateFlags::SYN_RECV
        | StateFlags::FIN_WAIT1
        | StateFlags::FIN_WAIT2
        | StateFlags::CLOSE_WAIT
        | StateFlags::LAST_ACK
        | StateFlags::CLOSING
}

/// One socket of a dump, with its record in socklb's storage if it has one.
struct Dumped {
    family: u8,
    id: SocketId,
    record: Option<SocketRecord>,
    /// Milliseconds since it last sent or received data (from `tcp_info`),
    /// when the dump asked for it.
    idle_ms: Option<u32>,
}

/// Whether a dumped socket goes to `backend` and socklb sent it there.
fn redirected_to(
    dumped: &Dumped,
    backend: SocketAddr,
    target: &lb_common::Endpoint,
    legacy: &impl Fn(u64) -> bool,
) -> bool {
    let redirected = match dumped.record {
        Some(record) => record.backend == *target,
        None => legacy(cookie(&dumped.id)),
    };
    goes_to(&dumped.id, backend) && redirected
}

/// The families whose sockets can go to `backend`: an IPv6 socket that
/// dialled ::ffff:a.b.c.d is an AF_INET6 socket.
fn families_of(backend: SocketAddr) -> &'static [u8] {
    match backend.ip() {
        IpAddr::V4(_) => &[AF_INET, AF_INET6],
        IpAddr::V6(_) => &[AF_INET6],
    }
}

/// Destroys every connection to `backend` that socklb redirected there:
/// one whose record in the storage map `storage` names the backend, or,
/// without one, whose socket cookie `legacy` accepts. Blocking; run it off
/// the async runtime.
pub fn destroy_redirected(
    backend: SocketAddr,
    storage: BorrowedFd<'_>,
    legacy: impl Fn(u64) -> bool,
) -> io::Result<SweepReport> {
    let mut report = SweepReport::default();
    let target = crate::planner::endpoint(&backend);
    for &family in families_of(backend) {
        for dumped in dump(family, storage, false)? {
            if !redirected_to(&dumped, backend, &target, &legacy) {
                continue;
            }
            report.matched += 1;
            match destroy(dumped.family, dumped.id) {
                Ok(()) => report.destroyed += 1,
                Err(_) => report.failed += 1,
            }
        }
    }
    Ok(report)
}

/// Destroys up to `count` of the connections socklb redirected to
/// `backend`, those idle longest first (by `tcp_info`'s last data sent and
/// received), so that requests in flight are the least likely to be cut.
/// Blocking; run it off the async runtime.
pub fn destroy_idlest(
    backend: SocketAddr,
    storage: BorrowedFd<'_>,
    count: usize,
    legacy: impl Fn(u64) -> bool,
) -> io::Result<SweepReport> {
    let target = crate::planner::endpoint(&backend);
    let mut candidates = Vec::new();
    for &family in families_of(backend) {
        candidates.extend(
            dump(family, storage, true)?
                .into_iter()
                .filter(|dumped| redirected_to(dumped, backend, &target, &legacy)),
        );
    }
    let mut report = SweepReport {
        matched: candidates.len(),
        ..SweepReport::default()
    };
    candidates.sort_by_key(|dumped| std::cmp::Reverse(dumped.idle_ms.unwrap_or(0)));
    for dumped in candidates.into_iter().take(count) {
        match destroy(dumped.family, dumped.id) {
            Ok(()) => report.destroyed += 1,
            Err(_) => report.failed += 1,
        }
    }
    Ok(report)
}

/// Offsets in `struct tcp_info` (include/uapi/linux/tcp.h) of
/// `tcpi_last_data_sent` and `tcpi_last_data_recv`, in milliseconds.
const TCPI_LAST_DATA_SENT: usize = 44;
const TCPI_LAST_DATA_RECV: usize = 52;

/// How long a socket has been idle: since it last sent or received data,
/// whichever is more recent.
fn idle_ms(tcp_info: &[u8]) -> Option<u32> {
    let word = |offset: usize| {
        tcp_info
            .get(offset..offset + 4)
            .map(|bytes| u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    };
    Some(word(TCPI_LAST_DATA_SENT)?.min(word(TCPI_LAST_DATA_RECV)?))
}

/// The socket cookie, as the kernel splits it over two native u32 words.
fn cookie(id: &SocketId) -> u64 {
    let low = u32::from_ne_bytes([id.cookie[0], id.cookie[1], id.cookie[2], id.cookie[3]]);
    let high = u32::from_ne_bytes([id.cookie[4], id.cookie[5], id.cookie[6], id.cookie[7]]);
    u64::from(low) | (u64::from(high) << 32)
}

fn goes_to(id: &SocketId, backend: SocketAddr) -> bool {
    if id.destination_port != backend.port() {
        return false;
    }
    match (id.destination_address, backend.ip()) {
        (IpAddr::V6(destination), IpAddr::V4(v4)) => destination == v4.to_ipv6_mapped(),
        (destination, ip) => destination == ip,
    }
}

fn connect() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG)?;
    socket.bind_auto()?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    Ok(socket)
}

fn request(family: u8, socket_id: SocketId, extensions: ExtensionFlags) -> SockDiagMessage {
    SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_TCP,
        extensions,
        states: live_states(),
        socket_id,
    })
}

fn encode<T: netlink_packet_core::NetlinkSerializable>(flags: u16, payload: T) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
    packet.finalize();
    let mut buffer = vec![0; packet.buffer_len()];
    packet.serialize(&mut buffer);
    buffer
}

fn send<T: netlink_packet_core::NetlinkSerializable>(
    socket: &Socket,
    flags: u16,
    payload: T,
) -> io::Result<()> {
    socket.send(&encode(flags, payload), 0)?;
    Ok(())
}

/// `INET_DIAG_REQ_SK_BPF_STORAGES`, in a request (linux/inet_diag.h).
const INET_DIAG_REQ_SK_BPF_STORAGES: u16 = 2;
/// `SK_DIAG_BPF_STORAGE_REQ_MAP_FD`, within it (linux/sock_diag.h).
const SK_DIAG_BPF_STORAGE_REQ_MAP_FD: u16 = 1;
/// `INET_DIAG_SK_BPF_STORAGES`, in a response.
const INET_DIAG_SK_BPF_STORAGES: u16 = 20;
/// `SK_DIAG_BPF_STORAGE`, one storage within it.
const SK_DIAG_BPF_STORAGE: u16 = 1;
/// `SK_DIAG_BPF_STORAGE_MAP_VALUE`, within a storage.
const SK_DIAG_BPF_STORAGE_MAP_VALUE: u16 = 3;
const NLA_F_NESTED: u16 = 1 << 15;
/// The type bits of an attribute's kind (the kernel sets NLA_F_NESTED on
/// nested ones, and the crate leaves the flag in).
const NLA_TYPE_MASK: u16 = 0x3fff;

/// A dump request that also asks for each socket's value in `storage`. The
/// crate has no field for request attributes, so the attribute is appended
/// to its encoding and the message length fixed.
fn dump_request(family: u8, storage: BorrowedFd<'_>, with_info: bool) -> Vec<u8> {
    let empty_id = if family == AF_INET {
        SocketId::new_v4()
    } else {
        SocketId::new_v6()
    };
    let extensions = if with_info {
        ExtensionFlags::INFO
    } else {
        ExtensionFlags::empty()
    };
    let mut message = encode(
        NLM_F_REQUEST | NLM_F_DUMP,
        request(family, empty_id, extensions),
    );
    let fd = (storage.as_raw_fd() as u32).to_ne_bytes();
    let inner_len: u16 = 4 + 4;
    let outer_len: u16 = 4 + inner_len;
    message.extend(outer_len.to_ne_bytes());
    message.extend((INET_DIAG_REQ_SK_BPF_STORAGES | NLA_F_NESTED).to_ne_bytes());
    message.extend(inner_len.to_ne_bytes());
    message.extend(SK_DIAG_BPF_STORAGE_REQ_MAP_FD.to_ne_bytes());
    message.extend(fd);
    let total = (message.len() as u32).to_ne_bytes();
    message[..4].copy_from_slice(&total);
    message
}

/// The record in a response's storage attribute, if there is one of the
/// right size (one storage was asked for).
fn record_of(nlas: &[netlink_packet_sock_diag::inet::nlas::Nla]) -> Option<SocketRecord> {
    let storages = nlas
        .iter()
        .find(|nla| nla.kind() & NLA_TYPE_MASK == INET_DIAG_SK_BPF_STORAGES)?;
    let mut bytes = vec![0u8; storages.value_len()];
    storages.emit_value(&mut bytes);
    let storage = NlasIterator::new(&bytes[..])
        .filter_map(Result::ok)
        .find(|nla: &NlaBuffer<&[u8]>| nla.kind() & NLA_TYPE_MASK == SK_DIAG_BPF_STORAGE)?;
    let value = NlasIterator::new(storage.value())
        .filter_map(Result::ok)
        .find(|nla: &NlaBuffer<&[u8]>| {
            nla.kind() & NLA_TYPE_MASK == SK_DIAG_BPF_STORAGE_MAP_VALUE
        })?;
    let value = value.value();
    if value.len() < std::mem::size_of::<SocketRecord>() {
        return None;
    }
    // SAFETY: the length is checked; SocketRecord is plain integers.
    Some(unsafe { std::ptr::read_unaligned(value.as_ptr().cast::<SocketRecord>()) })
}

fn invalid(error: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, error.to_string())
}

/// Every live TCP socket of one family in this network namespace, with its
/// record in the storage map.
fn dump(family: u8, storage: BorrowedFd<'_>, with_info: bool) -> io::Result<Vec<Dumped>> {
    let socket = connect()?;
    socket.send(&dump_request(family, storage, with_info), 0)?;
    let mut sockets = Vec::new();
    let mut buffer = vec![0u8; 1 << 16];
    // A dump ends with NLMSG_DONE; the bound only guards against a kernel
    // that never sends it.
    for _ in 0..100_000 {
        let size = socket.recv(&mut &mut buffer[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let message = NetlinkMessage::<SockDiagMessage>::deserialize(&buffer[offset..size])
                .map_err(invalid)?;
            let length = message.header.length as usize;
            match message.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                    sockets.push(Dumped {
                        family: response.header.family,
                        id: response.header.socket_id,
                        record: record_of(&response.nlas),
                        idle_ms: response.nlas.iter().find_map(|nla| match nla {
                            netlink_packet_sock_diag::inet::nlas::Nla::TcpInfo(info) => {
                                idle_ms(info)
                            }
                            _ => None,
                        }),
                    });
                }
                NetlinkPayload::Done(_) => return Ok(sockets),
                NetlinkPayload::Error(error) => return Err(error.to_io()),
                _ => {}
            }
            if length == 0 {
                break;
            }
            offset += length;
        }
    }
    Err(invalid("sock_diag dump did not end"))
}

/// Whether the kernel takes SOCK_DESTROY (`CONFIG_INET_DIAG_DESTROY`): a
/// destroy of a socket that does not exist says "no such socket" when it
/// does, "not supported" when it does not.
pub fn destroy_supported() -> bool {
    let mut id = SocketId::new_v4();
    id.source_address = IpAddr::from([127, 0, 0, 1]);
    id.destination_address = IpAddr::from([127, 0, 0, 1]);
    id.source_port = 1;
    id.destination_port = 1;
    match destroy(AF_INET, id) {
        Ok(()) => true,
        Err(error) => error.raw_os_error() != Some(libc::EOPNOTSUPP),
    }
}

fn destroy(family: u8, id: SocketId) -> io::Result<()> {
    let socket = connect()?;
    send(
        &socket,
        NLM_F_REQUEST | NLM_F_ACK,
        SockDiagDestroy::new(request(family, id, ExtensionFlags::empty())),
    )?;
    let mut buffer = vec![0u8; 8192];
    let size = socket.recv(&mut &mut buffer[..], 0)?;
    let message =
        NetlinkMessage::<SockDiagMessage>::deserialize(&buffer[..size]).map_err(invalid)?;
    match message.payload {
        NetlinkPayload::Error(error) if error.code.is_some() => Err(error.to_io()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(destination: &str, port: u16) -> SocketId {
        let mut id = SocketId::new_v6();
        id.destination_address = destination.parse().unwrap();
        id.destination_port = port;
        id
    }

    #[test]
    fn matches_plain_and_mapped_destinations() {
        let backend: SocketAddr = "127.0.0.3:8443".parse().unwrap();
        assert!(goes_to(&id("127.0.0.3", 8443), backend));
        assert!(goes_to(&id("::ffff:127.0.0.3", 8443), backend));
        assert!(!goes_to(&id("127.0.0.3", 8444), backend));
        assert!(!goes_to(&id("127.0.0.4", 8443), backend));
        let v6: SocketAddr = "[::1]:8443".parse().unwrap();
        assert!(goes_to(&id("::1", 8443), v6));
        assert!(!goes_to(&id("::ffff:127.0.0.1", 8443), v6));
    }

    #[test]
    fn cookie_words() {
        let mut socket_id = SocketId::new_v4();
        socket_id.cookie[..4].copy_from_slice(&0x0102_0304u32.to_ne_bytes());
        socket_id.cookie[4..].copy_from_slice(&0x0a0b_0c0du32.to_ne_bytes());
        assert_eq!(cookie(&socket_id), 0x0a0b_0c0d_0102_0304);
    }

    #[test]
    fn idle_time_is_the_more_recent_of_last_send_and_receive() {
        let mut info = vec![0u8; 104];
        info[TCPI_LAST_DATA_SENT..TCPI_LAST_DATA_SENT + 4].copy_from_slice(&700u32.to_ne_bytes());
        info[TCPI_LAST_DATA_RECV..TCPI_LAST_DATA_RECV + 4].copy_from_slice(&300u32.to_ne_bytes());
        assert_eq!(idle_ms(&info), Some(300));
        assert_eq!(idle_ms(&info[..50]), None, "a short tcp_info says nothing");
    }
}
