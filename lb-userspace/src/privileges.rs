//! What each command needs from the kernel's capability checks, said in one
//! line before anything is tried, instead of a raw "Operation not
//! permitted" from the middle of an install.

use std::fmt;

/// The capabilities socklb uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// Load programs, create and read maps.
    Bpf,
    /// Attach to cgroup hooks, query their program lists, close sockets
    /// over sock_diag.
    NetAdmin,
}

// CAP_SYS_ADMIN is not needed. With it, socklb finds other installs that
// would overlap its VIPs among every link of the machine (by id), and reads
// the program behind an adopted link; without it, it finds them through
// their pins under /sys/fs/bpf, and switches an adopted link to its own
// program unconditionally (atomically, with BPF_LINK_UPDATE).

impl Capability {
    /// The bit of the capability in `/proc/self/status`.
    fn bit(self) -> u32 {
        match self {
            Self::Bpf => 39,
            Self::NetAdmin => 12,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Bpf => "CAP_BPF",
            Self::NetAdmin => "CAP_NET_ADMIN",
        }
    }
}

/// Everything `run`, `uninstall` and `drain` need.
pub const ALL: [Capability; 2] = [Capability::Bpf, Capability::NetAdmin];
/// What reading the pinned maps needs (`status`).
pub const READ: [Capability; 1] = [Capability::Bpf];

/// A command that lacks capabilities, with the ones it lacks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct MissingPrivileges {
    pub command: &'static str,
    pub needed: Vec<Capability>,
    pub missing: Vec<Capability>,
}

fn and_list(capabilities: &[Capability]) -> String {
    let names: Vec<&str> = capabilities.iter().map(|cap| cap.name()).collect();
    match names.as_slice() {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

impl fmt::Display for MissingPrivileges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "socklb {} needs root, or {} (this process lacks {})",
            self.command,
            and_list(&self.needed),
            and_list(&self.missing)
        )
    }
}

/// Why a command cannot start its work.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error(transparent)]
    Missing(#[from] MissingPrivileges),
    /// bpf(2) answers EPERM although this process holds CAP_BPF.
    #[error(
        "socklb {command} holds CAP_BPF, yet bpf(2) fails ({refusal}): {blocker}. \
         In a container, the runtime's default seccomp profile allows bpf(2) to CAP_BPF from \
         containerd 1.7 and containers-common 0.60 (CRI-O 1.31) on; with an older runtime set \
         seccompProfile to Unconfined, or to a profile that allows bpf"
    )]
    BpfRefused {
        command: &'static str,
        refusal: std::io::Error,
        blocker: &'static str,
    },
}

/// The effective capability set, from `/proc/self/status`.
fn effective() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| parse_effective(&status))
        .unwrap_or(0)
}

fn parse_effective(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
}

/// Fails, naming what is missing, unless this process has every capability
/// in `needed`, and, when that includes CAP_BPF, bpf(2) gets through.
pub fn require(command: &'static str, needed: &[Capability]) -> Result<(), PrivilegeError> {
    let have = effective();
    let missing: Vec<Capability> = needed
        .iter()
        .copied()
        .filter(|cap| have & (1 << cap.bit()) == 0)
        .collect();
    if !missing.is_empty() {
        return Err(MissingPrivileges {
            command,
            needed: needed.to_vec(),
            missing,
        }
        .into());
    }
    if !needed.contains(&Capability::Bpf) {
        return Ok(());
    }
    match crate::dataplane::sys::try_map_create() {
        Err(refusal) if refusal.raw_os_error() == Some(libc::EPERM) => {
            Err(PrivilegeError::BpfRefused {
                command,
                refusal,
                blocker: if under_seccomp() {
                    "this process runs under a seccomp filter, which refuses it"
                } else {
                    "a security module refuses it"
                },
            })
        }
        // Anything else is for the install to report in its place.
        _ => Ok(()),
    }
}

/// Whether a seccomp filter applies to this process (`Seccomp: 2`).
fn under_seccomp() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .any(|line| line.split_whitespace().collect::<Vec<_>>() == ["Seccomp:", "2"])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_effective_set() {
        let status = "Name:\tsocklb\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert_eq!(parse_effective(status), Some(0x1ff_ffff_ffff));
        assert_eq!(parse_effective("Name: x\n"), None);
    }

    #[test]
    fn the_message_is_one_line_naming_what_is_missing() {
        let error = MissingPrivileges {
            command: "run",
            needed: ALL.to_vec(),
            missing: vec![Capability::NetAdmin],
        };
        assert_eq!(
            error.to_string(),
            "socklb run needs root, or CAP_BPF and CAP_NET_ADMIN (this process lacks CAP_NET_ADMIN)"
        );
    }

    #[test]
    fn a_refused_bpf_call_is_named_with_its_cause_and_the_way_out() {
        let error = PrivilegeError::BpfRefused {
            command: "run",
            refusal: std::io::Error::from_raw_os_error(libc::EPERM),
            blocker: "this process runs under a seccomp filter, which refuses it",
        };
        let message = error.to_string();
        assert!(
            message
                .starts_with("socklb run holds CAP_BPF, yet bpf(2) fails (Operation not permitted"),
            "{message}"
        );
        assert!(message.contains("containerd 1.7"), "{message}");
        assert!(!message.contains('\n'), "one line: {message}");
    }
}
