//! Rebalancing of long-lived connections. After a rolling restart the
//! server restarted last carries nothing and keeps carrying nothing: the
//! connections that moved off it never come back. When a table's live
//! counts stay out of balance (max/mean above 1 + tolerance for longer than
//! `after`), connections on the most loaded backends are closed, idlest
//! first, at most `rate` per second and no more than the imbalance needs;
//! the clients reconnect through the VIP and least-conn or the weights
//! place them. An episode moves at most a fifth more than it needed at its
//! start, so clients that never reconnect are not closed one by one. It never acts while a backend of the table is unhealthy,
//! draining or in slow start: those are moves the table is already making.
//!
//! The decisions are here, without I/O; the event loop closes the sockets.

use std::{collections::HashMap, time::Instant};

use crate::config::Rebalance;

/// One backend of a table, with its live connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub id: u32,
    pub live: u64,
}

/// What the event loop should do for a table.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// In balance, or waiting for the imbalance to last.
    Nothing,
    /// An imbalance lasted: the first close of an episode. `needed` is the
    /// least number of moves that balance the table.
    Start { ratio: f64, needed: u64 },
    /// Close this many connections of each backend (idlest first).
    Close(Vec<(u32, usize)>),
    /// In balance again after `moved` closes (`needed` at the start).
    Balanced { moved: u64, needed: u64 },
}

#[derive(Debug, Clone, Copy)]
struct Episode {
    since: Instant,
    last: Instant,
    tokens: f64,
    started: bool,
    needed: u64,
    moved: u64,
}

/// The rebalancing state of every table, by table id.
#[derive(Debug, Default)]
pub struct Rebalancer {
    episodes: HashMap<u32, Episode>,
}

/// max/mean of the live counts, when there is something to balance.
pub fn ratio(members: &[Member]) -> Option<f64> {
    let total: u64 = members.iter().map(|member| member.live).sum();
    if members.len() < 2 || total == 0 {
        return None;
    }
    let mean = total as f64 / members.len() as f64;
    let max = members.iter().map(|member| member.live).max()? as f64;
    Some(max / mean)
}

