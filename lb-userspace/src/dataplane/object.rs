//! The embedded eBPF object: checking pinned maps against it, and loading
//! its programs against the pinned maps.
//!
//! Every start loads the programs afresh. Maps that are already pinned are
//! reused (aya's `map_pin_path`), so the new programs share the state of
//! the running data plane; maps that are missing are created, and pinned
//! by the caller one at a time. A pinned map whose layout differs from the
//! object's is never reinterpreted: the load is refused.

use std::fs::File;

use aya::{
    Ebpf, EbpfLoader,
    maps::MapInfo,
    programs::{CgroupAttachMode, Program, ProgramError, links::FdLink},
};
use lb_common::{features, names};

use super::{KernelError, PinPaths, features::Features};

/// The eBPF object, built and placed in OUT_DIR by build.rs (aya-build):
/// the array layout of the socket table (Linux 5.12 and later).
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf"));
/// The same programs with the hash layout of the socket table, for kernels
/// without BPF_CMPXCHG.
pub static EBPF_HASH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf-hash"));

/// The object of a layout: the array (`slots`) or the hash.
pub fn object_of(slots: bool) -> &'static [u8] {
    if slots { EBPF_OBJECT } else { EBPF_HASH_OBJECT }
}

/// Log level of the kernel programs, fixed when they are loaded. `Off`
/// keeps logging out of the connect path entirely: the verifier removes the
/// dead branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BpfLogLevel {
    Off,
    Error,
    Warn,
    Info,
    Debug,
}

impl BpfLogLevel {
    /// Every level, by the name the command line takes.
    pub const ALL: [(&'static str, Self); 5] = [
        ("off", Self::Off),
        ("error", Self::Error),
        ("warn", Self::Warn),
        ("info", Self::Info),
        ("debug", Self::Debug),
    ];

    fn as_u8(self) -> u8 {
        match self {
            Self::Off => 0,
            Self::Error => 1,
            Self::Warn => 2,
            Self::Info => 3,
            Self::Debug => 4,
        }
    }
}

impl std::str::FromStr for BpfLogLevel {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .iter()
            .find(|(name, _)| *name == text)
            .map(|(_, level)| *level)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|(name, _)| *name).collect();
                format!("{text:?} is not one of {}", names.join(", "))
            })
    }
}

/// The programs of one load, ready to attach, and the maps it created that
/// are not pinned yet.
pub struct Loaded {
    pub ebpf: Ebpf,
    pub unpinned: Vec<&'static str>,
    /// The socket table's size in this load.
    pub socket_table_size: u32,
    /// What the load decided that an operator should know.
    pub notes: Vec<String>,
}

/// What a load needs besides the pins: the kernel's features, the log
/// level and the configured socket table size.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions<'a> {
    pub log_level: BpfLogLevel,
    pub features: &'a Features,
    /// `socket-table-size`: used when the table is created; a pinned table
    /// keeps the size it was made with.
    pub socket_table_size: u32,
}

/// The SHA-256 of the object of a layout: which programs an install runs.
pub fn object_sha256(slots: bool) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, object_of(slots));
    let mut sha = [0u8; 32];
    sha.copy_from_slice(digest.as_ref());
    sha
}

/// The maps this load pins: socklb's own with the socket table of the
/// layout, and the older layouts' per-socket maps while an upgrade from
/// one left them pinned (sockets it redirected may still live).
pub fn pinned_maps(paths: &PinPaths, slots: bool) -> Vec<&'static str> {
    let mut maps = names::MAPS.to_vec();
    if slots {
        maps.insert(3, names::SOCKET_SLOTS);
    }
    for legacy in [names::LEGACY_REDIRECTS, names::SOCKETS] {
        if paths.map(legacy).exists() {
            maps.push(legacy);
        }
    }
    maps
}

/// The `SOCKLB_FEATURES` bits of the legacy readers this install needs.
fn legacy_bits(paths: &PinPaths) -> u32 {
    let mut bits = 0;
    if paths.map(names::SOCKETS).exists() {
        bits |= features::LEGACY_STORAGE;
    }
    if paths.map(names::LEGACY_REDIRECTS).exists() {
        bits |= features::LEGACY_LRU;
    }
    bits
}

