//! The kernel side, seen from userspace: load, attach, pin, adopt, write
//! the selection tables, verify them against the kernel, repair, and
//! uninstall.
//!
//! socklb owns exactly the objects pinned under its pin directory: the maps
//! named in `lb_common::names::MAPS` and one bpf_link per program. It
//! attaches with bpf_link, so other programs on the same cgroup hooks keep
//! running, and it never removes anything it did not pin.

mod abi;
pub mod features;
pub mod install;
pub mod links;
pub mod lock;
pub mod migrate;
pub mod object;
pub mod pins;
pub mod shadow;
pub mod slots;
pub mod socket_table;
pub mod store;
pub mod sys;
pub mod tables;

use std::path::PathBuf;

pub use install::{Removal, Running, bring_up, open_pinned, remove_pins};
pub use links::{Attachment, CgroupTarget, LinkProblem};
pub use object::BpfLogLevel;
pub use pins::{DEFAULT_PIN_PATH, PinPaths};
pub use store::{BpfMaps, MapStore, MemoryMaps, SocketTableUse, StoreError};
pub use tables::{BackendHealth, Desired, Drift, TableIntent, Writer};

/// What can go wrong with the kernel side. Each message names the object;
/// the cause follows in the error chain.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "this socklb was built without its eBPF object; run `cargo xtask build-ebpf` and build again"
    )]
    NoObject,
    #[error("the embedded eBPF object cannot be parsed: {problem}")]
    Object { problem: String },
    #[error("loading the eBPF object")]
    Load(#[from] aya::EbpfError),
    #[error("program {name}")]
    Program {
        name: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("link of {name}")]
    Link {
        name: &'static str,
        #[source]
        source: aya::programs::links::LinkError,
    },
    #[error("pinning {path}")]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("{path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("map {0} is not in the eBPF object")]
    MissingMap(&'static str),
    #[error(
        "the pinned map {path} has another layout ({problem}); run `socklb uninstall` before installing this version"
    )]
    Layout { path: PathBuf, problem: String },
    #[error(
        "the pinned links under {dir} attach to cgroup id {pinned}, not to {requested} (id {requested_id}); run `socklb uninstall --pin-path {dir}` first"
    )]
    CgroupMismatch {
        dir: PathBuf,
        pinned: u64,
        requested: PathBuf,
        requested_id: u64,
    },
    #[error("nothing of socklb is pinned under {0}")]
    NotInstalled(PathBuf),
    #[error("{} (pid {pid}) holds the lock of {dir}", if *.pid == 0 { "another socklb process" } else { "a socklb process" })]
    Locked { dir: PathBuf, pid: u32 },
    #[error(
        "--pin-path {0} is not on a bpf file system; mount one there (mount -t bpf bpf DIR) or choose a directory under /sys/fs/bpf"
    )]
    NotBpffs(PathBuf),
    #[error(
        "mounting bpffs on {path} (it is not mounted; that needs CAP_SYS_ADMIN, or mount it first)"
    )]
    Mount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("refusing {path}: it {problem}")]
    UnsafePinDir { path: PathBuf, problem: String },
}

/// The cookie of the network namespace this process runs in.
pub fn current_netns_cookie() -> Result<u64, std::io::Error> {
    use std::os::fd::AsRawFd;
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let mut cookie: u64 = 0;
    let mut length = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `length` bytes into `cookie`.
    let result = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut length,
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}
