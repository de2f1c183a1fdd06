//! The userspace boundary of the kernel's types: socket addresses to the
//! endpoints the maps hold (network byte order) and back, and text to the
//! fixed NUL-padded fields of the records and back. Every conversion
//! happens here, once.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use lb_common::{Endpoint, FAMILY_V4, FAMILY_V6};

/// The family constant of an address.
pub fn family_of(addr: &SocketAddr) -> u8 {
    if addr.is_ipv4() { FAMILY_V4 } else { FAMILY_V6 }
}

/// A socket address as the kernel sees it: network byte order.
pub fn endpoint(addr: &SocketAddr) -> Endpoint {
    let port_be = addr.port().to_be();
    match addr.ip() {
        IpAddr::V4(ip) => Endpoint::v4(u32::from_ne_bytes(ip.octets()), port_be),
        IpAddr::V6(ip) => {
            let octets = ip.octets();
            let word = |i: usize| {
                u32::from_ne_bytes([octets[i], octets[i + 1], octets[i + 2], octets[i + 3]])
            };
            Endpoint::v6([word(0), word(4), word(8), word(12)], port_be)
        }
    }
}

/// The inverse of [`endpoint`]; `None` for a malformed family.
pub fn socket_addr(endpoint: &Endpoint) -> Option<SocketAddr> {
    let port = u16::from_be(endpoint.port_be);
    match endpoint.family {
        FAMILY_V4 => Some(SocketAddr::from((endpoint.addr_be[0].to_ne_bytes(), port))),
        FAMILY_V6 => {
            let mut octets = [0u8; 16];
            for (chunk, word) in octets.chunks_mut(4).zip(endpoint.addr_be) {
                chunk.copy_from_slice(&word.to_ne_bytes());
            }
            Some(SocketAddr::from((octets, port)))
        }
        _ => None,
    }
}

/// Bytes in a fixed field of `N` bytes, NUL padded, cut if longer (the last
/// byte always stays NUL, as the kernel's C readers expect).
pub fn nul_padded<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut field = [0u8; N];
    let length = bytes.len().min(N.saturating_sub(1));
    field[..length].copy_from_slice(&bytes[..length]);
    field
}

/// The text of a NUL-padded field: up to its first NUL.
pub fn nul_terminated(field: &[u8]) -> String {
    let end = field
        .iter()
        .position(|&byte| byte == 0)
        .unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// A path in a fixed, NUL-padded field (cut if longer).
pub fn path_field<const N: usize>(path: &Path) -> [u8; N] {
    nul_padded(path.as_os_str().as_encoded_bytes())
}

/// The path of a NUL-padded field; `None` when it is empty.
pub fn path_of(field: &[u8]) -> Option<PathBuf> {
    let text = nul_terminated(field);
    (!text.is_empty()).then(|| PathBuf::from(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trip() {
        for text in [
            "127.0.0.1:6444",
            "[::1]:443",
            "[fd00::1:2]:65535",
            "198.18.0.1:1",
        ] {
            let addr: SocketAddr = text.parse().unwrap();
            assert_eq!(socket_addr(&endpoint(&addr)), Some(addr), "{text}");
        }
        let v4 = endpoint(&"127.0.0.1:6444".parse().unwrap());
        // Network byte order in memory: 127 is the first byte.
        assert_eq!(v4.addr_be[0].to_ne_bytes(), [127, 0, 0, 1]);
        assert_eq!(v4.port_be.to_ne_bytes(), 6444u16.to_be_bytes());
    }

    #[test]
    fn fields_are_nul_padded_and_cut() {
        // (what, text, field bytes, read back)
        let cases: [(&str, &str, [u8; 4], &str); 3] = [
            ("short", "ab", *b"ab\0\0", "ab"),
            ("one short of full", "abc", *b"abc\0", "abc"),
            ("too long: cut, last byte NUL", "abcdef", *b"abc\0", "abc"),
        ];
        for (what, text, bytes, back) in cases {
            let field: [u8; 4] = nul_padded(text.as_bytes());
            assert_eq!(field, bytes, "{what}");
            assert_eq!(nul_terminated(&field), back, "{what}");
        }
        let field: [u8; 16] = path_field(Path::new("/sys/fs/cgroup/x"));
        assert_eq!(path_of(&field), Some(PathBuf::from("/sys/fs/cgroup/")));
        assert_eq!(path_of(&[0u8; 8]), None);
    }
}
