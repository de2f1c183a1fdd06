//! The one writer of socklb's maps: it turns what the daemon wants
//! ([`Desired`]) into map writes, remembers what it wrote ([`Written`]),
//! checks the maps against that ([`Writer::verify`]) and puts back what
//! someone else changed ([`Writer::repair`]).
//!
//! A table is replaced bank by bank: the idle bank is filled first, then
//! each VIP's entry is switched to it by one hash-map update, which the
//! kernel swaps in whole. A connect sees the old table or the new one,
//! never a mix.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::SocketAddr,
};

use lb_common::{
    BackendInfo, BackendSlot, Endpoint, Liveness, ROLE_NORMAL, ROLE_PREFERRED, ROLE_STANDBY,
    SERVICE_FLAG_ACCELERATE, SLOTS_PER_LIST, ServiceEntry, Settings, TableInfo, bank_base, repair,
};

use super::store::{MapStore, StoreError};
use crate::{
    convert::{endpoint, nul_padded, nul_terminated, socket_addr},
    planner::{Layout, TableContents, Tier},
};

/// One selection table as the daemon wants it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableIntent {
    pub table_id: u32,
    /// The service it serves, for log lines.
    pub service: String,
    pub vips: Vec<Endpoint>,
    /// `SERVICE_FLAG_*`.
    pub flags: u32,
    pub healthy: Vec<BackendSlot>,
    pub all: Vec<BackendSlot>,
}

/// Everything the daemon wants the maps to hold (the kernel's counters
/// aside).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    pub settings: Settings,
    pub tables: Vec<TableIntent>,
    pub table_records: BTreeMap<u32, TableInfo>,
    pub backends: BTreeMap<u32, BackendInfo>,
    pub drains: BTreeSet<Endpoint>,
    /// Local backends of accelerating services (`ACCEL`).
    pub accelerated: BTreeSet<Endpoint>,
}

/// The health view of one backend that its record shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BackendHealth {
    pub healthy: bool,
    /// False while `healthy` is only assumed (no probe has answered yet).
    pub probed: bool,
    /// Takes no new connections (config `drain` or `socklb drain`).
    pub draining: bool,
}

impl Desired {
    /// The maps' contents for a layout, its planned tables and a health
    /// view. Pure.
    pub fn build(
        layout: &Layout,
        contents: &[TableContents],
        health: impl Fn(u32) -> BackendHealth,
        settings: Settings,
        drains: BTreeSet<Endpoint>,
    ) -> Self {
        let mut desired = Self {
            settings,
            drains,
            ..Self::default()
        };
        for (table, planned) in layout.tables.iter().zip(contents) {
            let targets: BTreeMap<u32, SocketAddr> = table
                .backends
                .iter()
                .map(|backend| (backend.id, backend.addr))
                .collect();
            let slots = |ids: &[u32]| -> Vec<BackendSlot> {
                ids.iter()
                    .filter_map(|id| {
                        Some(BackendSlot {
                            target: endpoint(targets.get(id)?),
                            backend_id: *id,
                        })
                    })
                    .collect()
            };
            desired.tables.push(TableIntent {
                table_id: table.table_id,
                service: table.service.clone(),
                vips: table.vips.iter().map(endpoint).collect(),
                flags: table.flags,
                healthy: slots(&planned.healthy),
                all: slots(&planned.all),
            });
            desired.table_records.insert(
                table.table_id,
                table_info(&table.service, table.flags, table.family),
            );
        }
        for (table, backend) in layout.backends() {
            if table.flags & SERVICE_FLAG_ACCELERATE != 0 && backend.local {
                desired.accelerated.insert(endpoint(&backend.addr));
            }
            let state = health(backend.id);
            desired.backends.insert(
                backend.id,
                BackendInfo {
                    target: endpoint(&backend.addr),
                    table_id: table.table_id,
                    weight: backend.weight,
                    healthy: u8::from(state.healthy),
                    probed: u8::from(state.probed),
                    role: match backend.tier {
                        Tier::Preferred => ROLE_PREFERRED,
                        Tier::Normal => ROLE_NORMAL,
                        Tier::Standby => ROLE_STANDBY,
                    },
                    draining: u8::from(state.draining),
                },
            );
        }
        desired
    }
}

/// The heartbeat the connect programs read: now, and each table's
/// patience (`daemon-gone-after` of a service that hands back; 0 keeps
/// redirecting).
pub fn liveness(layout: &Layout, heartbeat_ns: u64) -> Liveness {
    let mut liveness = Liveness {
        heartbeat_ns,
        ..Liveness::default()
    };
    for table in &layout.tables {
        if let (Some(after), Some(slot)) = (
            table.hand_back_after,
            liveness.gone_after_ns.get_mut(table.table_id as usize),
        ) {
            *slot = u64::try_from(after.as_nanos()).unwrap_or(u64::MAX);
        }
    }
    liveness
}

