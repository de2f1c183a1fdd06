//! What a service's VIPs do once the daemon is gone (`when-daemon-gone`),
//! and why: with `auto`, socklb hands a VIP back when another socket
//! listens on it in the host network namespace (the agent's own balancer,
//! as the k3s or rke2 agent's on 127.0.0.1:6444), and keeps redirecting
//! otherwise (k3s with `--disable-apiserver-lb`: nothing would take the
//! connects). The decision is pure ([`HandBackChoice::decide`]) over the
//! listeners found ([`listeners`]); the daemon makes it at start and at
//! each change of the configuration, and the planner writes the flag.

use std::{collections::HashSet, fmt, io, net::SocketAddr};

use crate::{config::WhenDaemonGone, sockets::Listening};

/// What applies to a service's VIPs once the daemon is gone, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandBackChoice {
    /// What the configuration says.
    pub configured: WhenDaemonGone,
    /// What applies: hand the VIPs back (else keep redirecting).
    pub hand_back: bool,
    /// With `auto`: the VIP a listener was found on, if any.
    pub listened_vip: Option<SocketAddr>,
    /// With `auto` and no listener: the VIPs looked at.
    pub vips: Vec<SocketAddr>,
}

impl HandBackChoice {
    /// The choice for a service with `vips`, given the listening sockets
    /// of the host network namespace other than socklb's own.
    pub fn decide(
        configured: WhenDaemonGone,
        vips: &[SocketAddr],
        listeners: &[Listening],
    ) -> Self {
        let listened_vip = (configured == WhenDaemonGone::Auto)
            .then(|| {
                vips.iter()
                    .copied()
                    .find(|vip| listeners.iter().any(|listener| covers(listener, *vip)))
            })
            .flatten();
        let hand_back = match configured {
            WhenDaemonGone::Keep => false,
            WhenDaemonGone::HandBack => true,
            WhenDaemonGone::Auto => listened_vip.is_some(),
        };
        Self {
            configured,
            hand_back,
            listened_vip,
            vips: vips.to_vec(),
        }
    }

    /// "keep" or "hand-back": what applies.
    pub fn effective(&self) -> &'static str {
        if self.hand_back {
            WhenDaemonGone::HandBack.as_str()
        } else {
            WhenDaemonGone::Keep.as_str()
        }
    }

    /// Why it applies, in words: "127.0.0.1:6444 has a listener".
    pub fn reason(&self) -> String {
        match (self.configured, self.listened_vip) {
            (WhenDaemonGone::Auto, Some(vip)) => format!("{vip} has a listener"),
            (WhenDaemonGone::Auto, None) => format!(
                "nothing else listens on {}",
                self.vips
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            _ => "configured".into(),
        }
    }
}

/// "auto: hand-back (127.0.0.1:6444 has a listener)", "keep (configured)".
impl fmt::Display for HandBackChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.configured == WhenDaemonGone::Auto {
            write!(f, "auto: ")?;
        }
        write!(f, "{} ({})", self.effective(), self.reason())
    }
}

/// Whether connects to `vip` reach `listener`: bound to the VIP's address
/// (an IPv6 socket also as the IPv4-mapped form) or to the wildcard
/// address of its family, on its port. A dual-stack IPv6 wildcard takes
/// IPv4 connects too.
pub fn covers(listener: &Listening, vip: SocketAddr) -> bool {
    if listener.addr.port() != vip.port() {
        return false;
    }
    let bound = listener.addr.ip();
    if bound == vip.ip() {
        return true;
    }
    match (bound, vip.ip()) {
        (std::net::IpAddr::V4(bound), std::net::IpAddr::V4(_)) => bound.is_unspecified(),
        (std::net::IpAddr::V6(bound), std::net::IpAddr::V6(_)) => bound.is_unspecified(),
        (std::net::IpAddr::V6(bound), std::net::IpAddr::V4(vip)) => {
            !listener.v6_only && (bound.is_unspecified() || bound == vip.to_ipv6_mapped())
        }
        (std::net::IpAddr::V4(_), std::net::IpAddr::V6(_)) => false,
    }
}

/// The listening sockets of this network namespace that cover one of
/// `vips`, other than those process `own_pid` holds (socklb's own: its
/// metrics endpoint, say). Blocking, and cheap: the kernel walks only its
/// table of listening sockets.
pub fn listeners(vips: &[SocketAddr], own_pid: Option<u32>) -> io::Result<Vec<Listening>> {
    if vips.is_empty() {
        return Ok(Vec::new());
    }
    let own = own_pid.map(socket_inodes).unwrap_or_default();
    crate::sockets::listening(
        |listener| vips.iter().any(|vip| covers(listener, *vip)),
        |inode| own.contains(&inode),
    )
}

