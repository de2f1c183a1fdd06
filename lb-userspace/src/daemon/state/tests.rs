//! The owner's decisions against maps in memory: writes, retries, drains,
//! adoption, and the repair of every kind of tampering.

use std::net::SocketAddr;

use lb_common::{BackendSlot, Endpoint, SLOTS_PER_LIST, Settings, bank_base, repair};

use super::*;
use crate::{
    config::parse_toml,
    dataplane::{MapStore, MemoryMaps},
    health::ProbeFailure,
    planner::Layout,
};

const CONFIG: &str = r#"
    [[service]]
    name = "api"
    vips = ["127.0.0.1:6444", "127.0.0.5:6444"]
    backends = ["127.0.0.2:1", "127.0.0.3:1,weight=2", "127.0.0.4:1"]
    [[service]]
    name = "etcd"
    vips = ["127.0.0.1:2379"]
    backends = ["127.0.0.6:1"]
"#;

fn addr(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

fn settings() -> Settings {
    Settings {
        host_netns_cookie: 7,
        attached_cgroup_id: 99,
    }
}

fn owner(config: &str) -> Owner {
    Owner::new(
        Layout::from_config(&parse_toml(config).unwrap(), |_| false),
        settings(),
    )
}

/// An owner that wrote its tables into fresh maps.
fn written() -> (Owner, MemoryMaps) {
    let mut maps = MemoryMaps::default();
    let mut owner = owner(CONFIG);
    owner.adopt(&maps).unwrap();
    assert!(owner.write(&mut maps));
    (owner, maps)
}

/// What connects read: for each VIP, its table's healthy and all lists.
fn effective(maps: &MemoryMaps) -> Vec<(Endpoint, Vec<BackendSlot>, Vec<BackendSlot>)> {
    maps.services
        .iter()
        .map(|(vip, entry)| {
            (
                *vip,
                maps.slots(entry.bank_base, entry.healthy_slots).unwrap(),
                maps.slots(entry.bank_base + SLOTS_PER_LIST, entry.all_slots)
                    .unwrap(),
            )
        })
        .collect()
}

fn vip(text: &str) -> Endpoint {
    endpoint(&addr(text))
}

type Tamper = fn(&mut MemoryMaps);

/// (what, how someone else changes the maps, the repair kind expected)
const TAMPERING: &[(&str, Tamper, usize)] = &[
    (
        "VIP entry removed",
        |maps| {
            maps.services.remove(&vip("127.0.0.1:6444"));
        },
        repair::SERVICES,
    ),
    (
        "VIP entry pointed at the idle bank",
        |maps| {
            let entry = maps.services.get_mut(&vip("127.0.0.1:6444")).unwrap();
            entry.bank_base = if entry.bank_base == bank_base(entry.table_id, 0) {
                bank_base(entry.table_id, 1)
            } else {
                bank_base(entry.table_id, 0)
            };
        },
        repair::SERVICES,
    ),
    (
        "VIP entry for a stranger address",
        |maps| {
            let entry = *maps.services.values().next().unwrap();
            maps.services.insert(vip("127.0.0.9:80"), entry);
        },
        repair::SERVICES,
    ),
    (
        "a slot sent to another listener",
        |maps| {
            let entry = maps.services[&vip("127.0.0.1:6444")];
            let slot = maps.slots.get_mut(&entry.bank_base).unwrap();
            slot.target = vip("127.0.0.7:9999");
        },
        repair::SLOTS,
    ),
    (
        "settings changed",
        |maps| maps.settings.host_netns_cookie = 1,
        repair::SETTINGS,
    ),
    (
        "backend record changed",
        |maps| maps.backends.get_mut(&0).unwrap().healthy = 0,
        repair::BACKENDS,
    ),
    (
        "table record removed",
        |maps| {
            maps.tables.remove(&1);
        },
        repair::TABLES,
    ),
    (
        "a VIP's port bit cleared (its connects would not be looked up)",
        |maps| {
            maps.vip_ports.remove(&vip("127.0.0.1:6444").port_be);
        },
        repair::SERVICES,
    ),
    (
        "a drain added behind the daemon's back",
        |maps| {
            maps.drains.insert(vip("127.0.0.2:1"));
        },
        repair::DRAINS,
    ),
];

#[test]
fn every_kind_of_tampering_is_found_and_repaired() {
    for (what, tamper, kind) in TAMPERING {
        let (mut owner, mut maps) = written();
        let before = effective(&maps);
        let records = (maps.backends.clone(), maps.tables.clone(), maps.settings);
        assert!(
            owner.verify(&maps).unwrap().is_empty(),
            "{what}: clean at first"
        );
        tamper(&mut maps);
        let drifts = owner.verify(&maps).unwrap();
        assert!(
            drifts.iter().any(|drift| drift.kind() == *kind),
            "{what}: found as kind {kind}: {drifts:?}"
        );
        owner.repair(&mut maps, &drifts).unwrap();
        assert_eq!(owner.verify(&maps).unwrap(), Vec::new(), "{what}: repaired");
        assert_eq!(
            effective(&maps),
            before,
            "{what}: connects read the same tables"
        );
        assert_eq!(
            (maps.backends.clone(), maps.tables.clone(), maps.settings),
            records,
            "{what}: records restored"
        );
        assert!(maps.drains.is_empty(), "{what}: no drain left");
    }
}

#[test]
fn a_repaired_table_is_written_to_the_idle_bank_then_switched() {
    let (mut owner, mut maps) = written();
    let entry = maps.services[&vip("127.0.0.1:6444")];
    maps.slots.get_mut(&entry.bank_base).unwrap().backend_id = 3;
    let drifts = owner.verify(&maps).unwrap();
    owner.repair(&mut maps, &drifts).unwrap();
    let repaired = maps.services[&vip("127.0.0.1:6444")];
    assert_ne!(repaired.bank_base, entry.bank_base, "switched banks");
    assert_eq!(
        maps.services[&vip("127.0.0.5:6444")],
        repaired,
        "both VIPs of the table switched"
    );
    assert_eq!(repaired.generation, entry.generation + 1);
}

#[test]
fn a_failed_write_is_retried_until_it_lands() {
    let mut maps = MemoryMaps {
        failing_writes: 3,
        ..MemoryMaps::default()
    };
    let mut owner = owner(CONFIG);
    owner.adopt(&maps).unwrap();
    let mut attempts = 0;
    while !owner.write(&mut maps) {
        assert!(owner.is_dirty());
        attempts += 1;
        assert!(attempts < 10, "bounded");
    }
    assert_eq!(attempts, 3, "one failure per attempt");
    assert!(!owner.is_dirty());
    assert!(owner.verify(&maps).unwrap().is_empty());
    assert_eq!(maps.services.len(), 3);
}

#[test]
fn a_write_that_fails_half_way_never_fills_a_bank_in_use() {
    let (mut owner, mut maps) = written();
    // Take 127.0.0.2 out; the switch of the second VIP fails.
    let first = maps.services[&vip("127.0.0.1:6444")];
    let (transition, _) = owner.record_probe(0, &Err(ProbeFailure::Refused), "ok");
    assert!(transition.is_some(), "the first answer settles it down");
    let writes_before = maps.writes;
    // slots (2 lists) + records land, the first VIP switches, the second fails.
    maps.failing_writes = 0;
    let mut probe = maps.clone();
    assert!(owner.write(&mut probe));
    let writes_needed = probe.writes - writes_before;
    let (mut owner, mut maps) = written();
    owner.record_probe(0, &Err(ProbeFailure::Refused), "ok");
    let mut limited = LimitedWrites {
        inner: &mut maps,
        left: writes_needed - 1,
    };
    assert!(!owner.write(&mut limited), "the last switch failed");
    let split = (
        maps.services[&vip("127.0.0.1:6444")].bank_base,
        maps.services[&vip("127.0.0.5:6444")].bank_base,
    );
    assert_ne!(split.0, split.1, "the table is split between its banks");
    assert_eq!(split.1, first.bank_base);
    // The retry first points both VIPs at the newer bank; nothing in use is
    // rewritten, and the table ends whole.
    assert!(owner.write(&mut maps));
    assert!(owner.verify(&maps).unwrap().is_empty());
    let entries: Vec<u32> = [vip("127.0.0.1:6444"), vip("127.0.0.5:6444")]
        .iter()
        .map(|vip| maps.services[vip].bank_base)
        .collect();
    assert_eq!(entries[0], entries[1]);
    assert_eq!(
        effective(&maps)
            .iter()
            .find(|(found, _, _)| *found == vip("127.0.0.1:6444"))
            .unwrap()
            .1
            .iter()
            .filter(|slot| slot.backend_id == 0)
            .count(),
        0,
        "the failed backend is out"
    );
}

/// A store that lets `left` writes through, then fails every one.
struct LimitedWrites<'a> {
    inner: &'a mut MemoryMaps,
    left: u32,
}

