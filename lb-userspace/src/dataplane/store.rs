//! The maps behind a small trait, so that what the daemon decides (write a
//! table, verify it, repair it, drain, seed health on adoption) is tested
//! without root against [`MemoryMaps`], and runs against [`BpfMaps`].

use std::{
    collections::{BTreeMap, BTreeSet},
    os::fd::{AsFd, OwnedFd},
    sync::Arc,
};

use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, MapError, PerCpuArray, PerCpuValues};
use lb_common::{
    BackendConns, BackendInfo, BackendSlot, BackendStats, DaemonRecord, Endpoint, Liveness,
    MAX_ACCEL_SOCKETS, MAX_BACKENDS, MAX_DRAINS, MAX_SLOTS, MAX_TABLES, MAX_VIPS, ServiceEntry,
    Settings, SockKey, SocketRecord, SocketTableStats, TableInfo, TableStats, TrackedSocket, names,
    vip_port_bit,
};

use super::{slots::SlotTable, sys};

/// A map operation that failed, naming the map.
#[derive(Debug, thiserror::Error)]
#[error("map {map}")]
pub struct StoreError {
    pub map: &'static str,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl StoreError {
    pub fn new(
        map: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            map,
            source: source.into(),
        }
    }
}

fn failed<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
    map: &'static str,
) -> impl FnOnce(E) -> StoreError {
    move |source| StoreError::new(map, source)
}

/// What socklb reads and writes in its maps. The kernel's counters are read
/// and reset only; everything else is written by the daemon alone (or by
/// `socklb drain` while no daemon runs).
pub trait MapStore {
    fn services(&self) -> Result<Vec<(Endpoint, ServiceEntry)>, StoreError>;
    fn put_service(&mut self, vip: &Endpoint, entry: &ServiceEntry) -> Result<(), StoreError>;
    fn delete_service(&mut self, vip: &Endpoint) -> Result<(), StoreError>;
    /// Whether a port's bit is set in `VIP_PORTS` (true for an install
    /// without the map, whose programs do not read it).
    fn vip_port_marked(&self, port_be: u16) -> Result<bool, StoreError>;
    /// `count` slots from index `first` of `SLOTS`.
    fn slots(&self, first: u32, count: u32) -> Result<Vec<BackendSlot>, StoreError>;
    fn put_slots(&mut self, first: u32, slots: &[BackendSlot]) -> Result<(), StoreError>;
    fn backends(&self) -> Result<Vec<(u32, BackendInfo)>, StoreError>;
    fn put_backend(&mut self, id: u32, info: &BackendInfo) -> Result<(), StoreError>;
    fn delete_backend(&mut self, id: u32) -> Result<(), StoreError>;
    fn tables(&self) -> Result<Vec<(u32, TableInfo)>, StoreError>;
    fn put_table(&mut self, id: u32, info: &TableInfo) -> Result<(), StoreError>;
    fn delete_table(&mut self, id: u32) -> Result<(), StoreError>;
    fn settings(&self) -> Result<Settings, StoreError>;
    fn put_settings(&mut self, settings: &Settings) -> Result<(), StoreError>;
    fn drains(&self) -> Result<BTreeSet<Endpoint>, StoreError>;
    /// Local backends of accelerating services (`ACCEL`).
    fn accelerated(&self) -> Result<BTreeSet<Endpoint>, StoreError>;
    fn put_accelerated(&mut self, backend: &Endpoint) -> Result<(), StoreError>;
    fn delete_accelerated(&mut self, backend: &Endpoint) -> Result<(), StoreError>;
    /// The keys of the sockets in `SOCKHASH` that still redirect (not in
    /// `PASSED`).
    fn accelerated_sockets(&self) -> Vec<SockKey>;
    fn put_drain(&mut self, backend: &Endpoint) -> Result<(), StoreError>;
    fn delete_drain(&mut self, backend: &Endpoint) -> Result<(), StoreError>;
    fn daemon(&self) -> Result<DaemonRecord, StoreError>;
    fn put_daemon(&mut self, record: &DaemonRecord) -> Result<(), StoreError>;
    /// Zeroes a backend's redirect and connection counters (a reused id).
    fn reset_backend_counters(&mut self, id: u32) -> Result<(), StoreError>;
    /// Zeroes a table's "none healthy" counters (a reused id).
    fn reset_table_counters(&mut self, id: u32) -> Result<(), StoreError>;
    /// What sock_ops counted for one backend; `live` clamped at zero. A
    /// read that fails is an error, never zeros: a busy id read as idle
    /// would be given to another backend.
    fn connections(&self, id: u32) -> Result<BackendConns, StoreError>;
    /// Redirects of one backend, summed over CPUs.
    fn redirects(&self, id: u32) -> u64;
    /// "None healthy" counters of one table, summed over CPUs.
    fn table_stats(&self, id: u32) -> TableStats;
    /// Whether socklb sent the socket with this cookie to `backend`, by its
    /// record in the socket table or, for a socket the first layout
    /// redirected before an upgrade, in its LRU. (A socket redirected by
    /// the socket-storage layout carries its record itself: sock_diag
    /// reads it.)
    fn redirected_to(&self, cookie: u64, backend: &Endpoint) -> bool;
    /// Writes the daemon's heartbeat as the connect programs read it.
    fn put_liveness(&mut self, liveness: &Liveness) -> Result<(), StoreError>;
    /// The heartbeat as the connect programs read it (status: whether a
    /// table is handed back now).
    fn liveness(&self) -> Result<Liveness, StoreError>;
    /// Every record of the socket table, with its socket cookie.
    fn tracked_sockets(&self) -> Result<Vec<(u64, TrackedSocket)>, StoreError>;
    /// Removes one record of the socket table (the sweep's, for a socket
    /// that is gone) if it still reads `read`, as the sweep read it. True
    /// if this call removed it; a record that changed (its socket connected
    /// again meanwhile) stays.
    fn forget_socket(&mut self, cookie: u64, read: &TrackedSocket) -> Result<bool, StoreError>;
    /// The socket table's size, use and memory.
    fn socket_table(&self) -> Result<SocketTableUse, StoreError>;
}