/// The entries of one map of the socket table (the hash's elements, or
/// the array's slots): the pinned map's, which holds live sockets' records
/// and cannot grow, or else `wanted`; with a note when they differ.
fn socket_table_entries(
    paths: &PinPaths,
    name: &'static str,
    wanted: u32,
    configured: u32,
) -> (u32, Option<String>) {
    let Ok(pinned) = MapInfo::from_pin(paths.map(name)) else {
        return (wanted, None);
    };
    let entries = pinned.max_entries();
    let note = (entries != wanted).then(|| {
        format!(
            "socket-table-size is {configured}, but the pinned {name} has {entries} entries and keeps them (it holds the records of open connections); the new size applies after `socklb uninstall`"
        )
    });
    (entries, note)
}

/// Unpins a socket table pinned without the live counts its records count
/// in (`lb_conns_v1`): left by an uninstall cut short, or by the uninstall
/// of an older socklb that did not know the array. Its records belong to
/// counts that are gone; adopted, the end of each would take one off a
/// count made afresh. The load then makes a new, empty table. Returns a
/// note for each.
fn unpin_orphaned_socket_tables(paths: &PinPaths) -> Vec<String> {
    if paths.map(names::BACKEND_CONNS).exists() {
        return Vec::new();
    }
    [names::SOCKET_TABLE, names::SOCKET_SLOTS]
        .into_iter()
        .map(|name| paths.map(name))
        .filter(|path| std::fs::remove_file(path).is_ok())
        .map(|path| {
            format!(
                "{} was pinned without {}, whose live counts its records count in (left by an uninstall cut short, or an older socklb's): unpinned it, and made a new one",
                path.display(),
                names::BACKEND_CONNS
            )
        })
        .collect()
}

/// Refuses the hash layout over an install of the array layout: its
/// programs would not find the records of the sockets the array holds.
fn check_layout(paths: &PinPaths, slots: bool) -> Result<(), KernelError> {
    let path = paths.map(names::SOCKET_SLOTS);
    if slots || !path.exists() {
        return Ok(());
    }
    Err(KernelError::Layout {
        path,
        problem: "this install keeps its socket table as an array of slots (Linux 5.12 and later), and this start would use the hash layout; run `socklb uninstall` first".to_string(),
    })
}

/// A pinned map that does not match the object's definition (the socket
/// table's size is the install's, not the object's).
fn layout_problem(paths: &PinPaths, name: &str, object: &aya_obj::Object) -> Option<String> {
    let wanted = object.maps.get(name)?;
    let found = MapInfo::from_pin(paths.map(name)).ok()?;
    let found_type = found.map_type().map_or(u32::MAX, |kind| kind as u32);
    let wanted_entries = if name == names::SOCKET_TABLE || name == names::SOCKET_SLOTS {
        found.max_entries()
    } else {
        wanted.max_entries()
    };
    let pairs = [
        ("type", found_type, wanted.map_type()),
        ("key size", found.key_size(), wanted.key_size()),
        ("value size", found.value_size(), wanted.value_size()),
        ("max entries", found.max_entries(), wanted_entries),
        ("flags", found.map_flags(), wanted.map_flags()),
    ];
    let differences: Vec<String> = pairs
        .iter()
        .filter(|(_, found, wanted)| found != wanted)
        .map(|(what, found, wanted)| format!("{what} {found}, this socklb needs {wanted}"))
        .collect();
    (!differences.is_empty()).then(|| differences.join(", "))
}