impl LimitedWrites<'_> {
    fn spend(&mut self) -> Result<(), StoreError> {
        if self.left == 0 {
            return Err(StoreError::new("test", "no writes left"));
        }
        self.left -= 1;
        Ok(())
    }
}

impl MapStore for LimitedWrites<'_> {
    fn services(&self) -> Result<Vec<(Endpoint, lb_common::ServiceEntry)>, StoreError> {
        self.inner.services()
    }
    fn put_service(
        &mut self,
        vip: &Endpoint,
        entry: &lb_common::ServiceEntry,
    ) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.put_service(vip, entry)
    }
    fn delete_service(&mut self, vip: &Endpoint) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.delete_service(vip)
    }
    fn vip_port_marked(&self, port_be: u16) -> Result<bool, StoreError> {
        self.inner.vip_port_marked(port_be)
    }
    fn slots(&self, first: u32, count: u32) -> Result<Vec<BackendSlot>, StoreError> {
        self.inner.slots(first, count)
    }
    fn put_slots(&mut self, first: u32, slots: &[BackendSlot]) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.put_slots(first, slots)
    }
    fn backends(&self) -> Result<Vec<(u32, BackendInfo)>, StoreError> {
        self.inner.backends()
    }
    fn put_backend(&mut self, id: u32, info: &BackendInfo) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.put_backend(id, info)
    }
    fn delete_backend(&mut self, id: u32) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.delete_backend(id)
    }
    fn tables(&self) -> Result<Vec<(u32, lb_common::TableInfo)>, StoreError> {
        self.inner.tables()
    }
    fn put_table(&mut self, id: u32, info: &lb_common::TableInfo) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.put_table(id, info)
    }
    fn delete_table(&mut self, id: u32) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.delete_table(id)
    }
    fn settings(&self) -> Result<Settings, StoreError> {
        self.inner.settings()
    }
    fn put_settings(&mut self, settings: &Settings) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.put_settings(settings)
    }
    fn drains(&self) -> Result<std::collections::BTreeSet<Endpoint>, StoreError> {
        self.inner.drains()
    }
    fn put_drain(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.put_drain(backend)
    }
    fn delete_drain(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.delete_drain(backend)
    }
    fn accelerated(&self) -> Result<std::collections::BTreeSet<Endpoint>, StoreError> {
        self.inner.accelerated()
    }
    fn put_accelerated(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.put_accelerated(backend)
    }
    fn delete_accelerated(&mut self, backend: &Endpoint) -> Result<(), StoreError> {
        self.spend()?;
        self.inner.delete_accelerated(backend)
    }
    fn accelerated_sockets(&self) -> Vec<lb_common::SockKey> {
        self.inner.accelerated_sockets()
    }
    fn daemon(&self) -> Result<lb_common::DaemonRecord, StoreError> {
        self.inner.daemon()
    }
    fn put_daemon(&mut self, record: &lb_common::DaemonRecord) -> Result<(), StoreError> {
        self.inner.put_daemon(record)
    }
    fn reset_backend_counters(&mut self, id: u32) -> Result<(), StoreError> {
        self.inner.reset_backend_counters(id)
    }
    fn reset_table_counters(&mut self, id: u32) -> Result<(), StoreError> {
        self.inner.reset_table_counters(id)
    }
    fn connections(&self, id: u32) -> Result<lb_common::BackendConns, StoreError> {
        self.inner.connections(id)
    }
    fn redirects(&self, id: u32) -> u64 {
        self.inner.redirects(id)
    }
    fn table_stats(&self, id: u32) -> lb_common::TableStats {
        self.inner.table_stats(id)
    }
    fn redirected_to(&self, cookie: u64, backend: &Endpoint) -> bool {
        self.inner.redirected_to(cookie, backend)
    }
    fn put_liveness(&mut self, liveness: &lb_common::Liveness) -> Result<(), StoreError> {
        self.inner.put_liveness(liveness)
    }
    fn liveness(&self) -> Result<lb_common::Liveness, StoreError> {
        self.inner.liveness()
    }
    fn tracked_sockets(&self) -> Result<Vec<(u64, lb_common::TrackedSocket)>, StoreError> {
        self.inner.tracked_sockets()
    }
    fn forget_socket(
        &mut self,
        cookie: u64,
        read: &lb_common::TrackedSocket,
    ) -> Result<bool, StoreError> {
        self.inner.forget_socket(cookie, read)
    }
    fn socket_table(&self) -> Result<crate::dataplane::SocketTableUse, StoreError> {
        self.inner.socket_table()
    }
}

