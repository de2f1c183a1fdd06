//! Upgrading an install of the first layout (unversioned map names) in
//! place, with no gap.
//!
//! A start finds the old maps pinned beside the new names. It creates the
//! new maps, carries the old state into them before anything is written
//! (backend and table records, with their ids and health; drains; settings;
//! the connection and redirect counters), and the daemon then writes its
//! tables into the new maps while the old programs keep serving from the
//! old ones. Each link is then switched to the new program with
//! BPF_LINK_UPDATE, atomically, and the old maps are unpinned. The old
//! per-socket LRU (`REDIRECTS`) has the new layout's legacy name and is
//! kept while sockets redirected before the upgrade live: the new
//! getpeername and sock_ops programs read it for them.
//!
//! An install of the socket-storage layout (`lb_sockets_v1`, the layout
//! before the socket table) needs no migration of its maps: the new
//! programs file new sockets in the socket table, and read the storage of
//! the sockets it redirected while any of them lives
//! ([`drop_unused_storage`]).
//!
//! The live connection counts move last: after every link runs the new
//! programs, the old program can no longer change its counters, and each
//! final count is added to the new one. Only a connection that opens or
//! closes within the microseconds of that read and write can be
//! miscounted.

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, PerCpuArray, PerCpuValues};
use lb_common::{
    BackendConns, BackendInfo, BackendStats, Endpoint, Settings, TableInfo, TableStats, names,
    v0::BackendConnsV0,
};

use super::{BpfMaps, KernelError, MapStore, PinPaths, StoreError};

/// What an install of the first layout held, read from its pins.
#[derive(Debug, Default)]
pub struct OldState {
    pub settings: Option<Settings>,
    pub backends: BTreeMap<u32, BackendInfo>,
    pub tables: BTreeMap<u32, TableInfo>,
    pub drains: BTreeSet<Endpoint>,
    pub backend_stats: BTreeMap<u32, Vec<BackendStats>>,
    pub table_stats: BTreeMap<u32, Vec<TableStats>>,
}

/// Whether an install of the first layout is pinned here.
pub fn old_layout_present(paths: &PinPaths) -> bool {
    paths.map(names::v0::SERVICES).exists()
}

fn open(paths: &PinPaths, name: &'static str) -> Result<Map, StoreError> {
    let data = MapData::from_pin(paths.map(name)).map_err(|error| StoreError::new(name, error))?;
    Map::from_map_data(data).map_err(|error| StoreError::new(name, error))
}

fn typed<T: TryFrom<Map, Error = aya::maps::MapError>>(
    paths: &PinPaths,
    name: &'static str,
) -> Result<T, StoreError> {
    open(paths, name)?
        .try_into()
        .map_err(|error| StoreError::new(name, error))
}

/// Reads the state of the first layout.
pub fn read_old(paths: &PinPaths) -> Result<OldState, StoreError> {
    use lb_common::{MAX_BACKENDS, MAX_TABLES};
    let settings: Array<MapData, Settings> = typed(paths, names::v0::SETTINGS)?;
    let backends: BpfHashMap<MapData, u32, BackendInfo> = typed(paths, names::v0::BACKENDS)?;
    let tables: BpfHashMap<MapData, u32, TableInfo> = typed(paths, names::v0::TABLES)?;
    let drains: BpfHashMap<MapData, Endpoint, u32> = typed(paths, names::v0::DRAINS)?;
    let backend_stats: PerCpuArray<MapData, BackendStats> = typed(paths, names::v0::BACKEND_STATS)?;
    let table_stats: PerCpuArray<MapData, TableStats> = typed(paths, names::v0::TABLE_STATS)?;
    let backends: BTreeMap<u32, BackendInfo> = backends.iter().filter_map(Result::ok).collect();
    let mut state = OldState {
        settings: settings.get(&0, 0).ok(),
        tables: tables.iter().filter_map(Result::ok).collect(),
        drains: drains.keys().filter_map(Result::ok).collect(),
        ..OldState::default()
    };
    for &id in backends.keys().filter(|id| **id < MAX_BACKENDS) {
        if let Ok(values) = backend_stats.get(&id, 0) {
            state
                .backend_stats
                .insert(id, values.iter().copied().collect());
        }
    }
    for &id in state.tables.keys().filter(|id| **id < MAX_TABLES) {
        if let Ok(values) = table_stats.get(&id, 0) {
            state
                .table_stats
                .insert(id, values.iter().copied().collect());
        }
    }
    state.backends = backends;
    Ok(state)
}

