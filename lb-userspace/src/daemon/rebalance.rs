//! Rebalancing of long-lived connections. After a rolling restart the
//! server restarted last carries nothing and keeps carrying nothing: the
//! connections that moved off it never come back.
//!
//! The rule:
//! - A table is out of balance when its most loaded backend holds more than
//!   1 + tolerance of the mean, or its least loaded less than
//!   1 − tolerance of it. Judging by the least loaded too matters: with one
//!   server short, its shortfall spreads over the others, each of which
//!   stays under the tolerance (118/118/64 is within 0.2 of the mean at the
//!   top, and 0.36 under it at the bottom).
//! - Once that has lasted `after`, an episode starts: new connects are
//!   steered away from the backends above their fair share (the ceiling
//!   of the mean), and connections on those backends are closed, at most
//!   `rate` per second, until every backend is at or under its fair share,
//!   or within a quarter of the tolerance of the mean both ways.
//!   The clients reconnect through the VIP, and least-conn or the weights
//!   place them. An episode moves at most a fifth more than it needed at
//!   its start, so clients that never reconnect are not closed one by one.
//! - It never acts while a backend of the table is unhealthy, draining or
//!   in slow start: those are moves the table is already making.
//!
//! Which connections move: those of the owners (cgroup and uid) that hold
//! more than their share on the overloaded backend, in proportion to their
//! excess, never a bystander's (see [`share_among_owners`]). A local
//! process that piles its connections on one backend only ever moves its
//! own.
//!
//! The decisions are here, without I/O: [`Rebalancer::look`] turns the
//! state and the live counts into actions (steer, close); the event loop
//! carries them out.

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    time::Instant,
};

use tracing::{info, warn};

use super::state::Owner;
use crate::{
    config::Rebalance,
    dataplane::StoreError,
    errors,
    planner::{TableLayout, Tier},
};

/// One backend of a table, with its live connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub id: u32,
    pub live: u64,
}

/// How far a table is from balance: the most and the least loaded
/// backend's live connections over the mean.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Balance {
    pub high: f64,
    pub low: f64,
}

impl Balance {
    fn within(self, tolerance: f64) -> bool {
        self.high <= 1.0 + tolerance && self.low >= 1.0 - tolerance
    }
}

/// What a step decided for a table.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// In balance, or waiting for the imbalance to last, or for a close
    /// under way.
    Nothing,
    /// An imbalance lasted: an episode starts. `needed` is the least number
    /// of moves that balance the table.
    Start { balance: Balance, needed: u64 },
    /// Close this many connections of each backend.
    Close(Vec<(u32, usize)>),
    /// In balance again after `moved` closes (`needed` at the start).
    Balanced { moved: u64, needed: u64 },
}

#[derive(Debug, Clone, Copy)]
struct Episode {
    since: Instant,
    last: Instant,
    tokens: f64,
    moving: bool,
    needed: u64,
    moved: u64,
    /// A close is under way; the next waits for its count.
    closing: bool,
}

impl Episode {
    fn new(now: Instant) -> Self {
        Self {
            since: now,
            last: now,
            tokens: 0.0,
            moving: false,
            needed: 0,
            moved: 0,
            closing: false,
        }
    }

    /// Never more than the imbalance needed at the start, plus a fifth.
    fn limit(&self) -> u64 {
        self.needed + self.needed / 5 + 1
    }
}

/// Max/mean and min/mean of the live counts, when there is something to
/// balance.
pub fn balance(members: &[Member]) -> Option<Balance> {
    let total: u64 = members.iter().map(|member| member.live).sum();
    if members.len() < 2 || total == 0 {
        return None;
    }
    let mean = total as f64 / members.len() as f64;
    let max = members.iter().map(|member| member.live).max()? as f64;
    let min = members.iter().map(|member| member.live).min()? as f64;
    Some(Balance {
        high: max / mean,
        low: min / mean,
    })
}