#[test]
fn drains_are_asked_for_applied_and_undone() {
    let (mut owner, mut maps) = written();
    // (what, backend, drain, expected outcome)
    let steps: [(&str, &str, bool, Result<DrainOutcome, ()>); 5] = [
        ("unknown backend", "127.0.0.99:1", true, Err(())),
        (
            "undo of nothing",
            "127.0.0.2:1",
            false,
            Ok(DrainOutcome::Unchanged(
                "127.0.0.2:1 is not draining; nothing to do".into(),
            )),
        ),
        ("drain", "127.0.0.2:1", true, Ok(DrainOutcome::Draining)),
        (
            "drain again",
            "127.0.0.2:1",
            true,
            Ok(DrainOutcome::Unchanged(
                "127.0.0.2:1 is already draining".into(),
            )),
        ),
        ("undo", "127.0.0.2:1", false, Ok(DrainOutcome::Resumed)),
    ];
    for (what, backend, drain, expected) in steps {
        let outcome = owner.request_drain(addr(backend), drain).map_err(|_| ());
        assert_eq!(outcome, expected, "{what}");
        assert!(owner.write(&mut maps), "{what}");
        let draining = maps.drains.contains(&vip("127.0.0.2:1"));
        let in_table = effective(&maps)
            .iter()
            .find(|(found, _, _)| *found == vip("127.0.0.1:6444"))
            .unwrap()
            .1
            .iter()
            .any(|slot| slot.backend_id == 0);
        assert_eq!(
            draining, !in_table,
            "{what}: a drained backend leaves the table"
        );
    }
}