/// Whether the socket table (the array's slots, or else the hash), or else
/// the first layout's LRU, says socklb sent the socket with this cookie to
/// `backend`.
pub fn redirected_by_cookie(
    slots: Option<&SlotTable>,
    table: Option<&BpfHashMap<MapData, u64, TrackedSocket>>,
    legacy: Option<&BpfHashMap<MapData, u64, SocketRecord>>,
    cookie: u64,
    backend: &Endpoint,
) -> bool {
    if let Some(tracked) = slots.and_then(|slots| slots.get(cookie)) {
        return tracked.record.backend == *backend;
    }
    let in_table = table.is_some_and(|map| {
        map.get(&cookie, 0)
            .is_ok_and(|tracked| tracked.record.backend == *backend)
    });
    in_table
        || legacy.is_some_and(|map| {
            map.get(&cookie, 0)
                .is_ok_and(|record| record.backend == *backend)
        })
}

/// The socket table as status shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketTableUse {
    /// The most sockets it can hold, fixed when it was made: the hash's
    /// `socket-table-size`, plus the array layout's slots.
    pub capacity: u32,
    /// Sockets it holds now.
    pub tracked: u64,
    /// The array layout's slots (0 in the hash layout). A socket whose
    /// few slots are taken goes to the hash, so `socket-table-size`
    /// sockets are always tracked, and up to `capacity` when their
    /// cookies spread over the array.
    pub slots: u32,
    /// No room for another socket: the hash is full (a socket finding its
    /// slots taken goes untracked).
    pub full: bool,
    /// Kernel memory it takes, all of it allocated when it was made.
    pub memory_bytes: u64,
    /// Connects redirected without a record since install (table full).
    pub untracked: u64,
}

/// The pinned (or freshly loaded) maps, typed, with a duplicate descriptor
/// of each for batch reads and for pinning it again.
pub struct BpfMaps {
    /// The ports some VIP uses, one bit each (absent in an install of an
    /// older socklb, whose programs do not read it, and which `status`
    /// may read).
    vip_ports: Option<Array<MapData, u64>>,
    services: BpfHashMap<MapData, Endpoint, ServiceEntry>,
    slots: Array<MapData, BackendSlot>,
    /// The legacy per-socket LRU, when this install has one.
    legacy: Option<BpfHashMap<MapData, u64, SocketRecord>>,
    /// The socket table of the array layout, mapped (shared with the
    /// sweeps, which run on other threads).
    socket_slots: Option<Arc<SlotTable>>,
    /// The socket table's hash (the whole table in the hash layout; in the
    /// array layout, the sockets that found their slots taken and those
    /// an upgrade left there), its counter, and the heartbeat the connect
    /// programs read (absent in an install of an older socklb, which
    /// `status` may read).
    socket_table: Option<BpfHashMap<MapData, u64, TrackedSocket>>,
    socket_table_stats: Option<PerCpuArray<MapData, SocketTableStats>>,
    liveness: Option<Array<MapData, Liveness>>,
    backends: BpfHashMap<MapData, u32, BackendInfo>,
    tables: BpfHashMap<MapData, u32, TableInfo>,
    backend_stats: PerCpuArray<MapData, BackendStats>,
    backend_conns: Array<MapData, BackendConns>,
    drains: BpfHashMap<MapData, Endpoint, u32>,
    /// Local backends of accelerating services (absent in an install of a
    /// socklb before acceleration, which `status` may read).
    accel: Option<BpfHashMap<MapData, Endpoint, u32>>,
    table_stats: PerCpuArray<MapData, TableStats>,
    settings: Array<MapData, Settings>,
    daemon: Array<MapData, DaemonRecord>,
    fds: BTreeMap<&'static str, OwnedFd>,
}