/// Loads every program against the pinned maps (creating the missing ones,
/// unpinned), after checking that each pinned map has the layout this
/// object expects.
pub fn load(paths: &PinPaths, options: LoadOptions<'_>) -> Result<Loaded, KernelError> {
    let slots = options.features.socket_slots;
    let bytes = object_of(slots);
    if bytes.is_empty() {
        return Err(KernelError::NoObject);
    }
    let orphans = unpin_orphaned_socket_tables(paths);
    check_layout(paths, slots)?;
    let object = aya_obj::Object::parse(bytes).map_err(|error| KernelError::Object {
        problem: error.to_string(),
    })?;
    let shared = pinned_maps(paths, slots);
    for &name in &shared {
        if let Some(problem) = layout_problem(paths, name, &object) {
            return Err(KernelError::Layout {
                path: paths.map(name),
                problem,
            });
        }
    }
    // The loader parses the object again: one parsed copy at a time keeps
    // the start's peak of memory down (it counts against the daemon's
    // memory limit, beside the maps).
    drop(object);
    let pinned: Vec<&'static str> = shared
        .iter()
        .copied()
        .filter(|name| paths.map(name).exists())
        .collect();
    let level = options.log_level.as_u8();
    let bits = options.features.bits() | legacy_bits(paths);
    let configured = options.socket_table_size;
    let (entries, note) = socket_table_entries(paths, names::SOCKET_TABLE, configured, configured);
    let (slot_count, slot_note) = if slots {
        let wanted = lb_common::socket_slots_for(configured);
        socket_table_entries(paths, names::SOCKET_SLOTS, wanted, configured)
    } else {
        (0, None)
    };
    // `socket_slots_for` makes a power of two; a pinned array that is not
    // one was not made by socklb.
    if slots && !slot_count.is_power_of_two() {
        return Err(KernelError::Layout {
            path: paths.map(names::SOCKET_SLOTS),
            problem: format!("{slot_count} slots, not a power of two"),
        });
    }
    let mask = slot_count.wrapping_sub(1);
    let mut loader = EbpfLoader::new();
    loader.override_global("AYA_LOG_LEVEL", &level, false);
    loader.override_global(names::globals::FEATURES, &bits, true);
    loader.map_max_entries(names::SOCKET_TABLE, entries);
    if slots {
        loader.map_max_entries(names::SOCKET_SLOTS, slot_count);
        loader.override_global(names::globals::SLOT_MASK, &mask, true);
    }
    if !shared.contains(&names::LEGACY_REDIRECTS) {
        // Nothing reads the legacy map on this install: one entry, unpinned.
        loader.map_max_entries(names::LEGACY_REDIRECTS, 1);
    }
    let pin_paths: Vec<(&'static str, std::path::PathBuf)> =
        pinned.iter().map(|name| (*name, paths.map(name))).collect();
    for (name, path) in &pin_paths {
        loader.map_pin_path(name, path.as_path());
    }
    let mut ebpf = loader.load(bytes)?;
    for name in names::PROGRAMS.into_iter().chain(names::UNATTACHED) {
        load_program(&mut ebpf, name)?;
    }
    let unpinned = shared
        .into_iter()
        .filter(|name| !pinned.contains(name) && ebpf.map(name).is_some())
        .collect();
    Ok(Loaded {
        ebpf,
        unpinned,
        socket_table_size: entries,
        notes: orphans.into_iter().chain(note).chain(slot_note).collect(),
    })
}

fn load_program(ebpf: &mut Ebpf, name: &'static str) -> Result<(), KernelError> {
    let result = match ebpf.program_mut(name) {
        Some(Program::CgroupSockAddr(program)) => program.load(),
        Some(Program::CgroupSock(program)) => program.load(),
        Some(Program::SockOps(program)) => program.load(),
        Some(Program::SkMsg(program)) => program.load(),
        Some(Program::Xdp(program)) => program.load(),
        _ => Err(ProgramError::UnexpectedProgramType),
    };
    result.map_err(|source| KernelError::Program { name, source })
}

/// A descriptor of one loaded program of this load.
pub fn program_fd(ebpf: &Ebpf, name: &'static str) -> Result<std::os::fd::OwnedFd, KernelError> {
    let program_error = |source| KernelError::Program { name, source };
    let fd = match ebpf.program(name) {
        Some(Program::CgroupSockAddr(program)) => program.fd().map_err(program_error)?,
        Some(Program::CgroupSock(program)) => program.fd().map_err(program_error)?,
        Some(Program::SockOps(program)) => program.fd().map_err(program_error)?,
        Some(Program::SkMsg(program)) => program.fd().map_err(program_error)?,
        Some(Program::Xdp(program)) => program.fd().map_err(program_error)?,
        _ => return Err(program_error(ProgramError::UnexpectedProgramType)),
    };
    std::os::fd::AsFd::as_fd(fd)
        .try_clone_to_owned()
        .map_err(|source| KernelError::Io {
            path: std::path::PathBuf::from(name),
            source,
        })
}

/// Attaches one program to a cgroup with a new bpf_link, which always lets
/// other programs run beside ours, and hands the link back for pinning.
pub fn attach(ebpf: &mut Ebpf, name: &'static str, cgroup: &File) -> Result<FdLink, KernelError> {
    let program_error = |source| KernelError::Program { name, source };
    // The program types share the attach API but no trait for it.
    macro_rules! attach_and_take_link {
        ($program:expr) => {{
            let id = $program
                .attach(cgroup, CgroupAttachMode::Single)
                .map_err(program_error)?;
            $program
                .take_link(id)
                .map_err(program_error)?
                .try_into()
                .map_err(|source| KernelError::Link { name, source })
        }};
    }
    match ebpf.program_mut(name) {
        Some(Program::CgroupSockAddr(program)) => attach_and_take_link!(program),
        Some(Program::CgroupSock(program)) => attach_and_take_link!(program),
        Some(Program::SockOps(program)) => attach_and_take_link!(program),
        _ => Err(program_error(ProgramError::UnexpectedProgramType)),
    }
}