#[test]
fn adoption_seeds_health_by_service_and_address() {
    let (mut first, mut maps) = written();
    // 127.0.0.3 is probed down, 127.0.0.2 probed up, 127.0.0.4 never probed.
    first.record_probe(1, &Err(ProbeFailure::Refused), "ok");
    first.record_probe(0, &Ok(()), "ok");
    assert!(first.write(&mut maps));
    // A new config: reordered (ids move), 127.0.0.6 dropped, one added.
    let reordered = r#"
        [[service]]
        name = "api"
        vips = ["127.0.0.1:6444", "127.0.0.5:6444"]
        backends = ["127.0.0.4:1", "127.0.0.3:1,weight=2", "127.0.0.2:1", "127.0.0.8:1"]
    "#;
    let mut second = owner(reordered);
    let removed = second.adopt(&maps).unwrap();
    assert_eq!(removed, vec![addr("127.0.0.6:1")]);
    let health = |owner: &Owner, text: &str| {
        let (_, backend) = owner
            .layout()
            .backends()
            .find(|(_, backend)| backend.addr == addr(text))
            .unwrap();
        owner.health(backend.id)
    };
    let cases = [
        ("probed down stays down", "127.0.0.3:1", false, true),
        ("probed up stays up", "127.0.0.2:1", true, true),
        (
            "never probed is assumed up, unsettled",
            "127.0.0.4:1",
            true,
            false,
        ),
        (
            "new backend is assumed up, unsettled",
            "127.0.0.8:1",
            true,
            false,
        ),
    ];
    for (what, backend, healthy, probed) in cases {
        let state = health(&second, backend);
        assert_eq!((state.healthy, state.probed), (healthy, probed), "{what}");
    }
    assert!(second.write(&mut maps));
    assert!(second.verify(&maps).unwrap().is_empty());
    assert!(
        !maps.services.contains_key(&vip("127.0.0.1:2379")),
        "the dropped service's VIP is gone"
    );
}

