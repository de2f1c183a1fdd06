//! Closing connections, off the event loop. A sweep dumps sockets with
//! sock_diag (see [`crate::sockets`]) and destroys some: those to a backend
//! that failed or left (close-on-failure), or those a rebalancing step
//! chose. It blocks for as long as the kernel takes to walk the host's
//! sockets, so it runs on tokio's blocking pool (`spawn_blocking`) and
//! reports to the loop when done; the heartbeat, the verification and the
//! signals never wait for it.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    os::fd::{AsFd, OwnedFd},
    sync::Arc,
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use lb_common::{Endpoint, SocketRecord, TrackedSocket, names};
use tokio::sync::mpsc;

use super::rebalance::{ClosePlan, Holding, share_among_owners};
use crate::{
    dataplane::{BpfMaps, slots::SlotTable, store::redirected_by_cookie},
    sockets::{self, Closer, Redirected, SocketOwner, SweepReport},
};

/// What a sweep needs of the maps, owned, so that it can move to another
/// thread: the socket storage of the previous layout (whose records
/// sock_diag reads), the socket table (the array's mapping, the hash), and
/// the legacy per-socket map, when there is one.
pub struct SweepAccess {
    storage: OwnedFd,
    slots: Option<Arc<SlotTable>>,
    table: Option<BpfHashMap<MapData, u64, TrackedSocket>>,
    legacy: Option<BpfHashMap<MapData, u64, SocketRecord>>,
}

/// A hash map of the open maps by name, with a descriptor of its own.
fn own_hash_map<V: aya::Pod>(maps: &BpfMaps, name: &str) -> Option<BpfHashMap<MapData, u64, V>> {
    let fd = maps.fd(name)?.try_clone_to_owned().ok()?;
    let data = MapData::from_fd(fd).ok()?;
    Map::HashMap(data).try_into().ok()
}

impl SweepAccess {
    /// Descriptors of their own for one sweep; `None` when the storage map
    /// is not open.
    pub fn of(maps: &BpfMaps) -> Option<Self> {
        let storage = maps.fd(names::SOCKETS)?.try_clone_to_owned().ok()?;
        Some(Self {
            storage,
            slots: maps.socket_slots(),
            table: own_hash_map(maps, names::SOCKET_TABLE),
            legacy: own_hash_map(maps, names::LEGACY_REDIRECTS),
        })
    }

    /// Whether the socket table, or else the legacy map, says socklb sent
    /// the socket with this cookie to `backend`.
    fn redirected_to(&self, cookie: u64, backend: &Endpoint) -> bool {
        redirected_by_cookie(
            self.slots.as_deref(),
            self.table.as_ref(),
            self.legacy.as_ref(),
            cookie,
            backend,
        )
    }

    fn census(&self, backends: &[SocketAddr], idle: bool) -> std::io::Result<Vec<Redirected>> {
        sockets::census(
            backends,
            self.storage.as_fd(),
            |cookie, backend| self.redirected_to(cookie, backend),
            idle,
        )
    }
}

/// What a rebalancing close did.
#[derive(Debug, Default)]
pub struct Rebalanced {
    /// Connections closed, by backend id.
    pub closed: BTreeMap<u32, usize>,
    /// Connections closed, by owner.
    pub by_owner: BTreeMap<SocketOwner, usize>,
}

impl Rebalanced {
    pub fn total(&self) -> usize {
        self.closed.values().sum()
    }
}

/// A sweep that ended, for the event loop.
pub enum SweepDone {
    /// close-on-failure of a backend.
    Failed {
        addr: SocketAddr,
        result: std::io::Result<SweepReport>,
    },
    /// A rebalancing step's closes.
    Rebalanced {
        plan: ClosePlan,
        result: std::io::Result<Rebalanced>,
    },
}

/// Closes, off the loop, every connection socklb sent to `addr`.
pub fn close_failed(access: SweepAccess, addr: SocketAddr, done: mpsc::Sender<SweepDone>) {
    tokio::task::spawn_blocking(move || {
        let result = sockets::destroy_redirected(addr, access.storage.as_fd(), |cookie, target| {
            access.redirected_to(cookie, target)
        });
        let _ = done.blocking_send(SweepDone::Failed { addr, result });
    });
}

/// Carries out a rebalancing step's closes, off the loop.
pub fn close_for_balance(access: SweepAccess, plan: ClosePlan, done: mpsc::Sender<SweepDone>) {
    tokio::task::spawn_blocking(move || {
        let result = rebalance(&access, &plan);
        let _ = done.blocking_send(SweepDone::Rebalanced { plan, result });
    });
}

/// One census of the table's members, then, on each backend to close
/// from, the owners' shares (see [`share_among_owners`]) closed idlest
/// first.
fn rebalance(access: &SweepAccess, plan: &ClosePlan) -> std::io::Result<Rebalanced> {
    let addrs: Vec<SocketAddr> = plan.members.iter().map(|(_, addr)| *addr).collect();
    let connections = access.census(&addrs, true)?;
    let mut in_table: BTreeMap<SocketOwner, u64> = BTreeMap::new();
    for connection in &connections {
        *in_table.entry(connection.owner).or_default() += 1;
    }
    let mut done = Rebalanced::default();
    let closer = Closer::new()?;
    for &(backend_id, count) in &plan.closes {
        let Some(addr) = plan
            .members
            .iter()
            .find(|(id, _)| *id == backend_id)
            .map(|(_, addr)| *addr)
        else {
            continue;
        };
        let on_backend: Vec<&Redirected> = connections
            .iter()
            .filter(|connection| connection.backend == addr)
            .collect();
        let closed = close_shares(&closer, &on_backend, &in_table, plan.members.len(), count);
        for (owner, count) in closed {
            *done.by_owner.entry(owner).or_default() += count;
            *done.closed.entry(backend_id).or_default() += count;
        }
    }
    Ok(done)
}

/// Closes `count` of the connections on one backend, each owner's share
/// idlest first; returns what each owner gave.
fn close_shares(
    closer: &Closer,
    on_backend: &[&Redirected],
    in_table: &BTreeMap<SocketOwner, u64>,
    members: usize,
    count: usize,
) -> Vec<(SocketOwner, usize)> {
    let mut per_owner: BTreeMap<SocketOwner, Vec<&Redirected>> = BTreeMap::new();
    for connection in on_backend {
        per_owner
            .entry(connection.owner)
            .or_default()
            .push(connection);
    }
    let holdings: Vec<Holding<SocketOwner>> = per_owner
        .iter()
        .map(|(owner, connections)| Holding {
            owner: *owner,
            on_backend: connections.len() as u64,
            in_table: in_table.get(owner).copied().unwrap_or(0),
        })
        .collect();
    let mut closed = Vec::new();
    for (owner, share) in share_among_owners(count, members, &holdings) {
        let Some(connections) = per_owner.get_mut(&owner) else {
            continue;
        };
        connections.sort_by_key(|connection| std::cmp::Reverse(connection.idle_ms));
        let destroyed = connections
            .iter()
            .take(share)
            .filter(|connection| closer.destroy(connection).is_ok())
            .count();
        if destroyed > 0 {
            closed.push((owner, destroyed));
        }
    }
    closed
}