/// For each backend above the mean (rounded up), how many connections it
/// has too many: what balance needs moved, at least.
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
        let imbalance = ratio(members).filter(|ratio| *ratio > 1.0 + tolerance);
        let Some(ratio) = imbalance else {
            return match self.episodes.remove(&table_id) {
                Some(episode) if episode.started => Step::Balanced {
                    moved: episode.moved,
                    needed: episode.needed,
                },
                _ => Step::Nothing,
            };
        };
        let episode = self.episodes.entry(table_id).or_insert(Episode {
            since: now,
            last: now,
            tokens: 0.0,
            started: false,
            needed: 0,
            moved: 0,
        });
        if now.saturating_duration_since(episode.since) < settings.after {
            episode.last = now;
            return Step::Nothing;
        }
        let over = excess(members);
        if !episode.started {
            episode.started = true;
            episode.needed = over.iter().map(|&(_, count)| count).sum();
            // The first close may happen at once.
            episode.tokens = 1.0;
            episode.last = now;
            return Step::Start {
                ratio,
                needed: episode.needed,
            };
        }
        // Never more than the imbalance needed at the start, plus a fifth:
        // clients that do not come back must not be closed one after the
        // other until nothing is left.
        let limit = episode.needed + episode.needed / 5 + 1;
        if episode.moved >= limit {
            return Step::Nothing;
        }
        let rate = f64::from(settings.rate);
        let elapsed = now.saturating_duration_since(episode.last).as_secs_f64();
        episode.tokens = (episode.tokens + rate * elapsed).min(rate.max(1.0));
        episode.last = now;
        let mut budget = (episode.tokens.floor() as u64).min(limit - episode.moved);
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
            Step::Nothing
        } else {
            Step::Close(closes)
        }
    }

    /// `count` connections were closed in the table's episode.
    pub fn moved(&mut self, table_id: u32, count: usize) {
        if let Some(episode) = self.episodes.get_mut(&table_id) {
            episode.moved += count as u64;
            episode.tokens = (episode.tokens - count as f64).max(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn members(live: &[u64]) -> Vec<Member> {
        live.iter()
            .enumerate()
            .map(|(id, &live)| Member {
                id: id as u32,
                live,
            })
            .collect()
    }

    #[test]
    fn excess_is_what_balance_needs_moved() {
        assert_eq!(excess(&members(&[30, 30, 0])), vec![(0, 10), (1, 10)]);
        assert_eq!(excess(&members(&[21, 20, 20])), vec![]);
        assert_eq!(excess(&members(&[50, 0])), vec![(0, 25)]);
        assert_eq!(ratio(&members(&[30, 30, 0])), Some(1.5));
        assert_eq!(ratio(&members(&[0, 0, 0])), None);
        assert_eq!(ratio(&members(&[7])), None);
    }

    #[test]
    fn it_waits_then_moves_at_the_rate_and_stops_in_balance() {
        let settings = Rebalance {
            tolerance_permille: 200,
            after: Duration::from_secs(10),
            rate: 4,
        };
        let mut rebalancer = Rebalancer::default();
        let start = Instant::now();
        let at = |seconds: f64| start + Duration::from_secs_f64(seconds);
        let table = members(&[30, 30, 0]);
        assert_eq!(rebalancer.step(0, settings, &table, at(0.0)), Step::Nothing);
        assert_eq!(rebalancer.step(0, settings, &table, at(9.5)), Step::Nothing);
        let Step::Start { ratio, needed } = rebalancer.step(0, settings, &table, at(10.0)) else {
            panic!("an episode starts after 10 s");
        };
        assert_eq!((ratio, needed), (1.5, 20));
        // One token at the start, then 4 per second, capped at 4.
        assert_eq!(
            rebalancer.step(0, settings, &table, at(10.0)),
            Step::Close(vec![(0, 1)])
        );
        rebalancer.moved(0, 1);
        assert_eq!(
            rebalancer.step(0, settings, &table, at(10.5)),
            Step::Close(vec![(0, 2)])
        );
        rebalancer.moved(0, 2);
        assert_eq!(
            rebalancer.step(0, settings, &members(&[27, 30, 3]), at(20.0)),
            Step::Close(vec![(1, 4)]),
            "the most loaded first, never more than the rate's burst"
        );
        rebalancer.moved(0, 4);
        // Balanced: the episode ends and says what it moved.
        assert_eq!(
            rebalancer.step(0, settings, &members(&[21, 20, 19]), at(21.0)),
            Step::Balanced {
                moved: 7,
                needed: 20
            }
        );
        assert_eq!(
            rebalancer.step(0, settings, &members(&[21, 20, 19]), at(22.0)),
            Step::Nothing
        );
    }

    #[test]
    fn clients_that_never_come_back_are_not_all_closed() {
        let settings = Rebalance {
            tolerance_permille: 200,
            after: Duration::from_secs(1),
            rate: 1000,
        };
        let mut rebalancer = Rebalancer::default();
        let start = Instant::now();
        let mut live = vec![30u64, 30, 0];
        let mut moved = 0;
        for tick in 0..200u64 {
            let now = start + Duration::from_millis(500 * tick);
            if let Step::Close(closes) = rebalancer.step(0, settings, &members(&live), now) {
                for (id, count) in closes {
                    live[id as usize] -= count as u64;
                    moved += count;
                    rebalancer.moved(0, count);
                }
            }
        }
        // 20 needed; at most 20 + 4 + 1 moved, though the table never
        // balances.
        assert!((20..=25).contains(&moved), "{moved} moved; live {live:?}");
    }

    #[test]
    fn a_pause_restarts_the_clock() {
        let settings = Rebalance {
            tolerance_permille: 200,
            after: Duration::from_secs(1),
            rate: 5,
        };
        let mut rebalancer = Rebalancer::default();
        let start = Instant::now();
        let table = members(&[10, 0]);
        assert_eq!(rebalancer.step(3, settings, &table, start), Step::Nothing);
        rebalancer.pause(3);
        assert_eq!(
            rebalancer.step(3, settings, &table, start + Duration::from_millis(1500)),
            Step::Nothing,
            "the clock started again at the pause"
        );
        assert!(matches!(
            rebalancer.step(3, settings, &table, start + Duration::from_millis(2500)),
            Step::Start { .. }
        ));
    }
}