#[test]
fn a_backend_back_from_down_ramps_its_share_in_steps_then_has_its_weight() {
    let config = r#"
        [[service]]
        name = "api"
        vips = ["127.0.0.1:6444"]
        slow-start = "10s"
        backends = ["127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"]
    "#;
    let mut maps = MemoryMaps::default();
    let mut owner = owner(config);
    owner.adopt(&maps).unwrap();
    assert!(owner.write(&mut maps));
    // The share of backend 2 in the healthy list: (its slots, all slots).
    let share = |maps: &MemoryMaps| {
        let (_, healthy, _) = effective(maps).remove(0);
        let own = healthy.iter().filter(|slot| slot.backend_id == 2).count();
        (own, healthy.len())
    };
    assert_eq!(share(&maps), (1, 3), "a first start ramps nothing");

    let (down, _) = owner.record_probe(2, &Err(ProbeFailure::Refused), "ok");
    assert!(down.is_some_and(|down| !down.healthy));
    assert!(owner.write(&mut maps));
    assert_eq!(share(&maps), (0, 2));
    let mut up = None;
    for _ in 0..5 {
        up = up.or(owner.record_probe(2, &Ok(()), "ok").0);
    }
    assert!(up.is_some_and(|up| up.healthy), "back up");
    assert_eq!(owner.ramp_step(2), Some(1));
    assert!(owner.write(&mut maps));
    // Step 1: a tenth of the others' weight (1 of 10 + 10 + 1 slots).
    assert_eq!(share(&maps), (1, 21));

    let start = Instant::now();
    assert_eq!(owner.advance_ramps(start), Vec::new(), "the clock starts");
    assert_eq!(
        owner.advance_ramps(start + Duration::from_millis(5_500)),
        vec![(2, Some(6))]
    );
    assert!(owner.write(&mut maps));
    // 10 : 10 : 6, divided by 2.
    assert_eq!(share(&maps), (3, 13));
    assert_eq!(
        owner.advance_ramps(start + Duration::from_secs(10)),
        vec![(2, None)]
    );
    assert_eq!(owner.ramp_step(2), None);
    assert!(owner.write(&mut maps));
    assert_eq!(share(&maps), (1, 3), "its full weight");

    // Down again in the middle of a ramp: the ramp ends with it.
    owner.record_probe(2, &Err(ProbeFailure::Refused), "ok");
    for _ in 0..5 {
        owner.record_probe(2, &Err(ProbeFailure::Refused), "ok");
    }
    assert_eq!(owner.ramp_step(2), None);
}

#[test]
fn pinned_ids_are_not_read_when_a_count_cannot_be() {
    let (_, mut maps) = written();
    maps.conns.insert(
        1,
        lb_common::BackendConns {
            live: 3,
            ..Default::default()
        },
    );
    assert!(known_ids(&maps).unwrap().busy.contains(&1));
    maps.unreadable_conns.insert(2);
    assert!(
        known_ids(&maps).is_err(),
        "an unreadable count is an error, not an idle backend whose id can go"
    );
}

const THREE: &str = r#"
    [[service]]
    name = "api"
    vips = ["127.0.0.1:6444"]
    backends = ["127.0.0.2:1", "127.0.0.3:1", "127.0.0.4:1"]
    health = { fall = 2 }
"#;

/// An owner whose three backends passed their first probe.
fn settled_three() -> Owner {
    let mut owner = owner(THREE);
    for id in 0..3 {
        owner.record_probe(id, &Ok(()), "ok");
    }
    owner
}

fn slow() -> Result<(), ProbeFailure> {
    Err(ProbeFailure::TimedOut(Duration::from_secs(1)))
}

/// Feeds failures until the backend is down; returns the verdict on its
/// connections.
fn fail_until_down(owner: &mut Owner, id: u32) -> CloseVerdict {
    for _ in 0..2 {
        if let (Some(transition), _) = owner.record_probe(id, &slow(), "ok") {
            assert!(!transition.healthy);
            return owner.after_down(id);
        }
    }
    panic!("backend {id} never went down");
}

