//! What the running kernel offers, probed once at start, and what socklb
//! does without each piece: one clear line per missing feature.
//!
//! The programs learn the result through the `SOCKLB_FEATURES` global set
//! at load; the verifier drops the branches of missing features, helper
//! calls included, so one object loads on every supported kernel.

use std::fmt;

use aya::{
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported},
};
use lb_common::features;

/// Test-only: a comma-separated list of features to treat as missing
/// (`set-retval`, `netns-cookie`, `callbacks-at-connect`, `sock-destroy`,
/// `sockmap`, `socket-slots`), to test each degraded mode on a kernel that
/// has them all.
pub const DISABLE_FOR_TEST: &str = "SOCKLB_TEST_DISABLE_FEATURES";

/// The probed features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// `bpf_set_retval` in cgroup sock_addr programs (5.18).
    pub set_retval: bool,
    /// `bpf_get_netns_cookie` in sock_addr programs (5.7) and the
    /// `SO_NETNS_COOKIE` socket option (5.14), which gives the daemon's own.
    pub netns_cookie: bool,
    /// `bpf_setsockopt(TCP_BPF_SOCK_OPS_CB_FLAGS)` (Linux 6.12): connect4/6
    /// ask for a redirected socket's sock_ops callbacks themselves.
    pub callbacks_at_connect: bool,
    /// `SOCK_DESTROY` over sock_diag (`CONFIG_INET_DIAG_DESTROY`).
    pub sock_destroy: bool,
    /// sockmap acceleration: `bpf_get_netns_cookie` in sock_ops and
    /// sk_msg programs (5.15).
    pub sockmap: bool,
    /// BPF_CMPXCHG (Linux 5.12): the socket table is an array of slots
    /// claimed by compare-and-exchange (the array layout); without it, a
    /// preallocated hash (the hash layout), dearer per connection.
    pub socket_slots: bool,
}

impl Features {
    /// Everything: what tests of the pure parts assume.
    pub const ALL: Self = Self {
        set_retval: true,
        netns_cookie: true,
        callbacks_at_connect: true,
        sock_destroy: true,
        sockmap: true,
        socket_slots: true,
    };

    /// Probes the kernel, then applies the test-only switch.
    pub fn probe() -> Self {
        let helper =
            |helper| is_helper_supported(ProgramType::CgroupSockAddr, helper).unwrap_or(false);
        let probed = Self {
            set_retval: helper(BpfHelper::BPF_FUNC_set_retval),
            netns_cookie: helper(BpfHelper::BPF_FUNC_get_netns_cookie)
                && super::current_netns_cookie().is_ok(),
            callbacks_at_connect: helper(BpfHelper::BPF_FUNC_setsockopt)
                && kernel_release_at_least(&kernel_release(), (6, 12)),
            sock_destroy: crate::sockets::destroy_supported(),
            sockmap: [ProgramType::SockOps, ProgramType::SkMsg]
                .into_iter()
                .all(|kind| {
                    is_helper_supported(kind, BpfHelper::BPF_FUNC_get_netns_cookie).unwrap_or(false)
                }),
            // Loading a program that uses it: the verifier and the JIT
            // both must take it (an older verifier refuses it anywhere in
            // a program, so the object cannot carry a fallback).
            socket_slots: super::sys::compare_exchange_supported(),
        };
        probed.without(&std::env::var(DISABLE_FOR_TEST).unwrap_or_default())
    }

    /// These features, less those named in `list` (comma separated).
    pub fn without(mut self, list: &str) -> Self {
        for name in list.split(',').map(str::trim) {
            match name {
                "set-retval" => self.set_retval = false,
                "netns-cookie" => self.netns_cookie = false,
                "callbacks-at-connect" => self.callbacks_at_connect = false,
                "sockmap" => self.sockmap = false,
                "sock-destroy" => self.sock_destroy = false,
                "socket-slots" => self.socket_slots = false,
                _ => {}
            }
        }
        self
    }

    /// The `SOCKLB_FEATURES` bits for the programs.
    pub fn bits(&self) -> u32 {
        let mut bits = 0;
        if self.set_retval {
            bits |= features::SET_RETVAL;
        }
        if self.netns_cookie {
            bits |= features::NETNS_COOKIE;
        }
        if self.callbacks_at_connect {
            bits |= features::CALLBACKS_AT_CONNECT;
        }
        if self.sockmap {
            bits |= features::SOCKMAP;
        }
        bits
    }