/// The data of a map of the kinds socklb uses.
fn map_data(map: &Map) -> Option<&MapData> {
    match map {
        Map::Array(data)
        | Map::HashMap(data)
        | Map::LruHashMap(data)
        | Map::PerCpuArray(data)
        | Map::SkStorage(data)
        | Map::SockHash(data)
        | Map::RingBuf(data) => Some(data),
        _ => None,
    }
}

impl BpfMaps {
    /// Opens every map through `open(name)`, typed. The legacy per-socket
    /// map is optional.
    pub fn open(
        mut open: impl FnMut(&'static str) -> Result<Map, StoreError>,
    ) -> Result<Self, StoreError> {
        let mut fds = BTreeMap::new();
        let mut take = |name: &'static str| -> Result<Map, StoreError> {
            let map = open(name)?;
            let data = map_data(&map)
                .ok_or_else(|| StoreError::new(name, "a map of an unexpected type"))?;
            let fd = data
                .fd()
                .as_fd()
                .try_clone_to_owned()
                .map_err(failed(name))?;
            fds.insert(name, fd);
            Ok(map)
        };
        macro_rules! typed {
            ($name:expr) => {
                take($name)?.try_into().map_err(failed::<MapError>($name))?
            };
        }
        let maps = Self {
            vip_ports: None,
            services: typed!(names::SERVICES),
            slots: typed!(names::SLOTS),
            legacy: None,
            socket_slots: None,
            socket_table: None,
            socket_table_stats: None,
            liveness: None,
            backends: typed!(names::BACKENDS),
            tables: typed!(names::TABLES),
            backend_stats: typed!(names::BACKEND_STATS),
            backend_conns: typed!(names::BACKEND_CONNS),
            drains: typed!(names::DRAINS),
            accel: None,
            table_stats: typed!(names::TABLE_STATS),
            settings: typed!(names::SETTINGS),
            daemon: typed!(names::DAEMON),
            fds: BTreeMap::new(),
        };
        // The ring buffers are read through handles of their own (the
        // daemon's, aya-log's); only their descriptors are kept here, to pin
        // them again if need be. An install of an older socklb may lack
        // AYA_LOGS.
        take(names::CONNECT_FAILURES)?;
        let _ = take(names::AYA_LOGS);
        // Pinned only while sockets of an upgraded install need it.
        let _ = take(names::SOCKETS);
        let socket_slots = match take(names::SOCKET_SLOTS) {
            Ok(map) => Some(map_slots(&map)?),
            Err(_) => None,
        };
        let socket_table = take(names::SOCKET_TABLE)
            .ok()
            .and_then(|map| map.try_into().ok());
        let socket_table_stats = take(names::SOCKET_TABLE_STATS)
            .ok()
            .and_then(|map| map.try_into().ok());
        let liveness = take(names::LIVENESS)
            .ok()
            .and_then(|map| map.try_into().ok());
        let vip_ports = take(names::VIP_PORTS)
            .ok()
            .and_then(|map| map.try_into().ok());
        // Absent from an install of a socklb before acceleration.
        let _ = take(names::SOCKHASH);
        let _ = take(names::ACCEL_PENDING);
        let _ = take(names::PASSED);
        let accel = take(names::ACCEL).ok().and_then(|map| map.try_into().ok());
        let legacy = take(names::LEGACY_REDIRECTS)
            .ok()
            .and_then(|map| map.try_into().ok());
        Ok(Self {
            fds,
            vip_ports,
            legacy,
            accel,
            socket_slots,
            socket_table,
            socket_table_stats,
            liveness,
            ..maps
        })
    }

    /// Sets or clears the bit of one port in `VIP_PORTS`, if this install
    /// has the map. Only the daemon writes it.
    fn mark_vip_port(&mut self, port_be: u16, used: bool) -> Result<(), StoreError> {
        let Some(ports) = self.vip_ports.as_mut() else {
            return Ok(());
        };
        let (word, mask) = vip_port_bit(port_be);
        let bits = ports.get(&word, 0).map_err(failed(names::VIP_PORTS))?;
        let marked = if used { bits | mask } else { bits & !mask };
        if marked == bits {
            return Ok(());
        }
        ports.set(word, marked, 0).map_err(failed(names::VIP_PORTS))
    }