#[test]
fn close_on_failure_closes_only_toward_somewhere_better() {
    // One fails while the others pass: closed at once.
    let mut owner = settled_three();
    assert_eq!(fail_until_down(&mut owner, 0), CloseVerdict::Close);

    // One fails while another is failing too, the third healthy and
    // passing: still somewhere better.
    let mut owner = settled_three();
    owner.record_probe(1, &slow(), "ok");
    assert_eq!(fail_until_down(&mut owner, 0), CloseVerdict::Close);

    // Every other healthy backend fails its probes too: the close waits,
    // and happens once one of them passes.
    let mut owner = settled_three();
    owner.record_probe(1, &slow(), "ok");
    owner.record_probe(2, &slow(), "ok");
    assert_eq!(fail_until_down(&mut owner, 0), CloseVerdict::Wait);
    assert_eq!(owner.released_closes(), vec![], "nothing better yet");
    owner.record_probe(2, &Ok(()), "ok");
    assert_eq!(owner.released_closes(), vec![(0, addr("127.0.0.2:1"))]);
    assert_eq!(owner.released_closes(), vec![], "released once");

    // A held backend that comes back needs no close.
    let mut owner = settled_three();
    owner.record_probe(1, &slow(), "ok");
    owner.record_probe(2, &slow(), "ok");
    assert_eq!(fail_until_down(&mut owner, 0), CloseVerdict::Wait);
    for _ in 0..3 {
        owner.record_probe(0, &Ok(()), "ok");
    }
    owner.after_up(0);
    owner.record_probe(1, &Ok(()), "ok");
    assert_eq!(owner.released_closes(), vec![]);
}

/// Every server slow: each goes down in turn, none is ever a better place,
/// so nothing is closed; the last one keeps its connections (said once),
/// and the recovery closes nothing.
#[test]
fn when_every_server_is_slow_no_connection_is_closed() {
    let mut owner = settled_three();
    let mut verdicts = Vec::new();
    for round in 0..2 {
        for id in 0..3 {
            if let (Some(_), _) = owner.record_probe(id, &slow(), "ok") {
                verdicts.push(owner.after_down(id));
            }
            assert!(
                owner.released_closes().is_empty(),
                "round {round}, backend {id}"
            );
        }
    }
    assert_eq!(
        verdicts,
        vec![
            CloseVerdict::Wait,
            CloseVerdict::Wait,
            CloseVerdict::Keep { first: true }
        ]
    );
    // Health comes back one by one: quietly.
    let mut recovered = Vec::new();
    for id in 0..3 {
        for _ in 0..2 {
            if let (Some(transition), _) = owner.record_probe(id, &Ok(()), "ok") {
                assert!(transition.healthy);
                recovered.extend(owner.after_up(id));
            }
        }
        assert!(owner.released_closes().is_empty(), "no herd of closes");
    }
    assert_eq!(recovered, vec!["api".to_string()], "said once");
}

#[test]
fn a_removed_backend_keeps_its_connections_when_none_would_take_them() {
    let mut owner = settled_three();
    for id in 0..3 {
        for _ in 0..2 {
            owner.record_probe(id, &slow(), "ok");
        }
    }
    let smaller = r#"
        [[service]]
        name = "api"
        vips = ["127.0.0.1:6444"]
        backends = ["127.0.0.2:1", "127.0.0.3:1"]
        health = { fall = 2 }
    "#;
    let layout = Layout::from_config(&parse_toml(smaller).unwrap(), |_| false);
    let changes = owner.reconfigure(layout);
    assert_eq!(
        changes.removed,
        vec![(addr("127.0.0.4:1"), Departure::NoneHealthy)]
    );
    assert_eq!(
        changes.dropped,
        vec![("api".to_string(), addr("127.0.0.4:1"))],
        "the pair whose label sets are forgotten"
    );
    let mut owner = settled_three();
    let layout = Layout::from_config(&parse_toml(smaller).unwrap(), |_| false);
    assert_eq!(
        owner.reconfigure(layout).removed,
        vec![(addr("127.0.0.4:1"), Departure::Close)]
    );
}