/// A table record: the service name (NUL padded) and policy.
pub fn table_info(service: &str, flags: u32, family: u8) -> TableInfo {
    TableInfo {
        name: nul_padded(service.as_bytes()),
        flags,
        family,
        _pad: [0; 3],
    }
}

/// The service name stored in a table record.
pub fn table_name(info: &TableInfo) -> String {
    nul_terminated(&info.name)
}

/// What the writer believes the maps hold: what it wrote, or on adoption
/// what it read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written {
    pub settings: Option<Settings>,
    pub services: BTreeMap<Endpoint, ServiceEntry>,
    /// Each table's intent as last written into its active bank.
    pub tables: BTreeMap<u32, TableIntent>,
    pub table_records: BTreeMap<u32, TableInfo>,
    pub backends: BTreeMap<u32, BackendInfo>,
    pub drains: BTreeSet<Endpoint>,
    pub accelerated: BTreeSet<Endpoint>,
}

/// One difference between the maps and what socklb wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drift {
    Settings,
    /// A VIP entry differs from the one written (or is gone).
    Service {
        vip: Endpoint,
        found: Option<ServiceEntry>,
    },
    /// The bit of a VIP's port in `VIP_PORTS` is clear: the connect
    /// programs would not look the VIP up.
    VipPort {
        vip: Endpoint,
    },
    /// A VIP entry socklb never wrote: it would redirect an address that is
    /// no VIP of ours.
    StrangeService {
        vip: Endpoint,
    },
    /// Slots of a table's active bank differ from what was written.
    Slots {
        table_id: u32,
        differing: usize,
    },
    TableRecord {
        table_id: u32,
    },
    BackendRecord {
        backend_id: u32,
    },
    Drains,
    /// `ACCEL` differs (counted with the drains: both are sets of backends).
    Accelerated,
}

impl Drift {
    /// The `repair::*` kind this drift is counted under.
    pub fn kind(&self) -> usize {
        match self {
            Self::Settings => repair::SETTINGS,
            Self::Service { .. } | Self::VipPort { .. } | Self::StrangeService { .. } => {
                repair::SERVICES
            }
            Self::Slots { .. } => repair::SLOTS,
            Self::TableRecord { .. } => repair::TABLES,
            Self::BackendRecord { .. } => repair::BACKENDS,
            Self::Drains | Self::Accelerated => repair::DRAINS,
        }
    }
}

fn show(endpoint: &Endpoint) -> String {
    socket_addr(endpoint).map_or_else(|| format!("{endpoint:?}"), |addr| addr.to_string())
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Settings => write!(f, "SETTINGS differs from what socklb wrote"),
            Self::Service { vip, found: None } => {
                write!(f, "the SERVICES entry of VIP {} was removed", show(vip))
            }
            Self::Service {
                vip,
                found: Some(found),
            } => write!(
                f,
                "the SERVICES entry of VIP {} was changed (now table {} bank {} healthy {} all {})",
                show(vip),
                found.table_id,
                found.bank_base,
                found.healthy_slots,
                found.all_slots
            ),
            Self::VipPort { vip } => write!(
                f,
                "the port of VIP {} was cleared in lb_vports_v1 (its connects were not redirected)",
                show(vip)
            ),
            Self::StrangeService { vip } => write!(
                f,
                "a SERVICES entry for {} appeared that socklb never wrote",
                show(vip)
            ),
            Self::Slots {
                table_id,
                differing,
            } => write!(
                f,
                "{differing} SLOTS of table {table_id}'s active bank were rewritten"
            ),
            Self::TableRecord { table_id } => {
                write!(f, "the TABLES record {table_id} was changed")
            }
            Self::BackendRecord { backend_id } => {
                write!(f, "the BACKENDS record {backend_id} was changed")
            }
            Self::Drains => write!(f, "DRAINS differs from the drains socklb keeps"),
            Self::Accelerated => write!(f, "ACCEL differs from the accelerated backends"),
        }
    }
}

/// The writer. It owns [`Written`]; nothing else writes the maps while a
/// daemon runs.
#[derive(Debug, Default)]
pub struct Writer {
    written: Written,
}

/// Which tables a write replaced, for the log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct WriteReport {
    /// (table id, healthy slots) of each replaced table.
    pub replaced: Vec<(u32, usize)>,
}

