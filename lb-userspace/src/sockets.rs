//! Closing established connections that socklb redirected to a backend:
//! those to a failed backend, so that long-lived watches reconnect
//! (through the VIP) to a healthy one, and some of those to an overloaded
//! one, to rebalance.
//!
//! Uses sock_diag: a dump of the TCP sockets of this network namespace,
//! filtered in the kernel to the backends' addresses (inet_diag bytecode,
//! `INET_DIAG_REQ_BYTECODE`), that asks for each socket's record in
//! socklb's socket storage (`INET_DIAG_REQ_SK_BPF_STORAGES`), its owner
//! (uid, and cgroup with `INET_DIAG_CGROUP_ID`) and, to rebalance, its
//! `tcp_info`. Then SOCK_DESTROY for each one chosen that socklb redirected
//! there: its record in the socket table (by cookie) says so, or, for a
//! socket redirected before an upgrade, the first layout's LRU or the
//! previous layout's socket storage (whose record the dump carries). A
//! process that dialled the backend directly keeps its connection. The
//! client's socket is aborted with ECONNABORTED, as `ss -K` does.
//!
//! The filter keeps the cost with the backend's own connections: the kernel
//! still walks every socket, but sends and the daemon parses only those to
//! the backends (48,000 unrelated sockets held by a local user cost the
//! unfiltered dump half a CPU while rebalancing). The dump blocks: run it
//! off the async runtime (`spawn_blocking`).
//!
//! Why sock_diag and not a BPF socket iterator with `bpf_sock_destroy`:
//! the dump with storages needs Linux 5.2 and no kfunc, which aya-ebpf
//! cannot call yet.

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

/// Who holds a socket: its cgroup (v2 id; 0 where the kernel does not
/// say) and its uid. Rebalancing closes only the connections of owners
/// that hold more than their share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SocketOwner {
    pub cgroup_id: u64,
    pub uid: u32,
}

impl std::fmt::Display for SocketOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "uid {} in cgroup {}", self.uid, self.cgroup_id)
    }
}

/// One socket of a dump, with its record in socklb's storage if it has one.
struct Dumped {
    family: u8,
    id: SocketId,
    record: Option<SocketRecord>,
    owner: SocketOwner,
    /// Milliseconds since it last sent or received data (from `tcp_info`),
    /// when the dump asked for it.
    idle_ms: Option<u32>,
    /// The socket's inode (what /proc/PID/fd links name).
    inode: u32,
    /// An IPv6 socket that takes IPv6 only (`IPV6_V6ONLY`).
    v6_only: bool,
}

/// A connection socklb redirected to one of the backends a census asked
/// about.
#[derive(Debug, Clone)]
pub struct Redirected {
    family: u8,
    id: SocketId,
    pub backend: SocketAddr,
    pub owner: SocketOwner,
    /// Milliseconds since it last sent or received data (0 unless asked).
    pub idle_ms: u32,
}

/// Closes connections (SOCK_DESTROY): the client's socket fails with
/// ECONNABORTED. One netlink socket serves a whole sweep.
pub struct Closer {
    socket: Socket,
}

impl Closer {
    pub fn new() -> io::Result<Self> {
        Ok(Self { socket: connect()? })
    }

    pub fn destroy(&self, connection: &Redirected) -> io::Result<()> {
        destroy_on(&self.socket, connection.family, connection.id.clone())
    }
}

/// Whether socklb sent a dumped socket to `target`: its record in the
/// socket storage says so, or, without one, `by_cookie` (the socket table,
/// then the first layout's LRU) does.
fn redirected_to(
    dumped: &Dumped,
    target: &lb_common::Endpoint,
    legacy: &impl Fn(u64, &lb_common::Endpoint) -> bool,
) -> bool {
    match dumped.record {
        Some(record) => record.backend == *target,
        None => legacy(cookie(&dumped.id), target),
    }
}

/// The families whose sockets can go to `backend`: an IPv6 socket that
/// dialled ::ffff:a.b.c.d is an AF_INET6 socket.
fn families_of(backend: SocketAddr) -> &'static [u8] {
    match backend.ip() {
        IpAddr::V4(_) => &[AF_INET, AF_INET6],
        IpAddr::V6(_) => &[AF_INET6],
    }
}

