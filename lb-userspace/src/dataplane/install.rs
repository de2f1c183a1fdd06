//! Bringing the data plane up, whatever state the pin directory is in, and
//! taking it down.
//!
//! There is one path for a fresh install, an adoption after a restart, and
//! the completion of an install that a crash cut short:
//!
//! 1. load the programs, reusing every map that is pinned and creating the
//!    others;
//! 2. pin the new maps, one by one;
//! 3. fill the maps (`prepare`): on a fresh install before anything is
//!    attached, so the first redirected connect finds a full table;
//! 4. adopt each pinned link that attaches the right program to the right
//!    cgroup, and attach and pin a new link for each other one.
//!
//! A crash at any point leaves pins that the next start reuses, so it
//! completes what was begun. Removal runs in the opposite order (links
//! first, so redirection stops before the maps go); a removal cut short is
//! finished by the next `uninstall`, or completed back into a running
//! install by the next `run`.

use std::{
    os::fd::AsFd,
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
};

use aya::{Ebpf, maps::Map};
use lb_common::names;

use super::{
    Attachment, BpfMaps, CgroupTarget, KernelError, PinPaths, StoreError, migrate, object, sys,
};

/// Test-only: SIGKILL this process right after its N-th pin (or unpin), to
/// prove that a crash at any point of an install (or uninstall) is
/// completed by the next start. Never set in production.
pub const CRASH_AFTER_PINS: &str = "SOCKLB_TEST_CRASH_AFTER_PINS";

static PINS_DONE: AtomicU32 = AtomicU32::new(0);