impl Writer {
    /// Starts from what the maps hold now, so that only differences are
    /// written and the banks in use are never filled.
    pub fn adopt(store: &dyn MapStore) -> Result<Self, StoreError> {
        let services: BTreeMap<Endpoint, ServiceEntry> = store.services()?.into_iter().collect();
        Ok(Self {
            written: Written {
                settings: Some(store.settings()?),
                services,
                tables: BTreeMap::new(),
                table_records: store.tables()?.into_iter().collect(),
                backends: store.backends()?.into_iter().collect(),
                drains: store.drains()?,
                accelerated: store.accelerated()?,
            },
        })
    }

    pub fn written(&self) -> &Written {
        &self.written
    }

    /// Writes what differs between `desired` and what was written: stale
    /// VIPs first (a VIP dropped from the configuration stops redirecting
    /// before its table id can serve another service), then records, then
    /// each changed table through its idle bank.
    pub fn write(
        &mut self,
        store: &mut dyn MapStore,
        desired: &Desired,
    ) -> Result<WriteReport, StoreError> {
        let vips: BTreeSet<Endpoint> = desired
            .tables
            .iter()
            .flat_map(|table| table.vips.iter().copied())
            .collect();
        let stale: Vec<Endpoint> = self
            .written
            .services
            .keys()
            .filter(|vip| !vips.contains(vip))
            .copied()
            .collect();
        for vip in stale {
            store.delete_service(&vip)?;
            self.written.services.remove(&vip);
        }
        if self.written.settings != Some(desired.settings) {
            store.put_settings(&desired.settings)?;
            self.written.settings = Some(desired.settings);
        }
        self.write_records(store, desired)?;
        let mut report = WriteReport::default();
        for table in &desired.tables {
            if self.written.tables.get(&table.table_id) != Some(table)
                || !self.entries_point_at_written_bank(table)
            {
                self.write_table(store, table)?;
                report.replaced.push((table.table_id, table.healthy.len()));
            }
        }
        let table_ids: BTreeSet<u32> = desired.tables.iter().map(|table| table.table_id).collect();
        self.written
            .tables
            .retain(|table_id, _| table_ids.contains(table_id));
        self.write_drains(store, &desired.drains)?;
        self.write_accelerated(store, &desired.accelerated)?;
        Ok(report)
    }

    fn entries_point_at_written_bank(&self, table: &TableIntent) -> bool {
        let Some(base) = self.active_bank(table.table_id) else {
            return false;
        };
        table.vips.iter().all(|vip| {
            self.written
                .services
                .get(vip)
                .is_some_and(|entry| entry.bank_base == base && entry.table_id == table.table_id)
        })
    }

    /// The bank the table's VIPs point at (the first VIP's, which is
    /// switched first).
    fn active_bank(&self, table_id: u32) -> Option<u32> {
        let table = self.written.tables.get(&table_id)?;
        let vip = table.vips.first()?;
        self.written
            .services
            .get(vip)
            .filter(|entry| entry.table_id == table_id)
            .map(|entry| entry.bank_base)
    }

    fn write_records(
        &mut self,
        store: &mut dyn MapStore,
        desired: &Desired,
    ) -> Result<(), StoreError> {
        let stale_backends: Vec<u32> = self
            .written
            .backends
            .keys()
            .filter(|id| !desired.backends.contains_key(id))
            .copied()
            .collect();
        for id in stale_backends {
            store.delete_backend(id)?;
            self.written.backends.remove(&id);
        }
        let stale_tables: Vec<u32> = self
            .written
            .table_records
            .keys()
            .filter(|id| !desired.table_records.contains_key(id))
            .copied()
            .collect();
        for id in stale_tables {
            store.delete_table(id)?;
            self.written.table_records.remove(&id);
        }
        for (id, info) in &desired.table_records {
            let old = self.written.table_records.get(id);
            if old == Some(info) {
                continue;
            }
            // A reused id with a new meaning starts its counters at zero.
            if old.is_none_or(|old| old.name != info.name || old.family != info.family) {
                store.reset_table_counters(*id)?;
            }
            store.put_table(*id, info)?;
            self.written.table_records.insert(*id, *info);
        }
        for (id, info) in &desired.backends {
            let old = self.written.backends.get(id);
            if old == Some(info) {
                continue;
            }
            if old.is_none_or(|old| old.target != info.target || old.table_id != info.table_id) {
                store.reset_backend_counters(*id)?;
            }
            store.put_backend(*id, info)?;
            self.written.backends.insert(*id, *info);
        }
        Ok(())
    }