/// Every live connection that socklb redirected to one of `backends`,
/// with its owner (and, with `idle`, how long it has been idle). A socket
/// counts as redirected when its record in the storage map `storage`
/// names the backend, or, without one, when `legacy` accepts its cookie
/// for the backend. Only those are kept: the namespace may hold hundreds
/// of thousands of sockets to the backends (any local user can open
/// them), and the daemon's memory must not follow. Blocking; run it off
/// the async runtime.
pub fn census(
    backends: &[SocketAddr],
    storage: BorrowedFd<'_>,
    legacy: impl Fn(u64, &lb_common::Endpoint) -> bool,
    idle: bool,
) -> io::Result<Vec<Redirected>> {
    let mut found = Vec::new();
    for family in [AF_INET, AF_INET6] {
        let wanted: Vec<SocketAddr> = backends
            .iter()
            .copied()
            .filter(|backend| families_of(*backend).contains(&family))
            .collect();
        if wanted.is_empty() {
            continue;
        }
        let filter = destination_filter(&wanted);
        dump_each(family, Some(storage), &filter, idle, |dumped| {
            // The kernel's filter has matched the destination already;
            // this finds which backend, and whether socklb sent it there.
            let Some(backend) = wanted.iter().find(|backend| goes_to(&dumped.id, **backend)) else {
                return;
            };
            if !redirected_to(&dumped, &crate::convert::endpoint(backend), &legacy) {
                return;
            }
            found.push(Redirected {
                family: dumped.family,
                id: dumped.id,
                backend: *backend,
                owner: dumped.owner,
                idle_ms: dumped.idle_ms.unwrap_or(0),
            });
        })?;
    }
    Ok(found)
}

/// Destroys every connection to `backend` that socklb redirected there
/// (see [`census`]). Blocking; run it off the async runtime.
pub fn destroy_redirected(
    backend: SocketAddr,
    storage: BorrowedFd<'_>,
    legacy: impl Fn(u64, &lb_common::Endpoint) -> bool,
) -> io::Result<SweepReport> {
    let mut report = SweepReport::default();
    let closer = Closer::new()?;
    for connection in census(&[backend], storage, legacy, false)? {
        report.matched += 1;
        match closer.destroy(&connection) {
            Ok(()) => report.destroyed += 1,
            Err(_) => report.failed += 1,
        }
    }
    Ok(report)
}

/// `inet_diag_bc_op.code`s (linux/inet_diag.h).
const INET_DIAG_BC_JMP: u8 = 1;
const INET_DIAG_BC_D_COND: u8 = 8;
/// An op is 4 bytes (code, yes, no); a host condition adds 8 (family,
/// prefix length, padding, port) and the address.
const BC_OP_LEN: usize = 4;
const HOSTCOND_LEN: usize = 8;

/// inet_diag bytecode that accepts a socket whose destination is one of
/// `backends` (address and port): one host condition per backend, joined
/// by jumps, as `ss` compiles `dst A or dst B`. An IPv4 condition also
/// matches an IPv6 socket to the mapped address (the kernel's rule).
///
/// Each condition jumps on a match (`yes`) to the next op, a jump to the
/// end (accept), and on a miss (`no`) past that jump to the next
/// condition; the last one falls off the end (accept) or 4 bytes past it
/// (reject).
pub fn destination_filter(backends: &[SocketAddr]) -> Vec<u8> {
    let conditions: Vec<Vec<u8>> = backends.iter().map(host_condition).collect();
    let mut code = Vec::new();
    for (index, condition) in conditions.iter().enumerate() {
        let length = condition.len();
        let last = index + 1 == conditions.len();
        code.push(INET_DIAG_BC_D_COND);
        code.push(length as u8);
        code.extend(((length + BC_OP_LEN) as u16).to_ne_bytes());
        code.extend(&condition[BC_OP_LEN..]);
        if !last {
            let rest: usize = conditions[index + 1..]
                .iter()
                .map(|condition| condition.len() + BC_OP_LEN)
                .sum::<usize>()
                - BC_OP_LEN;
            code.push(INET_DIAG_BC_JMP);
            code.push(BC_OP_LEN as u8);
            code.extend(((rest + BC_OP_LEN) as u16).to_ne_bytes());
        }
    }
    code
}