    /// Sets the port bit of every VIP in `SERVICES`: the loader's step
    /// before it attaches programs that read `VIP_PORTS`, so that a VIP an
    /// older socklb wrote (whose daemon kept no port bits) is not missed.
    pub fn mark_every_vip_port(&mut self) -> Result<(), StoreError> {
        for (vip, _) in self.services()? {
            self.mark_vip_port(vip.port_be, true)?;
        }
        Ok(())
    }

    /// Opens the maps pinned under a directory.
    pub fn open_pinned(paths: &super::PinPaths) -> Result<Self, StoreError> {
        Self::open(|name| {
            let data = MapData::from_pin(paths.map(name)).map_err(failed::<MapError>(name))?;
            Map::from_map_data(data).map_err(failed::<MapError>(name))
        })
    }

    /// The descriptor of a map, for pinning it again.
    pub fn fd(&self, name: &str) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.fds.get(name).map(AsFd::as_fd)
    }

    fn dump<K: aya::Pod + Default, V: aya::Pod + Default>(
        &self,
        name: &'static str,
        limit: u32,
    ) -> Result<Vec<(K, V)>, StoreError> {
        let fd = self
            .fd(name)
            .ok_or_else(|| StoreError::new(name, "not open"))?;
        sys::lookup_batch(fd, None, limit as usize).map_err(failed(name))
    }
}

/// Maps the array layout's socket table. Absent in the hash layout;
/// present, it must be mapped: the sweep and status could not see its
/// records otherwise.
fn map_slots(map: &Map) -> Result<Arc<SlotTable>, StoreError> {
    let name = names::SOCKET_SLOTS;
    let data = map_data(map).ok_or_else(|| StoreError::new(name, "not a map"))?;
    let slots = data.info().map_err(failed(name))?.max_entries();
    let table = SlotTable::map(data.fd().as_fd(), slots).map_err(failed(name))?;
    Ok(Arc::new(table))
}

fn per_cpu_zeros<T: aya::Pod + Default + Clone>(
    map: &'static str,
) -> Result<PerCpuValues<T>, StoreError> {
    let cpus = aya::util::nr_cpus().map_err(|(_, error)| StoreError::new(map, error))?;
    PerCpuValues::try_from(vec![T::default(); cpus]).map_err(failed(map))
}

fn absent_is_ok(result: Result<(), MapError>) -> Result<(), MapError> {
    match result {
        Err(MapError::KeyNotFound) => Ok(()),
        other => other,
    }
}

impl MapStore for BpfMaps {
    fn services(&self) -> Result<Vec<(Endpoint, ServiceEntry)>, StoreError> {
        self.dump(names::SERVICES, MAX_VIPS)
    }

    fn put_service(&mut self, vip: &Endpoint, entry: &ServiceEntry) -> Result<(), StoreError> {
        // The port first: a VIP whose port bit is clear is never looked up.
        self.mark_vip_port(vip.port_be, true)?;
        self.services
            .insert(vip, entry, 0)
            .map_err(failed(names::SERVICES))
    }

    fn delete_service(&mut self, vip: &Endpoint) -> Result<(), StoreError> {
        absent_is_ok(self.services.remove(vip)).map_err(failed(names::SERVICES))?;
        // The port's bit goes after the last VIP on it.
        let port_in_use = self
            .services()?
            .iter()
            .any(|(other, _)| other.port_be == vip.port_be);
        if port_in_use {
            return Ok(());
        }
        self.mark_vip_port(vip.port_be, false)
    }

    fn vip_port_marked(&self, port_be: u16) -> Result<bool, StoreError> {
        let Some(ports) = self.vip_ports.as_ref() else {
            return Ok(true);
        };
        let (word, mask) = vip_port_bit(port_be);
        let bits = ports.get(&word, 0).map_err(failed(names::VIP_PORTS))?;
        Ok(bits & mask != 0)
    }

    fn slots(&self, first: u32, count: u32) -> Result<Vec<BackendSlot>, StoreError> {
        if count == 0 {
            return Ok(Vec::new());
        }
        let fd = self
            .fd(names::SLOTS)
            .ok_or_else(|| StoreError::new(names::SLOTS, "not open"))?;
        // The batch cursor of an array is the index before the next one.
        let entries: Vec<(u32, BackendSlot)> =
            sys::lookup_batch(fd, first.checked_sub(1), count as usize)
                .map_err(failed(names::SLOTS))?;
        Ok(entries.into_iter().map(|(_, slot)| slot).collect())
    }