/// Counts one pin or unpin, and dies if the test switch says so.
pub(crate) fn pinned_one() {
    let done = PINS_DONE.fetch_add(1, Ordering::SeqCst) + 1;
    let crash_at = std::env::var(CRASH_AFTER_PINS)
        .ok()
        .and_then(|text| text.parse::<u32>().ok());
    if crash_at == Some(done) {
        // SAFETY: raising a signal on ourselves; SIGKILL cannot be caught.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}

/// A running data plane: the programs of this load, the maps, the links.
pub struct Running {
    pub ebpf: Ebpf,
    pub maps: BpfMaps,
    pub attachment: Attachment,
    /// True when a previous install's maps were reused.
    pub adopted: bool,
    /// True when an install of the first layout was migrated.
    pub upgraded: bool,
    /// The maps this install keeps pinned.
    pub pinned: Vec<&'static str>,
    /// Sockets the socket table holds.
    pub socket_table_size: u32,
    /// What was found on the links and done about it, for the log.
    pub notes: Vec<String>,
}

/// Refuses a start whose links serve another cgroup: adopting them would
/// silently move every redirected process.
fn check_links_serve(paths: &PinPaths, cgroup: &CgroupTarget) -> Result<(), KernelError> {
    for (_, path) in paths.links() {
        let Ok(fd) = sys::open_pinned(&path) else {
            continue;
        };
        let Ok(info) = sys::link_info(fd.as_fd()) else {
            continue;
        };
        // 0: detached or defunct; that link is replaced, whatever it served.
        if info.cgroup_id != 0 && info.cgroup_id != cgroup.id {
            return Err(KernelError::CgroupMismatch {
                dir: paths.dir.clone(),
                pinned: info.cgroup_id,
                requested: cgroup.path.clone(),
                requested_id: cgroup.id,
            });
        }
    }
    Ok(())
}

/// Brings the data plane up under `paths`, attached to `cgroup`; see the
/// module documentation. `prepare` fills the maps.
pub fn bring_up(
    paths: &PinPaths,
    cgroup: CgroupTarget,
    options: object::LoadOptions<'_>,
    prepare: impl FnOnce(&mut BpfMaps) -> Result<(), StoreError>,
) -> Result<Running, KernelError> {
    check_links_serve(paths, &cgroup)?;
    let old = if migrate::old_layout_present(paths) {
        Some(migrate::read_old(paths)?)
    } else {
        migrate::drop_empty_legacy(paths);
        None
    };
    migrate::drop_unused_storage(paths);
    let slots = options.features.socket_slots;
    let adopted = paths.map(names::SERVICES).exists() || old.is_some();
    let pinned = object::pinned_maps(paths, slots);
    let object::Loaded {
        mut ebpf,
        unpinned,
        socket_table_size,
        notes: load_notes,
    } = object::load(paths, options)?;
    for name in unpinned {
        let path = paths.map(name);
        let map = ebpf.map(name).ok_or(KernelError::MissingMap(name))?;
        map.pin(&path)
            .map_err(|source| KernelError::Pin { path, source })?;
        pinned_one();
    }
    let mut maps = BpfMaps::open(|name| take_map(&mut ebpf, name))?;
    if let Some(old) = &old {
        migrate::carry_over(old, &mut maps, paths)?;
    }
    prepare(&mut maps)?;
    // The new connect programs look up only VIPs whose port bit is set;
    // an older daemon set none.
    maps.mark_every_vip_port()?;
    // Before sock_ops can add a socket to the sockhash: a socket takes the
    // sk_msg program the map has when it joins.
    attach_sk_msg(&ebpf, &maps, paths)?;
    let table = if slots {
        names::SOCKET_SLOTS
    } else {
        names::SOCKET_TABLE
    };
    let table_id = maps
        .fd(table)
        .ok_or(KernelError::MissingMap(table))
        .and_then(|fd| {
            sys::map_id(fd).map_err(|source| KernelError::Io {
                path: paths.map(table),
                source,
            })
        })?;
    let (attachment, mut notes) = Attachment::establish(paths, cgroup, &mut ebpf, table_id)?;
    notes.extend(load_notes);
    if let Some(old) = &old {
        let ids: Vec<u32> = old.backends.keys().copied().collect();
        migrate::hand_over_counts(paths, &ids)?;
        let removed = migrate::remove_old(paths)?;
        notes.push(format!(
            "upgraded an install of the first layout in place: its state carried over, the old maps ({}) unpinned",
            removed.join(", ")
        ));
    }
    Ok(Running {
        ebpf,
        maps,
        attachment,
        adopted,
        upgraded: old.is_some(),
        pinned,
        socket_table_size,
        notes,
    })
}

/// Whether this load's sk_msg program is the one attached to the
/// sockhash; `None` when the kernel cannot say (querying a sockhash needs
/// Linux 5.19).
pub fn sk_msg_attached(running: &Running) -> Option<bool> {
    let id = running.ebpf.program(names::SKMSG)?.info().ok()?.id();
    let map = running.maps.fd(names::SOCKHASH)?;
    Some(sys::sk_msg_programs(map).ok()?.contains(&id))
}

/// Attaches this load's sk_msg program to the sockhash again, after
/// someone detached it.
pub fn reattach_sk_msg(running: &Running, paths: &PinPaths) -> Result<(), KernelError> {
    attach_sk_msg(&running.ebpf, &running.maps, paths)
}

/// Attaches the sk_msg program to the sockhash, in place of the one a
/// previous load attached. The map holds it as long as the map lives.
fn attach_sk_msg(ebpf: &Ebpf, maps: &BpfMaps, paths: &PinPaths) -> Result<(), KernelError> {
    let program = object::program_fd(ebpf, names::SKMSG)?;
    let map = maps
        .fd(names::SOCKHASH)
        .ok_or(KernelError::MissingMap(names::SOCKHASH))?;
    sys::attach_to_map(
        map,
        program.as_fd(),
        aya_obj::generated::bpf_attach_type::BPF_SK_MSG_VERDICT,
    )
    .map_err(|source| KernelError::Io {
        path: paths.map(names::SOCKHASH),
        source,
    })
}

fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<Map, StoreError> {
    ebpf.take_map(name)
        .ok_or_else(|| StoreError::new(name, "not in the eBPF object"))
}

/// What one look at the map pins found.
#[derive(Debug, Default)]
pub struct MapPinCheck {
    /// Pins missing or holding another map, for the daemon to pin again
    /// from its own descriptors.
    pub missing: Vec<&'static str>,
    /// Pins that could not be opened because the daemon is out of
    /// descriptors or memory: not checked this time, and left as they are.
    pub unchecked: Vec<(&'static str, std::io::Error)>,
}

/// Compares the pins of `pinned` with the maps the daemon holds.
pub fn check_map_pins(paths: &PinPaths, maps: &BpfMaps, pinned: &[&'static str]) -> MapPinCheck {
    let mut check = MapPinCheck::default();
    for &name in pinned {
        let Some(ours) = maps.fd(name).and_then(|fd| sys::map_id(fd).ok()) else {
            continue;
        };
        match sys::open_pinned(&paths.map(name)).and_then(|fd| sys::map_id(fd.as_fd())) {
            Ok(id) if id == ours => {}
            Err(error) if sys::out_of_resources(&error) => check.unchecked.push((name, error)),
            _ => check.missing.push(name),
        }
    }
    check
}

/// Pins a map again from the daemon's descriptor (after someone removed
/// its pin, or the whole directory), replacing what is there in one rename
/// so that a reader never finds the path empty.
pub fn repin_map(paths: &PinPaths, maps: &BpfMaps, name: &'static str) -> Result<(), KernelError> {
    super::pins::prepare_pin_dir(paths)?;
    let fd = maps.fd(name).ok_or(KernelError::MissingMap(name))?;
    let staging = paths.staging(name);
    let _ = std::fs::remove_file(&staging);
    sys::pin(fd, &staging).map_err(|source| KernelError::Io {
        path: staging.clone(),
        source,
    })?;
    let path = paths.map(name);
    std::fs::rename(&staging, &path).map_err(|source| KernelError::Io { path, source })
}

/// What [`remove_pins`] did.
#[derive(Debug, Default)]
pub struct Removal {
    pub removed: Vec<PathBuf>,
    /// Accelerated sockets still open, for which the sockhash kept its pin.
    pub accelerated_open: usize,
}

/// Removes every pin socklb owns under `paths`, links first so that
/// redirection stops before the maps go, then the directory if it is
/// empty. Nothing else is touched.
///
/// Acceleration stops first (`ACCEL` emptied: every message takes the
/// normal path). A sockhash that still holds sockets keeps its pin: freeing
/// it would take the sockets out and drop the bytes already moved into a
/// reader's queue and not yet read. It goes with the next uninstall after
/// those connections closed.
pub fn remove_pins(paths: &PinPaths) -> Removal {
    stop_accelerating(paths);
    let sockhash = paths.map(names::SOCKHASH);
    let accelerated_open = sys::open_pinned(&sockhash)
        .and_then(|fd| sys::map_keys::<lb_common::SockKey>(fd.as_fd(), usize::MAX))
        .map_or(0, |keys| keys.len());
    let mut removed = Vec::new();
    for path in paths.all() {
        if accelerated_open > 0 && path == sockhash {
            continue;
        }
        if std::fs::remove_file(&path).is_ok() {
            removed.push(path);
            pinned_one();
        }
    }
    // Fails, harmlessly, if someone else keeps files there.
    let _ = std::fs::remove_dir(&paths.dir);
    Removal {
        removed,
        accelerated_open,
    }
}

/// Empties `ACCEL`, so that the sk_msg program redirects no more message.
fn stop_accelerating(paths: &PinPaths) {
    let Ok(data) = aya::maps::MapData::from_pin(paths.map(names::ACCEL)) else {
        return;
    };
    let Ok(mut accel) =
        aya::maps::HashMap::<_, lb_common::Endpoint, u32>::try_from(Map::HashMap(data))
    else {
        return;
    };
    let backends: Vec<lb_common::Endpoint> = accel.keys().flatten().collect();
    for backend in backends {
        let _ = accel.remove(&backend);
    }
}

/// The shared map store of a pinned install, for the commands that only
/// read or record (status, drain).
pub fn open_pinned(paths: &PinPaths) -> Result<BpfMaps, KernelError> {
    if !paths.map(names::SERVICES).exists() {
        return Err(KernelError::NotInstalled(paths.dir.clone()));
    }
    Ok(BpfMaps::open_pinned(paths)?)
}

/// The ring buffer of failed connects that sock_ops fills.
pub fn open_connect_failures(
    paths: &PinPaths,
) -> Result<aya::maps::RingBuf<aya::maps::MapData>, KernelError> {
    let name = names::CONNECT_FAILURES;
    let store_error = |source: aya::maps::MapError| StoreError::new(name, source);
    let data = aya::maps::MapData::from_pin(paths.map(name))
        .map_err(|source| StoreError::new(name, source))?;
    Ok(Map::from_map_data(data)
        .map_err(store_error)?
        .try_into()
        .map_err(store_error)?)
}