/// One destination condition, op header included (its jumps zero).
fn host_condition(backend: &SocketAddr) -> Vec<u8> {
    let (family, address): (u8, Vec<u8>) = match backend.ip() {
        IpAddr::V4(ip) => (AF_INET, ip.octets().to_vec()),
        IpAddr::V6(ip) => (AF_INET6, ip.octets().to_vec()),
    };
    let mut condition = Vec::with_capacity(BC_OP_LEN + HOSTCOND_LEN + address.len());
    condition.extend([0u8; BC_OP_LEN]);
    condition.push(family);
    // The whole address: prefix length in bits.
    condition.push((address.len() * 8) as u8);
    condition.extend([0, 0]);
    // The port in host order, as `int port` (-1: any).
    condition.extend(i32::from(backend.port()).to_ne_bytes());
    condition.extend(address);
    condition
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

fn request(
    family: u8,
    socket_id: SocketId,
    extensions: ExtensionFlags,
    states: StateFlags,
) -> SockDiagMessage {
    SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_TCP,
        extensions,
        states,
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

/// `INET_DIAG_REQ_BYTECODE`, in a request (linux/inet_diag.h).
const INET_DIAG_REQ_BYTECODE: u16 = 1;
/// `INET_DIAG_REQ_SK_BPF_STORAGES`, in a request (linux/inet_diag.h).
const INET_DIAG_REQ_SK_BPF_STORAGES: u16 = 2;
/// `SK_DIAG_BPF_STORAGE_REQ_MAP_FD`, within it (linux/sock_diag.h).
const SK_DIAG_BPF_STORAGE_REQ_MAP_FD: u16 = 1;
/// `INET_DIAG_SK_BPF_STORAGES`, in a response.
const INET_DIAG_SK_BPF_STORAGES: u16 = 20;
/// `INET_DIAG_CGROUP_ID`, in a response (Linux 5.9).
const INET_DIAG_CGROUP_ID: u16 = 21;
/// `SK_DIAG_BPF_STORAGE`, one storage within it.
const SK_DIAG_BPF_STORAGE: u16 = 1;
/// `SK_DIAG_BPF_STORAGE_MAP_VALUE`, within a storage.
const SK_DIAG_BPF_STORAGE_MAP_VALUE: u16 = 3;
const NLA_F_NESTED: u16 = 1 << 15;
/// The type bits of an attribute's kind (the kernel sets NLA_F_NESTED on
/// nested ones, and the crate leaves the flag in).
const NLA_TYPE_MASK: u16 = 0x3fff;

/// Appends one attribute (kind, value) to a netlink message.
fn push_attribute(message: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let length = (4 + value.len()) as u16;
    message.extend(length.to_ne_bytes());
    message.extend(kind.to_ne_bytes());
    message.extend(value);
    // Attributes start on 4-byte boundaries.
    message.resize(message.len().next_multiple_of(4), 0);
}

/// A dump request, filtered by `filter` (inet_diag bytecode; empty: none),
/// that also asks for each socket's value in `storage`, if given. The
/// crate has no field for
/// request attributes, so they are appended to its encoding and the
/// message length fixed.
fn dump_request(
    family: u8,
    states: StateFlags,
    storage: Option<BorrowedFd<'_>>,
    filter: &[u8],
    with_info: bool,
) -> Vec<u8> {
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
        request(family, empty_id, extensions, states),
    );
    if let Some(storage) = storage {
        let mut map_fd = Vec::new();
        push_attribute(
            &mut map_fd,
            SK_DIAG_BPF_STORAGE_REQ_MAP_FD,
            &(storage.as_raw_fd() as u32).to_ne_bytes(),
        );
        push_attribute(
            &mut message,
            INET_DIAG_REQ_SK_BPF_STORAGES | NLA_F_NESTED,
            &map_fd,
        );
    }
    if !filter.is_empty() {
        push_attribute(&mut message, INET_DIAG_REQ_BYTECODE, filter);
    }
    let total = (message.len() as u32).to_ne_bytes();
    message[..4].copy_from_slice(&total);
    message
}

/// The cgroup id a response carries, if the kernel sends it.
fn cgroup_of(nlas: &[netlink_packet_sock_diag::inet::nlas::Nla]) -> Option<u64> {
    let attribute = nlas
        .iter()
        .find(|nla| nla.kind() & NLA_TYPE_MASK == INET_DIAG_CGROUP_ID)?;
    let mut bytes = [0u8; 8];
    if attribute.value_len() != bytes.len() {
        return None;
    }
    attribute.emit_value(&mut bytes);
    Some(u64::from_ne_bytes(bytes))
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

/// Hands `each` every live TCP socket of one family in this network
/// namespace that `filter` accepts, with its record in the storage map (if
/// given) and its owner, as the kernel sends them: memory bounded by one
/// receive buffer, however many sockets the namespace holds.
fn dump_each(
    family: u8,
    storage: Option<BorrowedFd<'_>>,
    filter: &[u8],
    with_info: bool,
    each: impl FnMut(Dumped),
) -> io::Result<()> {
    receive_dump(
        &dump_request(family, live_states(), storage, filter, with_info),
        each,
    )
}

/// Sends a dump request and hands `each` every socket of the answer.
fn receive_dump(request: &[u8], mut each: impl FnMut(Dumped)) -> io::Result<()> {
    let socket = connect()?;
    socket.send(request, 0)?;
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
                    each(dumped(*response));
                }
                NetlinkPayload::Done(_) => return Ok(()),
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

/// Keeps in `cookies` only those of no live TCP socket of this network
/// namespace (both families): what the sweep of the socket table asks.
/// With `destinations`, the kernel reports only the sockets connected to
/// one of them (the filter of the rebalancer's close step), so the dump
/// costs what socklb's own sockets cost, not what the namespace holds.
/// Memory stays bounded by `cookies`. Blocking.
pub fn retain_gone(
    cookies: &mut std::collections::HashSet<u64>,
    destinations: Option<&[SocketAddr]>,
) -> io::Result<()> {
    let filter = destinations.map(destination_filter).unwrap_or_default();
    for family in [AF_INET, AF_INET6] {
        dump_each(family, None, &filter, false, |dumped| {
            cookies.remove(&cookie(&dumped.id));
        })?;
    }
    Ok(())
}

/// How many live TCP sockets of this network namespace hold a record in
/// the socket storage map `storage`. Blocking.
pub fn sockets_with_storage(storage: BorrowedFd<'_>) -> io::Result<usize> {
    let mut count = 0;
    for family in [AF_INET, AF_INET6] {
        dump_each(family, Some(storage), &[], false, |dumped| {
            count += usize::from(dumped.record.is_some());
        })?;
    }
    Ok(count)
}

/// A TCP socket listening in this network namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Listening {
    /// The address it is bound to (an unspecified address for a wildcard).
    pub addr: SocketAddr,
    /// An IPv6 socket that takes IPv6 only: a wildcard one then does not
    /// take IPv4 connects.
    pub v6_only: bool,
}

/// The listening TCP sockets of this network namespace (both families)
/// that `wanted` keeps, each address once, leaving out those whose inode
/// `skip` names. The kernel walks only its table of listening sockets;
/// memory is bounded by what `wanted` keeps (a local user may bind many
/// addresses). Blocking.
pub fn listening(
    wanted: impl Fn(&Listening) -> bool,
    skip: impl Fn(u32) -> bool,
) -> io::Result<Vec<Listening>> {
    let mut found: Vec<Listening> = Vec::new();
    for family in [AF_INET, AF_INET6] {
        let request = dump_request(family, StateFlags::LISTEN, None, &[], false);
        receive_dump(&request, |dumped| {
            let listening = Listening {
                addr: SocketAddr::new(dumped.id.source_address, dumped.id.source_port),
                v6_only: dumped.v6_only,
            };
            if wanted(&listening) && !skip(dumped.inode) && !found.contains(&listening) {
                found.push(listening);
            }
        })?;
    }
    Ok(found)
}

/// What a dump's response says of one socket.
fn dumped(response: netlink_packet_sock_diag::inet::InetResponse) -> Dumped {
    let idle_ms = response.nlas.iter().find_map(|nla| match nla {
        netlink_packet_sock_diag::inet::nlas::Nla::TcpInfo(info) => idle_ms(info),
        _ => None,
    });
    let v6_only = response.nlas.iter().any(|nla| {
        matches!(
            nla,
            netlink_packet_sock_diag::inet::nlas::Nla::SkV6Only(true)
        )
    });
    Dumped {
        family: response.header.family,
        owner: SocketOwner {
            cgroup_id: cgroup_of(&response.nlas).unwrap_or(0),
            uid: response.header.uid,
        },
        record: record_of(&response.nlas),
        idle_ms,
        inode: response.header.inode,
        v6_only,
        id: response.header.socket_id,
    }
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
    destroy_on(&connect()?, family, id)
}

/// One SOCK_DESTROY on `socket`, and its acknowledgement.
fn destroy_on(socket: &Socket, family: u8, id: SocketId) -> io::Result<()> {
    send(
        socket,
        NLM_F_REQUEST | NLM_F_ACK,
        SockDiagDestroy::new(request(family, id, ExtensionFlags::empty(), live_states())),
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

    /// The kernel's walk of inet_diag bytecode (net/ipv4/inet_diag.c,
    /// `inet_diag_bc_run` for JMP and D_COND, and the jump checks of
    /// `inet_diag_bc_audit`), on one destination.
    fn kernel_accepts(code: &[u8], family: u8, destination: SocketAddr) -> bool {
        let (mut at, mut left) = (0usize, code.len() as i64);
        while left > 0 {
            let (op, yes, no) = (
                code[at],
                code[at + 1] as i64,
                u16::from_ne_bytes([code[at + 2], code[at + 3]]) as i64,
            );
            assert!(
                yes >= 4 && yes % 4 == 0 && yes <= left + 4,
                "audit: yes {yes}"
            );
            assert!(no >= 4 && no % 4 == 0 && no <= left + 4, "audit: no {no}");
            let matched = match op {
                INET_DIAG_BC_JMP => false,
                INET_DIAG_BC_D_COND => {
                    let cond_family = code[at + 4];
                    let prefix = code[at + 5] as usize;
                    let port = i32::from_ne_bytes(code[at + 8..at + 12].try_into().unwrap());
                    let address = &code[at + 12..at + 12 + prefix / 8];
                    let port_ok = port == -1 || port == i32::from(destination.port());
                    let bytes: Vec<u8> = match destination.ip() {
                        IpAddr::V4(ip) => ip.octets().to_vec(),
                        IpAddr::V6(ip) => ip.octets().to_vec(),
                    };
                    let address_ok = if cond_family == family {
                        bytes[..address.len()] == *address
                    } else {
                        // An AF_INET condition on an AF_INET6 socket: the
                        // mapped address.
                        family == AF_INET6
                            && cond_family == AF_INET
                            && bytes[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]
                            && bytes[12..] == *address
                    };
                    port_ok && address_ok
                }
                other => panic!("unexpected op {other}"),
            };
            let jump = if matched { yes } else { no };
            at += jump as usize;
            left -= jump;
        }
        left == 0
    }

    #[test]
    fn the_filter_accepts_exactly_the_backends() {
        let backends: Vec<SocketAddr> = ["127.0.0.2:8443", "127.0.0.3:8443", "[fd00::7]:443"]
            .iter()
            .map(|text| text.parse().unwrap())
            .collect();
        // (what, dump family, destination, accepted)
        let cases = [
            ("first backend", AF_INET, "127.0.0.2:8443", true),
            ("second backend", AF_INET, "127.0.0.3:8443", true),
            (
                "its address, another port",
                AF_INET,
                "127.0.0.3:8444",
                false,
            ),
            ("another address", AF_INET, "127.0.0.4:8443", false),
            (
                "mapped IPv4 backend",
                AF_INET6,
                "[::ffff:127.0.0.3]:8443",
                true,
            ),
            (
                "mapped other address",
                AF_INET6,
                "[::ffff:127.0.0.9]:8443",
                false,
            ),
            ("IPv6 backend", AF_INET6, "[fd00::7]:443", true),
            ("IPv6 other port", AF_INET6, "[fd00::7]:444", false),
            ("IPv6 other address", AF_INET6, "[fd00::8]:443", false),
        ];
        let code = destination_filter(&backends);
        for (what, family, destination, expected) in cases {
            let destination: SocketAddr = destination.parse().unwrap();
            assert_eq!(
                kernel_accepts(&code, family, destination),
                expected,
                "{what}"
            );
        }
        let one = destination_filter(&backends[..1]);
        assert_eq!(
            one.len(),
            16,
            "one IPv4 condition: op, host condition, address"
        );
        assert!(kernel_accepts(&one, AF_INET, backends[0]));
        assert!(!kernel_accepts(&one, AF_INET, backends[1]));
    }
}