    /// One line for each missing feature: what is missing and what socklb
    /// does instead.
    pub fn degradations(&self) -> Vec<Degradation> {
        let mut lines = Vec::new();
        if !self.set_retval {
            lines.push(Degradation::NoSetRetval);
        }
        if !self.netns_cookie {
            lines.push(Degradation::NoNetnsCookie);
        }
        if !self.callbacks_at_connect {
            lines.push(Degradation::NoCallbacksAtConnect);
        }
        if !self.sock_destroy {
            lines.push(Degradation::NoSockDestroy);
        }
        if !self.sockmap {
            lines.push(Degradation::NoSockmap);
        }
        if !self.socket_slots {
            lines.push(Degradation::NoSocketSlots);
        }
        lines
    }
}

/// A missing feature and what socklb does without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degradation {
    NoSetRetval,
    NoNetnsCookie,
    NoCallbacksAtConnect,
    NoSockDestroy,
    NoSockmap,
    NoSocketSlots,
}

impl fmt::Display for Degradation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoSetRetval => {
                "kernel without bpf_set_retval in cgroup programs (Linux < 5.18): when none is healthy, `reject` refuses connects with EPERM instead of ECONNREFUSED"
            }
            Self::NoNetnsCookie => {
                "kernel without network namespace cookies (bpf_get_netns_cookie < 5.7, SO_NETNS_COOKIE < 5.14): connects from every network namespace in the cgroup are redirected, as with all-netns"
            }
            Self::NoCallbacksAtConnect => {
                "kernel without bpf_setsockopt(TCP_BPF_SOCK_OPS_CB_FLAGS) (Linux < 6.12): sock_ops looks every connecting socket of the cgroup up to find the redirected ones, which costs each ordinary connection one lookup more"
            }
            Self::NoSockDestroy => {
                "kernel without SOCK_DESTROY over sock_diag (CONFIG_INET_DIAG_DESTROY): close-on-failure is off; connections to a failed backend stay until they end"
            }
            Self::NoSockmap => {
                "kernel without bpf_get_netns_cookie in sock_ops and sk_msg programs (Linux < 5.15): accelerate = \"sockmap\" is ignored, every connection takes the normal path"
            }
            Self::NoSocketSlots => {
                "kernel without BPF_CMPXCHG (Linux < 5.12): the socket table is a preallocated hash instead of an array of slots, which costs each redirected connection about 300 ns more of kernel time"
            }
        })
    }
}

/// The running kernel's release (`uname -r`), empty if unknown.
fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|text| text.trim().to_string())
        .unwrap_or_default()
}

/// Whether a release such as `6.18.44-fc` is at least `major.minor`.
fn kernel_release_at_least(release: &str, (major, minor): (u32, u32)) -> bool {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|part| part.parse::<u32>().ok());
    match (numbers.next().flatten(), numbers.next().flatten()) {
        (Some(found_major), Some(found_minor)) => (found_major, found_minor) >= (major, minor),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_switch_turns_features_off_one_by_one() {
        // The legacy readers are the install's to set, not the kernel's.
        let all = features::ALL & !features::LEGACY_STORAGE & !features::LEGACY_LRU;
        let cases = [
            ("set-retval", all & !features::SET_RETVAL, 1),
            ("netns-cookie", all & !features::NETNS_COOKIE, 1),
            (
                "callbacks-at-connect",
                all & !features::CALLBACKS_AT_CONNECT,
                1,
            ),
            ("sock-destroy", all, 1),
            ("sockmap", all & !features::SOCKMAP, 1),
            ("socket-slots", all, 1),
            ("", all, 0),
        ];
        for (off, bits, degradations) in cases {
            let features = Features::ALL.without(off);
            assert_eq!(features.bits(), bits, "{off}");
            assert_eq!(features.degradations().len(), degradations, "{off}");
        }
        let none = Features::ALL.without(
            "set-retval, netns-cookie,callbacks-at-connect,sock-destroy,sockmap,socket-slots",
        );
        assert_eq!(none.bits(), 0);
        assert_eq!(none.degradations().len(), 6);
    }
}

#[cfg(test)]
mod release_tests {
    use super::kernel_release_at_least;

    #[test]
    fn kernel_releases_compare_by_major_and_minor() {
        let cases = [
            ("6.18.44-fc-v1147", true),
            ("6.12.0", true),
            ("6.11.9-300.fc41.x86_64", false),
            ("5.15.0-91-generic", false),
            ("7.0.1", true),
            ("garbage", false),
            ("", false),
        ];
        for (release, want) in cases {
            assert_eq!(kernel_release_at_least(release, (6, 12)), want, "{release}");
        }
    }
}