/// For each backend above its fair share (the mean, rounded up), how many
/// connections it has too many, the most first: what balance needs moved,
/// at least.
pub fn excess(members: &[Member]) -> Vec<(u32, u64)> {
    let total: u64 = members.iter().map(|member| member.live).sum();
    if members.is_empty() {
        return Vec::new();
    }
    let fair = total.div_ceil(members.len() as u64);
    let mut over: Vec<(u32, u64)> = members
        .iter()
        .filter(|member| member.live > fair)
        .map(|member| (member.id, member.live - fair))
        .collect();
    over.sort_by_key(|&(id, count)| (std::cmp::Reverse(count), id));
    over
}

/// One owner's connections on a backend to close from, and on the whole
/// table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holding<K> {
    pub owner: K,
    pub on_backend: u64,
    pub in_table: u64,
}

/// How many of `count` connections to close on a backend each owner gives
/// up, in proportion to how far it is above its own fair share there (its
/// connections in the table over the `members` backends).
///
/// An owner at or under its share (rounded up) is a bystander: it gives
/// nothing. The owners clearly above theirs give first. Only when they
/// cannot give enough do the owners with fewer connections than there are
/// backends give (many processes of one connection each, all on the
/// overloaded backend, as after a rolling restart: none can sit at its
/// share everywhere), in proportion to how far they are above their exact
/// share, each at most what puts it at its share rounded down. Never more
/// than `count` in all.
pub fn share_among_owners<K: Copy + Ord>(
    count: usize,
    members: usize,
    holdings: &[Holding<K>],
) -> Vec<(K, usize)> {
    let members = members.max(1) as u64;
    let share = |holding: &Holding<K>| holding.in_table as f64 / members as f64;
    // Clearly above: the excess over the share rounded up.
    let clear: Vec<(f64, u64)> = holdings
        .iter()
        .map(|holding| {
            let excess = holding
                .on_backend
                .saturating_sub(holding.in_table.div_ceil(members));
            (excess as f64, excess)
        })
        .collect();
    let first = apportion(count as u64, &clear);
    let left = count as u64 - first.iter().sum::<u64>();
    // Owners too small to balance themselves: above the exact share, by
    // what is left of the excess.
    let fractional: Vec<(f64, u64)> = holdings
        .iter()
        .zip(&first)
        .map(|(holding, &given)| {
            if holding.in_table >= members {
                return (0.0, 0);
            }
            let weight = (holding.on_backend as f64 - share(holding) - given as f64).max(0.0);
            let cap = holding
                .on_backend
                .saturating_sub(holding.in_table / members)
                .saturating_sub(given);
            (weight, cap)
        })
        .collect();
    let second = apportion(left, &fractional);
    let mut shares: Vec<(K, usize)> = holdings
        .iter()
        .zip(first.iter().zip(&second))
        .filter(|(_, (first, second))| **first + **second > 0)
        .map(|(holding, (first, second))| (holding.owner, (first + second) as usize))
        .collect();
    shares.sort();
    shares
}

/// Splits `total` in proportion to the weights, each part at most its cap:
/// one at a time, to the part furthest below its proportional target.
fn apportion(total: u64, weights: &[(f64, u64)]) -> Vec<u64> {
    let mut given = vec![0u64; weights.len()];
    let sum: f64 = weights
        .iter()
        .filter(|(weight, cap)| *weight > 0.0 && *cap > 0)
        .map(|(weight, _)| weight)
        .sum();
    if sum <= 0.0 {
        return given;
    }
    for _ in 0..total {
        let next = weights
            .iter()
            .enumerate()
            .filter(|(index, (weight, cap))| *weight > 0.0 && given[*index] < *cap)
            .map(|(index, (weight, _))| {
                let target = total as f64 * weight / sum;
                (index, target - given[index] as f64)
            })
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
        match next {
            Some((index, _)) => given[index] += 1,
            None => break,
        }
    }
    given
}

/// Closes the event loop carries out for one table: how many on each
/// backend, taken from the owners of the excess.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClosePlan {
    pub table_id: u32,
    pub service: String,
    /// Every backend that shares the load: an owner's share is measured
    /// over them.
    pub members: Vec<(u32, SocketAddr)>,
    /// Connections to close, by backend id.
    pub closes: Vec<(u32, usize)>,
}

