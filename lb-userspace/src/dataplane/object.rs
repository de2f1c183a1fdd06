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
use lb_common::names;

use super::{KernelError, PinPaths, features::Features};

/// The eBPF object, built and placed in OUT_DIR by build.rs (aya-build).
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb-ebpf"));

/// Log level of the kernel programs, fixed when they are loaded. `Off`
/// keeps logging out of the connect path entirely: the verifier removes the
/// dead branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BpfLogLevel {
    Off,
    Error,
    Warn,
    Info,
    Debug,
}

impl BpfLogLevel {
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

/// The programs of one load, ready to attach, and the maps it created that
/// are not pinned yet.
pub struct Loaded {
    pub ebpf: Ebpf,
    pub unpinned: Vec<&'static str>,
}

/// The SHA-256 of the embedded object: which programs an install runs.
pub fn object_sha256() -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, EBPF_OBJECT);
    let mut sha = [0u8; 32];
    sha.copy_from_slice(digest.as_ref());
    sha
}

/// The maps this load pins: socklb's own, and the legacy per-socket map
/// when it is in use (a kernel without socket storage in sock_addr, or one
/// that an upgrade left with sockets in it).
pub fn pinned_maps(paths: &PinPaths, features: &Features) -> Vec<&'static str> {
    let mut maps = names::MAPS.to_vec();
    if !features.sk_storage || paths.map(names::LEGACY_REDIRECTS).exists() {
        maps.push(names::LEGACY_REDIRECTS);
    }
    maps
}

/// A pinned map that does not match the object's definition.
fn layout_problem(paths: &PinPaths, name: &str, object: &aya_obj::Object) -> Option<String> {
    let wanted = object.maps.get(name)?;
    let found = MapInfo::from_pin(paths.map(name)).ok()?;
    let found_type = found.map_type().map_or(u32::MAX, |kind| kind as u32);
    let pairs = [
        ("type", found_type, wanted.map_type()),
        ("key size", found.key_size(), wanted.key_size()),
        ("value size", found.value_size(), wanted.value_size()),
        ("max entries", found.max_entries(), wanted.max_entries()),
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
pub fn load(
    paths: &PinPaths,
    log_level: BpfLogLevel,
    features: &Features,
) -> Result<Loaded, KernelError> {
    if EBPF_OBJECT.is_empty() {
        return Err(KernelError::NoObject);
    }
    let object = aya_obj::Object::parse(EBPF_OBJECT).map_err(|error| KernelError::Object {
        problem: error.to_string(),
    })?;
    let shared = pinned_maps(paths, features);
    for &name in &shared {
        if let Some(problem) = layout_problem(paths, name, &object) {
            return Err(KernelError::Layout {
                path: paths.map(name),
                problem,
            });
        }
    }
    let pinned: Vec<&'static str> = shared
        .iter()
        .copied()
        .filter(|name| paths.map(name).exists())
        .collect();
    let level = log_level.as_u8();
    let bits = features.bits();
    let mut loader = EbpfLoader::new();
    loader.override_global("AYA_LOG_LEVEL", &level, false);
    loader.override_global(names::globals::FEATURES, &bits, true);
    if !shared.contains(&names::LEGACY_REDIRECTS) {
        // Nothing uses the legacy map on this install: one entry, unpinned.
        loader.map_max_entries(names::LEGACY_REDIRECTS, 1);
    }
    let pin_paths: Vec<(&'static str, std::path::PathBuf)> =
        pinned.iter().map(|name| (*name, paths.map(name))).collect();
    for (name, path) in &pin_paths {
        loader.map_pin_path(name, path.as_path());
    }
    let mut ebpf = loader.load(EBPF_OBJECT)?;
    for name in names::PROGRAMS.into_iter().chain([names::SKMSG]) {
        load_program(&mut ebpf, name)?;
    }
    let unpinned = shared
        .into_iter()
        .filter(|name| !pinned.contains(name) && ebpf.map(name).is_some())
        .collect();
    Ok(Loaded { ebpf, unpinned })
}

fn load_program(ebpf: &mut Ebpf, name: &'static str) -> Result<(), KernelError> {
    let result = match ebpf.program_mut(name) {
        Some(Program::CgroupSockAddr(program)) => program.load(),
        Some(Program::SockOps(program)) => program.load(),
        Some(Program::SkMsg(program)) => program.load(),
        _ => Err(ProgramError::UnexpectedProgramType),
    };
    result.map_err(|source| KernelError::Program { name, source })
}

/// A descriptor of one loaded program of this load.
pub fn program_fd(ebpf: &Ebpf, name: &'static str) -> Result<std::os::fd::OwnedFd, KernelError> {
    let program_error = |source| KernelError::Program { name, source };
    let fd = match ebpf.program(name) {
        Some(Program::CgroupSockAddr(program)) => program.fd().map_err(program_error)?,
        Some(Program::SockOps(program)) => program.fd().map_err(program_error)?,
        Some(Program::SkMsg(program)) => program.fd().map_err(program_error)?,
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
    // The two program types share the attach API but no trait for it.
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
        Some(Program::SockOps(program)) => attach_and_take_link!(program),
        _ => Err(program_error(ProgramError::UnexpectedProgramType)),
    }
}