    fn write_drains(
        &mut self,
        store: &mut dyn MapStore,
        drains: &BTreeSet<Endpoint>,
    ) -> Result<(), StoreError> {
        sync_set(
            store,
            &mut self.written.drains,
            drains,
            |store, backend| store.put_drain(backend),
            |store, backend| store.delete_drain(backend),
        )
    }

    fn write_accelerated(
        &mut self,
        store: &mut dyn MapStore,
        accelerated: &BTreeSet<Endpoint>,
    ) -> Result<(), StoreError> {
        sync_set(
            store,
            &mut self.written.accelerated,
            accelerated,
            |store, backend| store.put_accelerated(backend),
            |store, backend| store.delete_accelerated(backend),
        )
    }

    /// Fills a bank that no VIP entry points at, then switches the table's
    /// VIPs to it one hash-map update each.
    fn write_table(
        &mut self,
        store: &mut dyn MapStore,
        table: &TableIntent,
    ) -> Result<(), StoreError> {
        let base = self.idle_bank(store, table)?;
        store.put_slots(base, &table.healthy)?;
        store.put_slots(base + SLOTS_PER_LIST, &table.all)?;
        let generation = table
            .vips
            .iter()
            .filter_map(|vip| self.written.services.get(vip))
            .filter(|entry| entry.table_id == table.table_id)
            .map(|entry| entry.generation)
            .max()
            .map_or(1, |generation| generation.wrapping_add(1));
        let entry = ServiceEntry {
            table_id: table.table_id,
            bank_base: base,
            healthy_slots: table.healthy.len() as u32,
            all_slots: table.all.len() as u32,
            flags: table.flags,
            generation,
        };
        // Until every VIP is switched, the table is not what was written.
        self.written.tables.remove(&table.table_id);
        for vip in &table.vips {
            store.put_service(vip, &entry)?;
            self.written.services.insert(*vip, entry);
        }
        self.written.tables.insert(table.table_id, table.clone());
        Ok(())
    }

    /// A bank of the table that no VIP entry points at. If an earlier
    /// write failed half-way, the table's VIPs may point at both banks;
    /// they are first all pointed at the newer one, which frees the other.
    fn idle_bank(
        &mut self,
        store: &mut dyn MapStore,
        table: &TableIntent,
    ) -> Result<u32, StoreError> {
        let banks = [bank_base(table.table_id, 0), bank_base(table.table_id, 1)];
        let busy = |written: &Written| -> BTreeSet<u32> {
            written
                .services
                .values()
                .map(|entry| entry.bank_base)
                .collect()
        };
        let current = self.active_bank(table.table_id);
        // The bank after the current one, so that banks alternate.
        let order = match current {
            Some(base) if base == banks[0] => [banks[1], banks[0]],
            _ => banks,
        };
        if let Some(free) = order
            .iter()
            .find(|base| !busy(&self.written).contains(base))
        {
            return Ok(*free);
        }
        let newest = table
            .vips
            .iter()
            .filter_map(|vip| self.written.services.get(vip))
            .filter(|entry| entry.table_id == table.table_id)
            .max_by_key(|entry| entry.generation)
            .copied();
        if let Some(entry) = newest {
            for vip in &table.vips {
                store.put_service(vip, &entry)?;
                self.written.services.insert(*vip, entry);
            }
        }
        // Entries of other VIPs that point into this table's banks are
        // leftovers of a configuration whose ids differed; they were
        // removed as stale before tables are written. What remains free:
        Ok(order
            .into_iter()
            .find(|base| !busy(&self.written).contains(base))
            .unwrap_or(order[0]))
    }

