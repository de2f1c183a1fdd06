//! Closing established connections to a failed backend, so that long-lived
//! watches reconnect (through the VIP) to a healthy one.
//!
//! Uses sock_diag: a dump of the TCP sockets of this network namespace,
//! then SOCK_DESTROY for each one that goes to the backend and that socklb
//! redirected (its cookie is in `REDIRECTS`). A process that dialled the
//! backend directly keeps its connection. The client's socket is aborted
//! with ECONNABORTED, as `ss -K` does.

use std::{
    io,
    net::{IpAddr, SocketAddr},
};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
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

/// Destroys every connection to `backend` whose socket cookie `redirected`
/// accepts. Blocking; run it off the async runtime.
pub fn destroy_redirected(
    backend: SocketAddr,
    redirected: impl Fn(u64) -> bool,
) -> io::Result<SweepReport> {
    let mut report = SweepReport::default();
    let families: &[u8] = match backend.ip() {
        // An IPv6 socket that dialled ::ffff:a.b.c.d is an AF_INET6 socket.
        IpAddr::V4(_) => &[AF_INET, AF_INET6],
        IpAddr::V6(_) => &[AF_INET6],
    };
    for &family in families {
        for (socket_family, id) in dump(family)? {
            if !goes_to(&id, backend) || !redirected(cookie(&id)) {
                continue;
            }
            report.matched += 1;
            match destroy(socket_family, id) {
                Ok(()) => report.destroyed += 1,
                Err(_) => report.failed += 1,
            }
        }
    }
    Ok(report)
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

fn request(family: u8, socket_id: SocketId) -> SockDiagMessage {
    SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states: live_states(),
        socket_id,
    })
}

fn send<T: netlink_packet_core::NetlinkSerializable>(
    socket: &Socket,
    flags: u16,
    payload: T,
) -> io::Result<()> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
    packet.finalize();
    let mut buffer = vec![0; packet.buffer_len()];
    packet.serialize(&mut buffer);
    socket.send(&buffer, 0)?;
    Ok(())
}

fn invalid(error: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, error.to_string())
}

/// Every live TCP socket of one family in this network namespace.
fn dump(family: u8) -> io::Result<Vec<(u8, SocketId)>> {
    let socket = connect()?;
    let empty_id = if family == AF_INET {
        SocketId::new_v4()
    } else {
        SocketId::new_v6()
    };
    send(
        &socket,
        NLM_F_REQUEST | NLM_F_DUMP,
        request(family, empty_id),
    )?;
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
                    sockets.push((response.header.family, response.header.socket_id));
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

fn destroy(family: u8, id: SocketId) -> io::Result<()> {
    let socket = connect()?;
    send(
        &socket,
        NLM_F_REQUEST | NLM_F_ACK,
        SockDiagDestroy::new(request(family, id)),
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
}