/// The inodes of the sockets process `pid` holds (from /proc/PID/fd),
/// none if it cannot be read (the process is gone). Bounded by the
/// process's open files.
fn socket_inodes(pid: u32) -> HashSet<u32> {
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return HashSet::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| std::fs::read_link(entry.path()).ok())
        .filter_map(|target| {
            target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener(addr: &str, v6_only: bool) -> Listening {
        Listening {
            addr: addr.parse().unwrap(),
            v6_only,
        }
    }

    #[test]
    fn a_listener_covers_its_address_and_the_wildcard_of_its_port() {
        let cases = [
            (
                "same address",
                "127.0.0.1:6444",
                false,
                "127.0.0.1:6444",
                true,
            ),
            (
                "other port",
                "127.0.0.1:6445",
                false,
                "127.0.0.1:6444",
                false,
            ),
            (
                "other address",
                "127.0.0.2:6444",
                false,
                "127.0.0.1:6444",
                false,
            ),
            (
                "IPv4 wildcard",
                "0.0.0.0:6444",
                false,
                "127.0.0.1:6444",
                true,
            ),
            (
                "dual-stack wildcard",
                "[::]:6444",
                false,
                "127.0.0.1:6444",
                true,
            ),
            (
                "IPv6-only wildcard",
                "[::]:6444",
                true,
                "127.0.0.1:6444",
                false,
            ),
            (
                "IPv6-only wildcard, IPv6 VIP",
                "[::]:6444",
                true,
                "[::1]:6444",
                true,
            ),
            (
                "mapped address",
                "[::ffff:127.0.0.1]:6444",
                false,
                "127.0.0.1:6444",
                true,
            ),
            (
                "IPv4 wildcard, IPv6 VIP",
                "0.0.0.0:6444",
                false,
                "[::1]:6444",
                false,
            ),
            ("IPv6 loopback", "[::1]:6444", false, "[::1]:6444", true),
        ];
        for (what, bound, v6_only, vip, expected) in cases {
            assert_eq!(
                covers(&listener(bound, v6_only), vip.parse().unwrap()),
                expected,
                "{what}"
            );
        }
    }

    #[test]
    fn auto_hands_back_only_where_another_socket_listens() {
        let vips: Vec<SocketAddr> = vec!["127.0.0.1:6444".parse().unwrap()];
        let agent = [listener("127.0.0.1:6444", false)];
        let elsewhere = [listener("127.0.0.1:6443", false)];
        let cases: [(&str, WhenDaemonGone, &[Listening], bool, &str); 6] = [
            (
                "auto, the agent's balancer on the VIP",
                WhenDaemonGone::Auto,
                &agent,
                true,
                "auto: hand-back (127.0.0.1:6444 has a listener)",
            ),
            (
                "auto, nothing on the VIP's port",
                WhenDaemonGone::Auto,
                &elsewhere,
                false,
                "auto: keep (nothing else listens on 127.0.0.1:6444)",
            ),
            (
                "auto, no listener at all",
                WhenDaemonGone::Auto,
                &[],
                false,
                "auto: keep (nothing else listens on 127.0.0.1:6444)",
            ),
            (
                "keep, whatever listens",
                WhenDaemonGone::Keep,
                &agent,
                false,
                "keep (configured)",
            ),
            (
                "hand-back, nothing listening",
                WhenDaemonGone::HandBack,
                &[],
                true,
                "hand-back (configured)",
            ),
            (
                "hand-back, the agent listening",
                WhenDaemonGone::HandBack,
                &agent,
                true,
                "hand-back (configured)",
            ),
        ];
        for (what, configured, listeners, hand_back, words) in cases {
            let choice = HandBackChoice::decide(configured, &vips, listeners);
            assert_eq!(choice.hand_back, hand_back, "{what}");
            assert_eq!(choice.to_string(), words, "{what}");
        }
    }

    #[test]
    fn auto_names_the_first_vip_that_has_a_listener() {
        let vips: Vec<SocketAddr> = vec![
            "127.0.0.1:6444".parse().unwrap(),
            "[::1]:6444".parse().unwrap(),
        ];
        let choice =
            HandBackChoice::decide(WhenDaemonGone::Auto, &vips, &[listener("[::]:6444", true)]);
        assert!(choice.hand_back);
        assert_eq!(choice.listened_vip, Some("[::1]:6444".parse().unwrap()));
        let none = HandBackChoice::decide(WhenDaemonGone::Auto, &vips, &[]);
        assert_eq!(
            none.reason(),
            "nothing else listens on 127.0.0.1:6444, [::1]:6444"
        );
    }

    /// sock_diag dumps this namespace's listening sockets without
    /// privileges: a listener is found on its address, and not when it is
    /// this process's own.
    #[test]
    fn the_dump_finds_a_listener_and_leaves_out_our_own() {
        let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let vip = socket.local_addr().unwrap();
        let found = listeners(&[vip], None).unwrap();
        assert_eq!(
            found,
            [Listening {
                addr: vip,
                v6_only: false
            }]
        );
        assert_eq!(listeners(&[vip], Some(std::process::id())).unwrap(), []);
        drop(socket);
        assert_eq!(listeners(&[vip], None).unwrap(), []);
    }
}