    fn put_slots(&mut self, first: u32, slots: &[BackendSlot]) -> Result<(), StoreError> {
        if u64::from(first) + slots.len() as u64 > u64::from(MAX_SLOTS) {
            return Err(StoreError::new(
                names::SLOTS,
                "slots past the end of the map",
            ));
        }
        for (offset, slot) in slots.iter().enumerate() {
            self.slots
                .set(first + offset as u32, slot, 0)
                .map_err(failed(names::SLOTS))?;
        }
        Ok(())
    }

    fn backends(&self) -> Result<Vec<(u32, BackendInfo)>, StoreError> {
        self.dump(names::BACKENDS, MAX_BACKENDS)
    }

    fn put_backend(&mut self, id: u32, info: &BackendInfo) -> Result<(), StoreError> {
        self.backends
            .insert(id, info, 0)
            .map_err(failed(names::BACKENDS))
    }

    fn delete_backend(&mut self, id: u32) -> Result<(), StoreError> {
        absent_is_ok(self.backends.remove(&id)).map_err(failed(names::BACKENDS))
    }

    fn tables(&self) -> Result<Vec<(u32, TableInfo)>, StoreError> {
        self.dump(names::TABLES, MAX_TABLES)
    }

    fn put_table(&mut self, id: u32, info: &TableInfo) -> Result<(), StoreError> {
        self.tables
            .insert(id, info, 0)
            .map_err(failed(names::TABLES))
    }

    fn delete_table(&mut self, id: u32) -> Result<(), StoreError> {
        absent_is_ok(self.tables.remove(&id)).map_err(failed(names::TABLES))
    }

    fn settings(&self) -> Result<Settings, StoreError> {
        self.settings.get(&0, 0).map_err(failed(names::SETTINGS))
    }

    fn put_settings(&mut self, settings: &Settings) -> Result<(), StoreError> {
        self.settings
            .set(0, settings, 0)
            .map_err(failed(names::SETTINGS))
    }

    fn drains(&self) -> Result<BTreeSet<Endpoint>, StoreError> {
        let entries: Vec<(Endpoint, u32)> = self.dump(names::DRAINS, MAX_DRAINS)?;
        Ok(entries.into_iter().map(|(backend, _)| backend).collect())
    }

    fn put_drain(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        self.drains
            .insert(backend, 1, 0)
            .map_err(failed(names::DRAINS))
    }

    fn delete_drain(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        absent_is_ok(self.drains.remove(backend)).map_err(failed(names::DRAINS))
    }

    fn accelerated(&self) -> Result<BTreeSet<Endpoint>, StoreError> {
        if self.accel.is_none() {
            return Ok(BTreeSet::new());
        }
        let entries: Vec<(Endpoint, u32)> = self.dump(names::ACCEL, MAX_BACKENDS)?;
        Ok(entries.into_iter().map(|(backend, _)| backend).collect())
    }

    fn put_accelerated(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        let accel = self
            .accel
            .as_mut()
            .ok_or_else(|| StoreError::new(names::ACCEL, "not open"))?;
        accel.insert(backend, 1, 0).map_err(failed(names::ACCEL))
    }

    fn delete_accelerated(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        let Some(accel) = self.accel.as_mut() else {
            return Ok(());
        };
        absent_is_ok(accel.remove(backend)).map_err(failed(names::ACCEL))
    }

    fn accelerated_sockets(&self) -> Vec<SockKey> {
        let keys = |name| -> Vec<SockKey> {
            self.fd(name)
                .and_then(|fd| sys::map_keys(fd, MAX_ACCEL_SOCKETS as usize).ok())
                .unwrap_or_default()
        };
        let passed: std::collections::HashSet<SockKey> = keys(names::PASSED).into_iter().collect();
        keys(names::SOCKHASH)
            .into_iter()
            .filter(|key| !passed.contains(key))
            .collect()
    }

    fn daemon(&self) -> Result<DaemonRecord, StoreError> {
        self.daemon.get(&0, 0).map_err(failed(names::DAEMON))
    }

    fn put_daemon(&mut self, record: &DaemonRecord) -> Result<(), StoreError> {
        self.daemon.set(0, record, 0).map_err(failed(names::DAEMON))
    }

    fn reset_backend_counters(&mut self, id: u32) -> Result<(), StoreError> {
        let zeros = per_cpu_zeros::<BackendStats>(names::BACKEND_STATS)?;
        self.backend_stats
            .set(id, zeros, 0)
            .map_err(failed(names::BACKEND_STATS))?;
        self.backend_conns
            .set(id, BackendConns::default(), 0)
            .map_err(failed(names::BACKEND_CONNS))
    }

    fn reset_table_counters(&mut self, id: u32) -> Result<(), StoreError> {
        let zeros = per_cpu_zeros::<TableStats>(names::TABLE_STATS)?;
        self.table_stats
            .set(id, zeros, 0)
            .map_err(failed(names::TABLE_STATS))
    }