/// What the event loop does for the tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Steer new connects away from these backends (on), or stop (off).
    Steer {
        ids: Vec<u32>,
        on: bool,
    },
    Close(ClosePlan),
}

/// The rebalancing state of every table, by table id.
#[derive(Debug, Default)]
pub struct Rebalancer {
    episodes: HashMap<u32, Episode>,
    /// Tables whose counts could not be read (said once).
    unreadable: HashSet<u32>,
}

impl Rebalancer {
    /// A backend of the table is unhealthy, draining or ramping: forget any
    /// episode; the clock starts again once the table is whole.
    pub fn pause(&mut self, table_id: u32) {
        self.episodes.remove(&table_id);
    }

    /// One look at a table, at `now`.
    pub fn step(
        &mut self,
        table_id: u32,
        settings: Rebalance,
        members: &[Member],
        now: Instant,
    ) -> Step {
        let tolerance = f64::from(settings.tolerance_permille) / 1000.0;
        let current = balance(members);
        let imbalance = current.filter(|current| !current.within(tolerance));
        let moving = self
            .episodes
            .get(&table_id)
            .is_some_and(|episode| episode.moving);
        if moving {
            // Near enough: a residue of a connection or two is not worth a
            // close (and would fall on whoever holds it).
            let near = current.is_none_or(|current| current.within(tolerance / 4.0));
            return self.carry_on(table_id, settings, members, near, imbalance.is_none(), now);
        }
        let Some(imbalance) = imbalance else {
            self.episodes.remove(&table_id);
            return Step::Nothing;
        };
        let episode = self
            .episodes
            .entry(table_id)
            .or_insert_with(|| Episode::new(now));
        episode.last = now;
        if now.saturating_duration_since(episode.since) < settings.after {
            return Step::Nothing;
        }
        episode.moving = true;
        episode.needed = excess(members).iter().map(|&(_, count)| count).sum();
        // The first close may happen at once.
        episode.tokens = 1.0;
        Step::Start {
            balance: imbalance,
            needed: episode.needed,
        }
    }

    /// A step of an episode under way: closes at the rate, on the most
    /// loaded first, until the table is near balance.
    fn carry_on(
        &mut self,
        table_id: u32,
        settings: Rebalance,
        members: &[Member],
        near: bool,
        within_tolerance: bool,
        now: Instant,
    ) -> Step {
        let Some(episode) = self.episodes.get_mut(&table_id) else {
            return Step::Nothing;
        };
        let over = excess(members);
        let exhausted = episode.moved >= episode.limit();
        if over.is_empty() || near || (exhausted && within_tolerance) {
            let done = Step::Balanced {
                moved: episode.moved,
                needed: episode.needed,
            };
            self.episodes.remove(&table_id);
            return done;
        }
        if episode.closing || exhausted {
            return Step::Nothing;
        }
        let rate = f64::from(settings.rate);
        let elapsed = now.saturating_duration_since(episode.last).as_secs_f64();
        episode.tokens = (episode.tokens + rate * elapsed).min(rate.max(1.0));
        episode.last = now;
        let mut budget = (episode.tokens.floor() as u64).min(episode.limit() - episode.moved);
        let mut closes = Vec::new();
        for (id, count) in over {
            if budget == 0 {
                break;
            }
            let take = count.min(budget);
            budget -= take;
            closes.push((id, take as usize));
        }
        if closes.is_empty() {
            return Step::Nothing;
        }
        episode.closing = true;
        Step::Close(closes)
    }

    /// The close of the table's episode ended, after closing `count`.
    pub fn moved(&mut self, table_id: u32, count: usize) {
        if let Some(episode) = self.episodes.get_mut(&table_id) {
            episode.moved += count as u64;
            episode.tokens = (episode.tokens - count as f64).max(0.0);
            episode.closing = false;
        }
    }