/// Carries the old state into the new maps, before the first write: the
/// records (so adoption finds the ids, health and services), drains,
/// settings, and counters by id.
pub fn carry_over(old: &OldState, maps: &mut BpfMaps, paths: &PinPaths) -> Result<(), StoreError> {
    if let Some(settings) = old.settings {
        maps.put_settings(&settings)?;
    }
    for (id, info) in &old.tables {
        maps.put_table(*id, info)?;
    }
    for (id, info) in &old.backends {
        maps.put_backend(*id, info)?;
    }
    for drain in &old.drains {
        maps.put_drain(drain)?;
    }
    let mut backend_stats: PerCpuArray<MapData, BackendStats> = typed(paths, names::BACKEND_STATS)?;
    for (id, values) in &old.backend_stats {
        let values = PerCpuValues::try_from(values.clone())
            .map_err(|error| StoreError::new(names::BACKEND_STATS, error))?;
        backend_stats
            .set(*id, values, 0)
            .map_err(|error| StoreError::new(names::BACKEND_STATS, error))?;
    }
    let mut table_stats: PerCpuArray<MapData, TableStats> = typed(paths, names::TABLE_STATS)?;
    for (id, values) in &old.table_stats {
        let values = PerCpuValues::try_from(values.clone())
            .map_err(|error| StoreError::new(names::TABLE_STATS, error))?;
        table_stats
            .set(*id, values, 0)
            .map_err(|error| StoreError::new(names::TABLE_STATS, error))?;
    }
    Ok(())
}

/// Adds the old live counts to the new ones, once every link runs the new
/// programs (the new counters hold what happened since the switch).
pub fn hand_over_counts(paths: &PinPaths, backend_ids: &[u32]) -> Result<(), StoreError> {
    let old: Array<MapData, BackendConnsV0> = typed(paths, names::v0::BACKEND_CONNS)?;
    let mut new: Array<MapData, BackendConns> = typed(paths, names::BACKEND_CONNS)?;
    for &id in backend_ids {
        let Ok(before) = old.get(&id, 0) else {
            continue;
        };
        let now = new.get(&id, 0).unwrap_or_default();
        let value = BackendConns {
            live: now.live + before.live,
            failed_connects: now.failed_connects + before.failed_connects,
            consecutive_failures: now.consecutive_failures,
        };
        new.set(id, value, 0)
            .map_err(|error| StoreError::new(names::BACKEND_CONNS, error))?;
    }
    Ok(())
}

/// Unpins the old maps once every link runs the new programs. The old
/// per-socket LRU stays (under the legacy name) while it holds sockets.
pub fn remove_old(paths: &PinPaths) -> Result<Vec<&'static str>, KernelError> {
    let mut removed = Vec::new();
    for name in names::v0::MAPS {
        if name == names::LEGACY_REDIRECTS {
            continue;
        }
        let path = paths.map(name);
        if path.exists() {
            std::fs::remove_file(&path).map_err(|source| KernelError::Io { path, source })?;
            removed.push(name);
        }
    }
    Ok(removed)
}

/// Unpins the legacy per-socket map when no socket is left in it; returns
/// whether it did.
pub fn drop_empty_legacy(paths: &PinPaths) -> bool {
    let path = paths.map(names::LEGACY_REDIRECTS);
    let Ok(map) =
        typed::<BpfHashMap<MapData, u64, lb_common::SocketRecord>>(paths, names::LEGACY_REDIRECTS)
    else {
        return false;
    };
    map.keys().next().is_none() && std::fs::remove_file(path).is_ok()
}

/// Unpins the previous layout's socket storage when no socket of this
/// network namespace holds a record in it; returns whether it did. It is
/// kept while a pinned table redirects other namespaces too (the dump
/// cannot see their sockets), and when the dump fails.
pub fn drop_unused_storage(paths: &PinPaths) -> bool {
    let path = paths.map(names::SOCKETS);
    let Ok(storage) = super::sys::open_pinned(&path) else {
        return false;
    };
    let other_namespaces = typed::<BpfHashMap<MapData, u32, TableInfo>>(paths, names::TABLES)
        .map(|tables| {
            tables
                .iter()
                .filter_map(Result::ok)
                .any(|(_, info)| info.flags & lb_common::SERVICE_FLAG_ALL_NETNS != 0)
        })
        .unwrap_or(true);
    if other_namespaces {
        return false;
    }
    let in_use = crate::sockets::sockets_with_storage(std::os::fd::AsFd::as_fd(&storage));
    matches!(in_use, Ok(0)) && std::fs::remove_file(path).is_ok()
}