    fn connections(&self, id: u32) -> Result<BackendConns, StoreError> {
        let mut conns = self
            .backend_conns
            .get(&id, 0)
            .map_err(failed(names::BACKEND_CONNS))?;
        conns.live = conns.live.max(0);
        Ok(conns)
    }

    fn redirects(&self, id: u32) -> u64 {
        self.backend_stats
            .get(&id, 0)
            .map(|values| values.iter().map(|stats| stats.redirects).sum())
            .unwrap_or(0)
    }

    fn table_stats(&self, id: u32) -> TableStats {
        self.table_stats
            .get(&id, 0)
            .map(|values| {
                values
                    .iter()
                    .fold(TableStats::default(), |sum, stats| TableStats {
                        none_healthy: sum.none_healthy + stats.none_healthy,
                        rejected: sum.rejected + stats.rejected,
                    })
            })
            .unwrap_or_default()
    }

    fn redirected_to(&self, cookie: u64, backend: &Endpoint) -> bool {
        redirected_by_cookie(
            self.socket_slots.as_deref(),
            self.socket_table.as_ref(),
            self.legacy.as_ref(),
            cookie,
            backend,
        )
    }

    fn put_liveness(&mut self, liveness: &Liveness) -> Result<(), StoreError> {
        let map = self
            .liveness
            .as_mut()
            .ok_or_else(|| StoreError::new(names::LIVENESS, "not open"))?;
        map.set(0, liveness, 0).map_err(failed(names::LIVENESS))
    }

    fn liveness(&self) -> Result<Liveness, StoreError> {
        let map = self
            .liveness
            .as_ref()
            .ok_or_else(|| StoreError::new(names::LIVENESS, "not open"))?;
        map.get(&0, 0).map_err(failed(names::LIVENESS))
    }

    fn tracked_sockets(&self) -> Result<Vec<(u64, TrackedSocket)>, StoreError> {
        let mut records = self
            .socket_slots
            .as_ref()
            .map(|slots| slots.records())
            .unwrap_or_default();
        if self.socket_table.is_some() {
            let capacity = self.hash_table_info()?.max_entries;
            records.extend(self.dump::<u64, TrackedSocket>(names::SOCKET_TABLE, capacity)?);
        }
        Ok(records)
    }

    fn forget_socket(&mut self, cookie: u64, read: &TrackedSocket) -> Result<bool, StoreError> {
        if let Some(freed) = self
            .socket_slots
            .as_ref()
            .and_then(|slots| slots.forget_if(cookie, read))
        {
            return Ok(freed);
        }
        let map = self
            .socket_table
            .as_mut()
            .ok_or_else(|| StoreError::new(names::SOCKET_TABLE, "not open"))?;
        match map.get(&cookie, 0) {
            Ok(now) if now == *read => {}
            Ok(_) | Err(MapError::KeyNotFound) => return Ok(false),
            Err(error) => return Err(StoreError::new(names::SOCKET_TABLE, error)),
        }
        match map.remove(&cookie) {
            Ok(()) => Ok(true),
            Err(MapError::KeyNotFound) => Ok(false),
            Err(error) => Err(StoreError::new(names::SOCKET_TABLE, error)),
        }
    }

    fn socket_table(&self) -> Result<SocketTableUse, StoreError> {
        let info = self.socket_table_info()?;
        let hash = self.hash_table_info()?.max_entries;
        let in_slots = self.socket_slots.as_ref().map_or(0, |slots| slots.count());
        let in_hash = self
            .dump::<u64, TrackedSocket>(names::SOCKET_TABLE, hash)?
            .len() as u64;
        Ok(SocketTableUse {
            capacity: info.max_entries,
            tracked: in_slots + in_hash,
            slots: self.socket_slots.as_ref().map_or(0, |slots| slots.slots()),
            full: in_hash >= u64::from(hash),
            memory_bytes: info.memlock,
            untracked: self.untracked(),
        })
    }
}

impl BpfMaps {
    fn hash_table_info(&self) -> Result<super::socket_table::MapFdInfo, StoreError> {
        let fd = self
            .fd(names::SOCKET_TABLE)
            .ok_or_else(|| StoreError::new(names::SOCKET_TABLE, "not open"))?;
        super::socket_table::map_fdinfo(fd).map_err(failed(names::SOCKET_TABLE))
    }