    /// One look at every table that rebalances: the state (health, drains,
    /// slow starts, from `owner`) and the live counts (`live`) give the
    /// actions.
    pub fn look(
        &mut self,
        owner: &Owner,
        live: impl Fn(u32) -> Result<u64, StoreError>,
        now: Instant,
    ) -> Vec<Action> {
        let mut actions = Vec::new();
        for table in &owner.layout().tables {
            let Some(settings) = table.rebalance else {
                continue;
            };
            let members = sharing_members(table);
            let ids: Vec<u32> = members.iter().map(|(id, _)| *id).collect();
            let whole = ids.iter().all(|&id| {
                let health = owner.health(id);
                health.healthy && !health.draining && owner.ramp_step(id).is_none()
            });
            if !whole {
                self.pause(table.table_id);
                actions.push(Action::Steer { ids, on: false });
                continue;
            }
            let Some(counts) = self.read(table, &ids, &live) else {
                continue;
            };
            let step = self.step(table.table_id, settings, &counts, now);
            actions.extend(decide(table, settings, &members, &counts, step));
        }
        actions
    }

    /// The live counts of a table's members; `None` (said once) when a
    /// count cannot be read: no decision on counts that may be wrong.
    fn read(
        &mut self,
        table: &TableLayout,
        ids: &[u32],
        live: &impl Fn(u32) -> Result<u64, StoreError>,
    ) -> Option<Vec<Member>> {
        let counts: Result<Vec<Member>, StoreError> = ids
            .iter()
            .map(|&id| live(id).map(|live| Member { id, live }))
            .collect();
        match counts {
            Ok(counts) => {
                self.unreadable.remove(&table.table_id);
                Some(counts)
            }
            Err(error) => {
                if self.unreadable.insert(table.table_id) {
                    warn!(
                        "rebalance: {}: reading the live counts failed; no rebalancing until they can be read: {}",
                        table.service,
                        errors::chain(&error)
                    );
                }
                None
            }
        }
    }
}

/// The backends that share a table's load: its best tier that is not
/// standby.
fn sharing_members(table: &TableLayout) -> Vec<(u32, SocketAddr)> {
    let tier = table
        .backends
        .iter()
        .map(|backend| backend.tier)
        .filter(|tier| *tier != Tier::Standby)
        .min();
    table
        .backends
        .iter()
        .filter(|backend| Some(backend.tier) == tier)
        .map(|backend| (backend.id, backend.addr))
        .collect()
}

/// The actions of one table's step, said in the log.
fn decide(
    table: &TableLayout,
    settings: Rebalance,
    members: &[(u32, SocketAddr)],
    counts: &[Member],
    step: Step,
) -> Vec<Action> {
    let counts_text = || {
        counts
            .iter()
            .map(|member| member.live.to_string())
            .collect::<Vec<_>>()
            .join("/")
    };
    match step {
        Step::Nothing => Vec::new(),
        Step::Start { balance, needed } => {
            let tolerance = f64::from(settings.tolerance_permille) / 1000.0;
            info!(
                "rebalance: {}: live {} (max/mean {:.2}, min/mean {:.2}; balanced within {:.2}..{:.2} for {:?}): moving {needed} connections, at most {}/s, from the owners above their share",
                table.service,
                counts_text(),
                balance.high,
                balance.low,
                1.0 - tolerance,
                1.0 + tolerance,
                settings.after,
                settings.rate
            );
            // New connects (the closed ones reconnecting) go to the others
            // while the episode lasts.
            let over = excess(counts).iter().map(|&(id, _)| id).collect();
            vec![Action::Steer {
                ids: over,
                on: true,
            }]
        }
        Step::Balanced { moved, needed } => {
            info!(
                "rebalance: {}: in balance again (live {}) after {moved} moves ({needed} needed)",
                table.service,
                counts_text()
            );
            vec![Action::Steer {
                ids: members.iter().map(|(id, _)| *id).collect(),
                on: false,
            }]
        }
        Step::Close(closes) => vec![Action::Close(ClosePlan {
            table_id: table.table_id,
            service: table.service.clone(),
            members: members.to_vec(),
            closes,
        })],
    }
}

#[cfg(test)]
mod tests;
