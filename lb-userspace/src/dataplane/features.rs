//! What the running kernel offers, probed once at start, and what socklb
//! does without each piece: one clear line per missing feature.
//!
//! The programs learn the result through the `SOCKLB_FEATURES` global set
//! at load; the verifier drops the branches of missing features, helper
//! calls included, so one object loads on every supported kernel.

use std::{fmt, io::Read};

use aya::{
    programs::ProgramType,
    sys::{BpfHelper, is_helper_supported},
};
use lb_common::features;

/// Test-only: a comma-separated list of features to treat as missing
/// (`set-retval`, `netns-cookie`, `sk-storage`, `sock-destroy`,
/// `sockmap`), to test
/// each degraded mode on a kernel that has them all.
pub const DISABLE_FOR_TEST: &str = "SOCKLB_TEST_DISABLE_FEATURES";

/// The probed features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// `bpf_set_retval` in cgroup sock_addr programs (5.18).
    pub set_retval: bool,
    /// `bpf_get_netns_cookie` in sock_addr programs (5.7) and the
    /// `SO_NETNS_COOKIE` socket option (5.14), which gives the daemon's own.
    pub netns_cookie: bool,
    /// `bpf_sk_storage_get` in sock_addr programs.
    pub sk_storage: bool,
    /// `SOCK_DESTROY` over sock_diag (`CONFIG_INET_DIAG_DESTROY`).
    pub sock_destroy: bool,
    /// The `bpf_sock_destroy` kfunc for socket iterators (6.5); known, not
    /// used (close-on-failure uses sock_diag).
    pub sock_destroy_kfunc: bool,
    /// sockmap acceleration: `bpf_get_netns_cookie` in sock_ops and
    /// sk_msg programs (5.15), with socket storage.
    pub sockmap: bool,
}

impl Features {
    /// Everything: what tests of the pure parts assume.
    pub const ALL: Self = Self {
        set_retval: true,
        netns_cookie: true,
        sk_storage: true,
        sock_destroy: true,
        sock_destroy_kfunc: true,
        sockmap: true,
    };

    /// Probes the kernel, then applies the test-only switch.
    pub fn probe() -> Self {
        let helper =
            |helper| is_helper_supported(ProgramType::CgroupSockAddr, helper).unwrap_or(false);
        let probed = Self {
            set_retval: helper(BpfHelper::BPF_FUNC_set_retval),
            netns_cookie: helper(BpfHelper::BPF_FUNC_get_netns_cookie)
                && super::current_netns_cookie().is_ok(),
            sk_storage: helper(BpfHelper::BPF_FUNC_sk_storage_get),
            sock_destroy: crate::sockets::destroy_supported(),
            sock_destroy_kfunc: kernel_btf_mentions(b"bpf_sock_destroy"),
            sockmap: helper(BpfHelper::BPF_FUNC_sk_storage_get)
                && [ProgramType::SockOps, ProgramType::SkMsg]
                    .into_iter()
                    .all(|kind| {
                        is_helper_supported(kind, BpfHelper::BPF_FUNC_get_netns_cookie)
                            .unwrap_or(false)
                    }),
        };
        probed.without(&std::env::var(DISABLE_FOR_TEST).unwrap_or_default())
    }

    /// These features, less those named in `list` (comma separated).
    pub fn without(mut self, list: &str) -> Self {
        for name in list.split(',').map(str::trim) {
            match name {
                "set-retval" => self.set_retval = false,
                "netns-cookie" => self.netns_cookie = false,
                "sk-storage" => {
                    self.sk_storage = false;
                    self.sockmap = false;
                }
                "sockmap" => self.sockmap = false,
                "sock-destroy" => self.sock_destroy = false,
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
        if self.sk_storage {
            bits |= features::SK_STORAGE;
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
        if !self.sk_storage {
            lines.push(Degradation::NoSkStorage);
        }
        if !self.sock_destroy {
            lines.push(Degradation::NoSockDestroy);
        }
        if !self.sockmap {
            lines.push(Degradation::NoSockmap);
        }
        lines
    }
}

/// A missing feature and what socklb does without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degradation {
    NoSetRetval,
    NoNetnsCookie,
    NoSkStorage,
    NoSockDestroy,
    NoSockmap,
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
            Self::NoSkStorage => {
                "kernel without socket storage in sock_addr programs: per-socket records go to an LRU of 65,536 entries; past that, getpeername may show the backend and live counts may drift"
            }
            Self::NoSockDestroy => {
                "kernel without SOCK_DESTROY over sock_diag (CONFIG_INET_DIAG_DESTROY): close-on-failure is off; connections to a failed backend stay until they end"
            }
            Self::NoSockmap => {
                "kernel without bpf_get_netns_cookie in sock_ops and sk_msg programs (Linux < 5.15) or without socket storage: accelerate = \"sockmap\" is ignored, every connection takes the normal path"
            }
        })
    }
}

/// Whether the kernel's BTF names a symbol (a cheap way to know a kfunc).
fn kernel_btf_mentions(symbol: &[u8]) -> bool {
    let mut bytes = Vec::new();
    let read = std::fs::File::open("/sys/kernel/btf/vmlinux")
        .and_then(|mut file| file.read_to_end(&mut bytes));
    read.is_ok()
        && bytes.windows(symbol.len() + 2).any(|window| {
            window[0] == 0 && &window[1..=symbol.len()] == symbol && window[symbol.len() + 1] == 0
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_switch_turns_features_off_one_by_one() {
        let all = features::ALL;
        let cases = [
            ("set-retval", all & !features::SET_RETVAL, 1),
            ("netns-cookie", all & !features::NETNS_COOKIE, 1),
            (
                "sk-storage",
                all & !features::SK_STORAGE & !features::SOCKMAP,
                2,
            ),
            ("sock-destroy", all, 1),
            ("sockmap", all & !features::SOCKMAP, 1),
            ("", all, 0),
        ];
        for (off, bits, degradations) in cases {
            let features = Features::ALL.without(off);
            assert_eq!(features.bits(), bits, "{off}");
            assert_eq!(features.degradations().len(), degradations, "{off}");
        }
        let none = Features::ALL.without("set-retval, netns-cookie,sk-storage,sock-destroy");
        assert_eq!(none.bits(), 0);
        assert_eq!(none.degradations().len(), 5);
    }
}