    /// The most sockets the install's socket table holds, and its memory:
    /// the hash's, and in the array layout the array's too.
    fn socket_table_info(&self) -> Result<super::socket_table::MapFdInfo, StoreError> {
        let hash = self.hash_table_info()?;
        if self.socket_slots.is_none() {
            return Ok(hash);
        }
        let fd = self
            .fd(names::SOCKET_SLOTS)
            .ok_or_else(|| StoreError::new(names::SOCKET_SLOTS, "not open"))?;
        let slots = super::socket_table::map_fdinfo(fd).map_err(failed(names::SOCKET_SLOTS))?;
        Ok(super::socket_table::MapFdInfo {
            max_entries: hash.max_entries.saturating_add(slots.max_entries),
            memlock: hash.memlock + slots.memlock,
        })
    }

    /// The mapped array of the array layout, for a sweep on another
    /// thread.
    pub fn socket_slots(&self) -> Option<Arc<SlotTable>> {
        self.socket_slots.clone()
    }

    fn socket_table_capacity(&self) -> Result<u32, StoreError> {
        Ok(self.socket_table_info()?.max_entries)
    }

    /// Connects redirected untracked since install, summed over CPUs.
    fn untracked(&self) -> u64 {
        self.socket_table_stats
            .as_ref()
            .and_then(|stats| stats.get(&0, 0).ok())
            .map_or(0, |values| values.iter().map(|stats| stats.untracked).sum())
    }

    /// The socket table's capacity and untracked count, without reading
    /// its records (cheap enough for every turn of the loop).
    pub fn socket_table_untracked(&self) -> Result<(u32, u64), StoreError> {
        Ok((self.socket_table_capacity()?, self.untracked()))
    }
}

/// Maps in memory, for tests: the same semantics as the kernel's (arrays
/// are zero-filled, a missing hash key is absent), plus a switch that makes
/// the next writes fail, to test the retry paths.
#[derive(Debug, Clone, Default)]
pub struct MemoryMaps {
    pub services: BTreeMap<Endpoint, ServiceEntry>,
    /// The ports whose bit is set in `VIP_PORTS`.
    pub vip_ports: BTreeSet<u16>,
    pub slots: BTreeMap<u32, BackendSlot>,
    pub backends: BTreeMap<u32, BackendInfo>,
    pub tables: BTreeMap<u32, TableInfo>,
    pub settings: Settings,
    pub drains: BTreeSet<Endpoint>,
    pub accelerated: BTreeSet<Endpoint>,
    pub daemon: DaemonRecord,
    pub conns: BTreeMap<u32, BackendConns>,
    pub redirect_counts: BTreeMap<u32, u64>,
    pub table_counts: BTreeMap<u32, TableStats>,
    pub redirected: BTreeMap<u64, Endpoint>,
    /// Backends whose connection counts cannot be read.
    pub unreadable_conns: BTreeSet<u32>,
    pub liveness: Liveness,
    /// The socket table, and its capacity and untracked count.
    pub tracked: BTreeMap<u64, TrackedSocket>,
    pub socket_table: SocketTableUse,
    /// Writes still to fail, whatever the map.
    pub failing_writes: u32,
    /// Writes done (successful ones), for tests that count them.
    pub writes: u32,
}

impl MemoryMaps {
    fn write(&mut self, map: &'static str) -> Result<(), StoreError> {
        if self.failing_writes > 0 {
            self.failing_writes -= 1;
            return Err(StoreError::new(map, "injected failure"));
        }
        self.writes += 1;
        Ok(())
    }
}