    /// Compares the maps with what was written.
    pub fn verify(&self, store: &dyn MapStore) -> Result<Vec<Drift>, StoreError> {
        let mut drifts = Vec::new();
        if let Some(settings) = self.written.settings
            && store.settings()? != settings
        {
            drifts.push(Drift::Settings);
        }
        let found: BTreeMap<Endpoint, ServiceEntry> = store.services()?.into_iter().collect();
        for (vip, entry) in &self.written.services {
            match found.get(vip) {
                Some(now) if now == entry => {}
                now => drifts.push(Drift::Service {
                    vip: *vip,
                    found: now.copied(),
                }),
            }
            if !store.vip_port_marked(vip.port_be)? {
                drifts.push(Drift::VipPort { vip: *vip });
            }
        }
        for vip in found.keys() {
            if !self.written.services.contains_key(vip) {
                drifts.push(Drift::StrangeService { vip: *vip });
            }
        }
        for (table_id, table) in &self.written.tables {
            let Some(base) = self.active_bank(*table_id) else {
                continue;
            };
            let differing = count_differing(
                &store.slots(base, table.healthy.len() as u32)?,
                &table.healthy,
            ) + count_differing(
                &store.slots(base + SLOTS_PER_LIST, table.all.len() as u32)?,
                &table.all,
            );
            if differing > 0 {
                drifts.push(Drift::Slots {
                    table_id: *table_id,
                    differing,
                });
            }
        }
        let records: BTreeMap<u32, TableInfo> = store.tables()?.into_iter().collect();
        for table_id in differing_keys(&records, &self.written.table_records) {
            drifts.push(Drift::TableRecord { table_id });
        }
        let backends: BTreeMap<u32, BackendInfo> = store.backends()?.into_iter().collect();
        for backend_id in differing_keys(&backends, &self.written.backends) {
            drifts.push(Drift::BackendRecord { backend_id });
        }
        if store.drains()? != self.written.drains {
            drifts.push(Drift::Drains);
        }
        if store.accelerated()? != self.written.accelerated {
            drifts.push(Drift::Accelerated);
        }
        Ok(drifts)
    }

    /// Puts back what `verify` found changed. Rewritten slots are repaired
    /// by filling the idle bank and switching to it, so that a connect
    /// never sees a half-repaired table.
    pub fn repair(&mut self, store: &mut dyn MapStore, drifts: &[Drift]) -> Result<(), StoreError> {
        for drift in drifts {
            match drift {
                Drift::Settings => {
                    if let Some(settings) = self.written.settings {
                        store.put_settings(&settings)?;
                    }
                }
                // put_service sets the port's bit before the entry.
                Drift::Service { vip, .. } | Drift::VipPort { vip } => {
                    if let Some(entry) = self.written.services.get(vip) {
                        store.put_service(vip, entry)?;
                    }
                }
                Drift::StrangeService { vip } => store.delete_service(vip)?,
                Drift::Slots { table_id, .. } => {
                    if let Some(table) = self.written.tables.get(table_id).cloned() {
                        self.write_table(store, &table)?;
                    }
                }
                Drift::TableRecord { table_id } => match self.written.table_records.get(table_id) {
                    Some(info) => store.put_table(*table_id, info)?,
                    None => store.delete_table(*table_id)?,
                },
                Drift::BackendRecord { backend_id } => {
                    match self.written.backends.get(backend_id) {
                        Some(info) => store.put_backend(*backend_id, info)?,
                        None => store.delete_backend(*backend_id)?,
                    }
                }
                Drift::Drains => {
                    let mut found = store.drains()?;
                    sync_set(
                        store,
                        &mut found,
                        &self.written.drains,
                        |store, backend| store.put_drain(backend),
                        |store, backend| store.delete_drain(backend),
                    )?;
                }
                Drift::Accelerated => {
                    let mut found = store.accelerated()?;
                    sync_set(
                        store,
                        &mut found,
                        &self.written.accelerated,
                        |store, backend| store.put_accelerated(backend),
                        |store, backend| store.delete_accelerated(backend),
                    )?;
                }
            }
        }
        Ok(())
    }
}

/// Makes a set of backends in a map equal `wanted`, writing only the
/// differences (removals first); `held` is what the map holds, kept in
/// step (what the writer wrote, or what a repair found).
fn sync_set(
    store: &mut dyn MapStore,
    held: &mut BTreeSet<Endpoint>,
    wanted: &BTreeSet<Endpoint>,
    put: fn(&mut dyn MapStore, &Endpoint) -> Result<(), StoreError>,
    delete: fn(&mut dyn MapStore, &Endpoint) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    for gone in held.difference(wanted).copied().collect::<Vec<_>>() {
        delete(store, &gone)?;
        held.remove(&gone);
    }
    for added in wanted.difference(held).copied().collect::<Vec<_>>() {
        put(store, &added)?;
        held.insert(added);
    }
    Ok(())
}

fn count_differing(found: &[BackendSlot], wanted: &[BackendSlot]) -> usize {
    let missing = wanted.len().saturating_sub(found.len());
    found
        .iter()
        .zip(wanted)
        .filter(|(found, wanted)| found != wanted)
        .count()
        + missing
}

/// Keys whose values differ between two maps, or that only one has.
fn differing_keys<V: PartialEq>(found: &BTreeMap<u32, V>, wanted: &BTreeMap<u32, V>) -> Vec<u32> {
    let keys: BTreeSet<u32> = found.keys().chain(wanted.keys()).copied().collect();
    keys.into_iter()
        .filter(|key| found.get(key) != wanted.get(key))
        .collect()
}