impl MapStore for MemoryMaps {
    fn services(&self) -> Result<Vec<(Endpoint, ServiceEntry)>, StoreError> {
        Ok(self.services.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn put_service(&mut self, vip: &Endpoint, entry: &ServiceEntry) -> Result<(), StoreError> {
        self.write(names::SERVICES)?;
        self.vip_ports.insert(vip.port_be);
        self.services.insert(*vip, *entry);
        Ok(())
    }

    fn delete_service(&mut self, vip: &Endpoint) -> Result<(), StoreError> {
        self.write(names::SERVICES)?;
        self.services.remove(vip);
        if !self
            .services
            .keys()
            .any(|other| other.port_be == vip.port_be)
        {
            self.vip_ports.remove(&vip.port_be);
        }
        Ok(())
    }

    fn vip_port_marked(&self, port_be: u16) -> Result<bool, StoreError> {
        Ok(self.vip_ports.contains(&port_be))
    }

    fn slots(&self, first: u32, count: u32) -> Result<Vec<BackendSlot>, StoreError> {
        Ok((first..first + count)
            .map(|index| self.slots.get(&index).copied().unwrap_or_default())
            .collect())
    }

    fn put_slots(&mut self, first: u32, slots: &[BackendSlot]) -> Result<(), StoreError> {
        self.write(names::SLOTS)?;
        for (offset, slot) in slots.iter().enumerate() {
            self.slots.insert(first + offset as u32, *slot);
        }
        Ok(())
    }

    fn backends(&self) -> Result<Vec<(u32, BackendInfo)>, StoreError> {
        Ok(self.backends.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn put_backend(&mut self, id: u32, info: &BackendInfo) -> Result<(), StoreError> {
        self.write(names::BACKENDS)?;
        self.backends.insert(id, *info);
        Ok(())
    }

    fn delete_backend(&mut self, id: u32) -> Result<(), StoreError> {
        self.write(names::BACKENDS)?;
        self.backends.remove(&id);
        Ok(())
    }

    fn tables(&self) -> Result<Vec<(u32, TableInfo)>, StoreError> {
        Ok(self.tables.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn put_table(&mut self, id: u32, info: &TableInfo) -> Result<(), StoreError> {
        self.write(names::TABLES)?;
        self.tables.insert(id, *info);
        Ok(())
    }

    fn delete_table(&mut self, id: u32) -> Result<(), StoreError> {
        self.write(names::TABLES)?;
        self.tables.remove(&id);
        Ok(())
    }

    fn settings(&self) -> Result<Settings, StoreError> {
        Ok(self.settings)
    }

    fn put_settings(&mut self, settings: &Settings) -> Result<(), StoreError> {
        self.write(names::SETTINGS)?;
        self.settings = *settings;
        Ok(())
    }

    fn drains(&self) -> Result<BTreeSet<Endpoint>, StoreError> {
        Ok(self.drains.clone())
    }

    fn put_drain(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        self.write(names::DRAINS)?;
        self.drains.insert(*backend);
        Ok(())
    }

    fn delete_drain(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        self.write(names::DRAINS)?;
        self.drains.remove(backend);
        Ok(())
    }

    fn accelerated(&self) -> Result<BTreeSet<Endpoint>, StoreError> {
        Ok(self.accelerated.clone())
    }

    fn put_accelerated(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        self.write(names::ACCEL)?;
        self.accelerated.insert(*backend);
        Ok(())
    }

    fn accelerated_sockets(&self) -> Vec<SockKey> {
        Vec::new()
    }

    fn delete_accelerated(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        self.write(names::ACCEL)?;
        self.accelerated.remove(backend);
        Ok(())
    }

    fn daemon(&self) -> Result<DaemonRecord, StoreError> {
        Ok(self.daemon)
    }

    fn put_daemon(&mut self, record: &DaemonRecord) -> Result<(), StoreError> {
        self.write(names::DAEMON)?;
        self.daemon = *record;
        Ok(())
    }

    fn reset_backend_counters(&mut self, id: u32) -> Result<(), StoreError> {
        self.write(names::BACKEND_STATS)?;
        self.conns.remove(&id);
        self.redirect_counts.remove(&id);
        Ok(())
    }

    fn reset_table_counters(&mut self, id: u32) -> Result<(), StoreError> {
        self.write(names::TABLE_STATS)?;
        self.table_counts.remove(&id);
        Ok(())
    }

    fn connections(&self, id: u32) -> Result<BackendConns, StoreError> {
        if self.unreadable_conns.contains(&id) {
            return Err(StoreError::new(names::BACKEND_CONNS, "injected failure"));
        }
        Ok(self.conns.get(&id).copied().unwrap_or_default())
    }

    fn redirects(&self, id: u32) -> u64 {
        self.redirect_counts.get(&id).copied().unwrap_or(0)
    }

    fn table_stats(&self, id: u32) -> TableStats {
        self.table_counts.get(&id).copied().unwrap_or_default()
    }

    fn redirected_to(&self, cookie: u64, backend: &Endpoint) -> bool {
        self.redirected.get(&cookie) == Some(backend)
            || self
                .tracked
                .get(&cookie)
                .is_some_and(|tracked| tracked.record.backend == *backend)
    }

    fn put_liveness(&mut self, liveness: &Liveness) -> Result<(), StoreError> {
        self.write(names::LIVENESS)?;
        self.liveness = *liveness;
        Ok(())
    }

    fn liveness(&self) -> Result<Liveness, StoreError> {
        Ok(self.liveness)
    }

    fn tracked_sockets(&self) -> Result<Vec<(u64, TrackedSocket)>, StoreError> {
        Ok(self.tracked.iter().map(|(k, v)| (*k, *v)).collect())
    }

    fn forget_socket(&mut self, cookie: u64, read: &TrackedSocket) -> Result<bool, StoreError> {
        self.write(names::SOCKET_TABLE)?;
        if self.tracked.get(&cookie) != Some(read) {
            return Ok(false);
        }
        Ok(self.tracked.remove(&cookie).is_some())
    }

    fn socket_table(&self) -> Result<SocketTableUse, StoreError> {
        Ok(SocketTableUse {
            tracked: self.tracked.len() as u64,
            ..self.socket_table
        })
    }
}
