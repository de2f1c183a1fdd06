//! The planner: a pure function from (services, health) to the selection
//! tables the kernel reads. No I/O, no clock, no hidden state.
//!
//! [`Layout`] fixes the ids once per configuration: each service gets one
//! table per address family of its VIPs, and each backend of that family an
//! id. [`plan`] then turns the layout plus one health bit per backend into
//! [`TableContents`]: the weighted healthy list and the all-backends list.

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, SocketAddr},
};

use lb_common::{
    FAMILY_V4, FAMILY_V6, MAX_BACKENDS, MAX_TABLES, SERVICE_FLAG_ACCELERATE,
    SERVICE_FLAG_ALL_NETNS, SERVICE_FLAG_HAND_BACK, SERVICE_FLAG_HAND_BACK_AUTO,
    SERVICE_FLAG_LEAST_CONN, SERVICE_FLAG_PREFER_LOCAL, SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY,
    SLOTS_PER_LIST,
};

use crate::{
    config::{
        BackendRole, Config, HealthSettings, NoneHealthyPolicy, SelectionPolicy, Service,
        WhenDaemonGone, weight_divisor,
    },
    convert::family_of,
    hand_back::HandBackChoice,
    sockets::Listening,
};

/// Priority tier of a backend: the healthy backends of the best tier that
/// has any make up the table. Lower is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// prefer-local: on this host, or marked preferred.
    Preferred,
    Normal,
    /// Only while no other backend is healthy.
    Standby,
}

/// A backend with its fixed id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendLayout {
    pub id: u32,
    pub addr: SocketAddr,
    pub weight: u32,
    pub tier: Tier,
    /// Drained by the config: no new connections.
    pub drain: bool,
    /// On this host (loopback or an address of this host): a connection to
    /// it can be accelerated.
    pub local: bool,
}

/// One selection table: a service's VIPs and backends of one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableLayout {
    pub table_id: u32,
    pub service: String,
    pub family: u8,
    pub flags: u32,
    pub close_on_failure: bool,
    pub health: HealthSettings,
    /// The service's slow start (None: off).
    pub slow_start: Option<std::time::Duration>,
    /// The service's rebalancing (None: off).
    pub rebalance: Option<crate::config::Rebalance>,
    /// Where the VIPs are handed back once the daemon is gone: how old the
    /// heartbeat may get before they are (None: keep redirecting).
    pub hand_back_after: Option<std::time::Duration>,
    /// The service's `when-daemon-gone`, what applies and why.
    pub hand_back: HandBackChoice,
    pub vips: Vec<SocketAddr>,
    pub backends: Vec<BackendLayout>,
}

/// Every table of a configuration, with its ids: in config order for a
/// first start, kept from the pinned records otherwise (see `keeping`), so
/// a restarted daemon finds its counters where it left them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Layout {
    pub tables: Vec<TableLayout>,
}

/// The ids a previous configuration gave (from the pinned records): tables
/// by (service, family), backends by (service, address), and the backend
/// ids that must not go to another backend because connections counted
/// under them are still open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KnownIds {
    pub tables: HashMap<(String, u8), u32>,
    pub backends: HashMap<(String, SocketAddr), u32>,
    pub busy: HashSet<u32>,
}

/// Gives each item its known id when it has one not taken yet, then every
/// other item the lowest id not taken and not busy (busy ids go last).
fn assign_ids(wanted: &[Option<u32>], limit: u32, busy: &HashSet<u32>) -> Vec<u32> {
    let mut taken: HashSet<u32> = HashSet::new();
    let mut ids: Vec<Option<u32>> = wanted
        .iter()
        .map(|known| known.filter(|id| *id < limit && taken.insert(*id)))
        .collect();
    let mut free = (0..limit).filter(|id| !taken.contains(id) && !busy.contains(id));
    let mut busy_free = (0..limit).filter(|id| !taken.contains(id) && busy.contains(id));
    for id in ids.iter_mut().filter(|id| id.is_none()) {
        *id = free.next().or_else(|| busy_free.next());
    }
    // The config's limits keep the items within `limit`.
    ids.into_iter().map(|id| id.unwrap_or(limit)).collect()
}

/// The SERVICES flags of a service: its policies, as the hook reads them.
fn service_flags(service: &Service, hand_back: bool) -> u32 {
    let mut flags = 0;
    for (on, flag) in [
        (
            service.when_none_healthy == NoneHealthyPolicy::Reject,
            SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY,
        ),
        (
            service.policy == SelectionPolicy::LeastConn,
            SERVICE_FLAG_LEAST_CONN,
        ),
        (
            service.policy == SelectionPolicy::PreferLocal,
            SERVICE_FLAG_PREFER_LOCAL,
        ),
        (service.all_netns, SERVICE_FLAG_ALL_NETNS),
        (service.accelerate, SERVICE_FLAG_ACCELERATE),
        (hand_back, SERVICE_FLAG_HAND_BACK),
        (
            service.when_daemon_gone == WhenDaemonGone::Auto,
            SERVICE_FLAG_HAND_BACK_AUTO,
        ),
    ] {
        if on {
            flags |= flag;
        }
    }
    flags
}

impl Layout {
    /// `is_local(ip)` says whether an address belongs to this host; it
    /// matters for the prefer-local policy and for acceleration. Ids follow
    /// config order. `when-daemon-gone = "auto"` is decided as if nothing
    /// else listened on the VIPs.
    pub fn from_config(config: &Config, is_local: impl Fn(IpAddr) -> bool) -> Self {
        Self::keeping(config, is_local, &KnownIds::default(), &[])
    }

    /// Like `from_config`, but keeping the ids of `known`: a table keeps
    /// its id as long as its service has VIPs of its family, a backend as
    /// long as its service lists its address, whatever the order of the
    /// file. Counters indexed by id thus stay true across any edit.
    /// `listeners` are the sockets other than socklb's that listen on the
    /// VIPs: they decide `when-daemon-gone = "auto"`.
    pub fn keeping(
        config: &Config,
        is_local: impl Fn(IpAddr) -> bool,
        known: &KnownIds,
        listeners: &[Listening],
    ) -> Self {
        let mut layout = Self::in_config_order(config, is_local, listeners);
        let table_ids = assign_ids(
            &layout
                .tables
                .iter()
                .map(|table| {
                    known
                        .tables
                        .get(&(table.service.clone(), table.family))
                        .copied()
                })
                .collect::<Vec<_>>(),
            MAX_TABLES,
            &HashSet::new(),
        );
        let backend_ids = assign_ids(
            &layout
                .backends()
                .map(|(table, backend)| {
                    known
                        .backends
                        .get(&(table.service.clone(), backend.addr))
                        .copied()
                })
                .collect::<Vec<_>>(),
            MAX_BACKENDS,
            &known.busy,
        );
        let mut next = backend_ids.into_iter();
        for (table, table_id) in layout.tables.iter_mut().zip(table_ids) {
            table.table_id = table_id;
            for backend in &mut table.backends {
                backend.id = next.next().unwrap_or(MAX_BACKENDS);
            }
        }
        layout
    }

    fn in_config_order(
        config: &Config,
        is_local: impl Fn(IpAddr) -> bool,
        listeners: &[Listening],
    ) -> Self {
        let mut tables = Vec::new();
        let mut next_backend_id = 0;
        for service in &config.services {
            let prefer_local = service.policy == SelectionPolicy::PreferLocal;
            let hand_back =
                HandBackChoice::decide(service.when_daemon_gone, &service.vips, listeners);
            let hand_back_after = hand_back.hand_back.then_some(service.daemon_gone_after);
            let flags = service_flags(service, hand_back.hand_back);
            for family in [FAMILY_V4, FAMILY_V6] {
                let vips: Vec<SocketAddr> = service
                    .vips
                    .iter()
                    .copied()
                    .filter(|vip| family_of(vip) == family)
                    .collect();
                if vips.is_empty() {
                    continue;
                }
                let backends = service
                    .backends
                    .iter()
                    .filter(|backend| family_of(&backend.addr) == family)
                    .map(|backend| {
                        next_backend_id += 1;
                        let local = backend.addr.ip().is_loopback() || is_local(backend.addr.ip());
                        let tier = match backend.role {
                            BackendRole::Standby => Tier::Standby,
                            BackendRole::Preferred => Tier::Preferred,
                            BackendRole::Normal if prefer_local && local => Tier::Preferred,
                            BackendRole::Normal => Tier::Normal,
                        };
                        BackendLayout {
                            id: next_backend_id - 1,
                            addr: backend.addr,
                            weight: backend.weight,
                            tier,
                            drain: backend.drain,
                            local,
                        }
                    })
                    .collect();
                tables.push(TableLayout {
                    table_id: tables.len() as u32,
                    service: service.name.clone(),
                    family,
                    flags,
                    close_on_failure: service.close_on_failure,
                    health: service.health.clone(),
                    slow_start: service.slow_start,
                    rebalance: service.rebalance,
                    hand_back_after,
                    hand_back: hand_back.clone(),
                    vips,
                    backends,
                });
            }
        }
        Self { tables }
    }

    /// Every backend of every table.
    pub fn backends(&self) -> impl Iterator<Item = (&TableLayout, &BackendLayout)> {
        self.tables
            .iter()
            .flat_map(|table| table.backends.iter().map(move |backend| (table, backend)))
    }
}

/// What one table holds: backend ids, expanded by weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableContents {
    pub table_id: u32,
    /// Used while it is not empty.
    pub healthy: Vec<u32>,
    /// Used by fail-open when `healthy` is empty.
    pub all: Vec<u32>,
}

/// Steps of a slow start: a ramping backend counts `step/RAMP_STEPS` of
/// its weight in the healthy list, from step 1 to the full weight.
pub const RAMP_STEPS: u32 = 10;

/// The planner. `is_healthy(backend_id)` is the health view.
///
/// The healthy list holds the healthy backends of the best tier that has
/// any (preferred, then normal, then standby). The all list, for fail-open,
/// holds every backend.
pub fn plan(layout: &Layout, is_healthy: impl Fn(u32) -> bool) -> Vec<TableContents> {
    plan_ramped(layout, is_healthy, |_| None)
}

/// [`plan`], with the backends in slow start: `ramp_step(backend_id)` is
/// Some(step) (1..RAMP_STEPS) for one that ramps, which then holds about
/// `step/RAMP_STEPS` of its weight's share in the healthy list. The
/// fail-open list keeps every full weight.
pub fn plan_ramped(
    layout: &Layout,
    is_healthy: impl Fn(u32) -> bool,
    ramp_step: impl Fn(u32) -> Option<u32>,
) -> Vec<TableContents> {
    layout
        .tables
        .iter()
        .map(|table| {
            let best_tier = table
                .backends
                .iter()
                .filter(|backend| is_healthy(backend.id))
                .map(|backend| backend.tier)
                .min();
            let weighted = |keep: &dyn Fn(&BackendLayout) -> bool, ramped: bool| {
                let members: Vec<(u32, u32)> = table
                    .backends
                    .iter()
                    .filter(|backend| keep(backend))
                    .map(|backend| {
                        let step = ramped
                            .then(|| ramp_step(backend.id))
                            .flatten()
                            .map_or(RAMP_STEPS, |step| step.clamp(1, RAMP_STEPS));
                        (backend.id, backend.weight * step)
                    })
                    .collect();
                expand_weights(&members, SLOTS_PER_LIST as usize)
            };
            TableContents {
                table_id: table.table_id,
                healthy: weighted(
                    &|backend| is_healthy(backend.id) && Some(backend.tier) == best_tier,
                    true,
                ),
                all: weighted(&|_| true, false),
            }
        })
        .collect()
}

/// Expands `(id, weight)` pairs into a list in which each id appears in
/// proportion to its weight, with at most `capacity` entries and every id at
/// least once. Weights are first divided by their greatest common divisor,
/// so equal weights cost one slot each.
pub fn expand_weights(members: &[(u32, u32)], capacity: usize) -> Vec<u32> {
    if members.is_empty() {
        return Vec::new();
    }
    let weights: Vec<u32> = members.iter().map(|&(_, weight)| weight).collect();
    let divisor = weight_divisor(&weights);
    let mut counts: Vec<usize> = members
        .iter()
        .map(|&(_, weight)| (weight / divisor) as usize)
        .collect();
    let total: usize = counts.iter().sum();
    if total > capacity {
        // Scale down, keeping each member at least once; then trim the
        // largest shares until the list fits.
        counts = counts
            .iter()
            .map(|&count| (count * capacity / total).max(1))
            .collect();
        while counts.iter().sum::<usize>() > capacity {
            let largest = (0..counts.len()).max_by_key(|&i| counts[i]).unwrap_or(0);
            if counts[largest] <= 1 {
                break;
            }
            counts[largest] -= 1;
        }
    }
    let mut list = Vec::with_capacity(counts.iter().sum());
    for (&(id, _), &count) in members.iter().zip(&counts) {
        list.extend(std::iter::repeat_n(id, count));
    }
    list.truncate(capacity);
    list
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::config::parse_toml;

    fn layout(text: &str) -> Layout {
        Layout::from_config(&parse_toml(text).unwrap(), |_| false)
    }

    const TWO_FAMILIES: &str = r#"
        [[service]]
        name = "api"
        vips = ["127.0.0.1:6444", "[::1]:6444"]
        when-none-healthy = "reject"
        backends = ["127.0.0.2:1,weight=2", "[::1]:2", "127.0.0.3:1"]
        [[service]]
        name = "etcd"
        all-netns = true
        vips = ["127.0.0.1:2379"]
        backends = ["127.0.0.4:1"]
    "#;

    /// (service, address) → id of every backend of a layout.
    fn backend_ids(layout: &Layout) -> HashMap<(String, SocketAddr), u32> {
        layout
            .backends()
            .map(|(table, backend)| ((table.service.clone(), backend.addr), backend.id))
            .collect()
    }

    #[test]
    fn ids_are_kept_across_reorders_and_edits() {
        let first = layout(TWO_FAMILIES);
        let known = KnownIds {
            tables: first
                .tables
                .iter()
                .map(|table| ((table.service.clone(), table.family), table.table_id))
                .collect(),
            backends: backend_ids(&first),
            // 127.0.0.4 (id 3) is dropped below while connections to it
            // are open: its id must not go to another backend.
            busy: HashSet::from([3]),
        };
        let edited = r#"
            [[service]]
            name = "etcd"
            all-netns = true
            vips = ["127.0.0.1:2379"]
            backends = ["127.0.0.9:1"]
            [[service]]
            name = "api"
            vips = ["[::1]:6444", "127.0.0.1:6444"]
            when-none-healthy = "reject"
            backends = ["127.0.0.3:1", "[::1]:2", "127.0.0.8:1", "127.0.0.2:1,weight=2"]
        "#;
        let second = Layout::keeping(&parse_toml(edited).unwrap(), |_| false, &known, &[]);
        let ids = backend_ids(&second);
        let id = |service: &str, addr: &str| ids[&(service.to_string(), addr.parse().unwrap())];
        // (what, kept id or expected id)
        let cases = [
            ("127.0.0.2 keeps its id", id("api", "127.0.0.2:1"), 0),
            ("127.0.0.3 keeps its id", id("api", "127.0.0.3:1"), 1),
            ("[::1]:2 keeps its id", id("api", "[::1]:2"), 2),
            (
                "a new backend takes the lowest free id, not a busy one",
                id("etcd", "127.0.0.9:1"),
                4,
            ),
            (
                "the next new one takes the next",
                id("api", "127.0.0.8:1"),
                5,
            ),
        ];
        for (what, got, want) in cases {
            assert_eq!(got, want, "{what}");
        }
        let tables: Vec<(&str, u8, u32)> = second
            .tables
            .iter()
            .map(|table| (table.service.as_str(), table.family, table.table_id))
            .collect();
        assert_eq!(
            tables,
            [
                ("etcd", FAMILY_V4, 2),
                ("api", FAMILY_V4, 0),
                ("api", FAMILY_V6, 1)
            ],
            "tables keep their ids, whatever the order"
        );
    }

    #[test]
    fn a_service_that_hands_back_says_so_in_its_flags_and_its_patience() {
        let layout = layout(
            r#"
            [[service]]
            name = "api"
            vips = ["127.0.0.1:6444", "[::1]:6444"]
            backends = ["127.0.0.2:1", "[::1]:2"]
            when-daemon-gone = "hand-back"
            daemon-gone-after = "3s"
            [[service]]
            name = "etcd"
            vips = ["127.0.0.1:2379"]
            backends = ["127.0.0.4:1"]
            "#,
        );
        let summary: Vec<(u32, bool, Option<std::time::Duration>)> = layout
            .tables
            .iter()
            .map(|t| {
                (
                    t.table_id,
                    t.flags & SERVICE_FLAG_HAND_BACK != 0,
                    t.hand_back_after,
                )
            })
            .collect();
        let three = Some(std::time::Duration::from_secs(3));
        assert_eq!(
            summary,
            [(0, true, three), (1, true, three), (2, false, None)]
        );
        let liveness = crate::dataplane::tables::liveness(&layout, 77);
        assert_eq!(liveness.heartbeat_ns, 77);
        assert_eq!(
            liveness.gone_after_ns[..3],
            [3_000_000_000, 3_000_000_000, 0]
        );
        let cases = [
            ("table 0, 3 s after the beat", 0, 77 + 3_000_000_000, false),
            ("table 0, past 3 s", 0, 78 + 3_000_000_000, true),
            ("table 2 keeps redirecting", 2, u64::MAX, false),
            ("a beat later than the clock", 0, 10, false),
            ("a table past the end", 99, u64::MAX, false),
        ];
        for (what, table_id, now, handed_back) in cases {
            assert_eq!(liveness.handed_back(table_id, now), handed_back, "{what}");
        }
    }

    /// `auto` (the default) hands back the services whose VIPs have a
    /// listener, and the flags say it was auto's choice.
    #[test]
    fn auto_hands_back_where_another_socket_listens_on_a_vip() {
        let config = parse_toml(
            r#"
            [[service]]
            name = "api"
            vips = ["127.0.0.1:6444"]
            backends = ["127.0.0.2:1"]
            [[service]]
            name = "etcd"
            vips = ["127.0.0.1:2379"]
            backends = ["127.0.0.4:1"]
            [[service]]
            name = "supervisor"
            vips = ["127.0.0.1:9345"]
            backends = ["127.0.0.5:1"]
            when-daemon-gone = "keep"
            "#,
        )
        .unwrap();
        let agent = |port| Listening {
            addr: SocketAddr::from(([0, 0, 0, 0], port)),
            v6_only: false,
        };
        let layout = Layout::keeping(
            &config,
            |_| false,
            &KnownIds::default(),
            &[agent(6444), agent(9345)],
        );
        let summary: Vec<(&str, bool, bool, Option<std::time::Duration>, String)> = layout
            .tables
            .iter()
            .map(|t| {
                (
                    t.service.as_str(),
                    t.flags & SERVICE_FLAG_HAND_BACK != 0,
                    t.flags & SERVICE_FLAG_HAND_BACK_AUTO != 0,
                    t.hand_back_after,
                    t.hand_back.to_string(),
                )
            })
            .collect();
        let ten = Some(crate::config::DEFAULT_DAEMON_GONE_AFTER);
        assert_eq!(
            summary,
            [
                (
                    "api",
                    true,
                    true,
                    ten,
                    "auto: hand-back (127.0.0.1:6444 has a listener)".into()
                ),
                (
                    "etcd",
                    false,
                    true,
                    None,
                    "auto: keep (nothing else listens on 127.0.0.1:2379)".into()
                ),
                ("supervisor", false, false, None, "keep (configured)".into()),
            ]
        );
    }

    #[test]
    fn layout_assigns_ids_per_family_in_order() {
        let layout = layout(TWO_FAMILIES);
        let summary: Vec<(u32, &str, u8, Vec<u32>, u32)> = layout
            .tables
            .iter()
            .map(|t| {
                (
                    t.table_id,
                    t.service.as_str(),
                    t.family,
                    t.backends.iter().map(|b| b.id).collect(),
                    // auto (the default) says so in every table's flags.
                    t.flags & !SERVICE_FLAG_HAND_BACK_AUTO,
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    0,
                    "api",
                    FAMILY_V4,
                    vec![0, 1],
                    SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY
                ),
                (
                    1,
                    "api",
                    FAMILY_V6,
                    vec![2],
                    SERVICE_FLAG_REJECT_WHEN_NONE_HEALTHY
                ),
                (2, "etcd", FAMILY_V4, vec![3], SERVICE_FLAG_ALL_NETNS),
            ]
        );
    }

    /// (what, healthy backend ids, table 0 healthy list, table 0 all list)
    type PlanCase<'a> = (&'a str, &'a [u32], &'a [u32], &'a [u32]);
    /// (what, members, capacity, expected list)
    type ExpansionCase<'a> = (&'a str, &'a [(u32, u32)], usize, &'a [u32]);

    #[test]
    fn plan_cases() {
        let layout = layout(TWO_FAMILIES);
        let cases: &[PlanCase] = &[
            (
                "all healthy, weight 2 doubles",
                &[0, 1, 2, 3],
                &[0, 0, 1],
                &[0, 0, 1],
            ),
            ("one down", &[1, 2, 3], &[1], &[0, 0, 1]),
            ("none healthy", &[], &[], &[0, 0, 1]),
        ];
        for (what, healthy, want_healthy, want_all) in cases {
            let tables = plan(&layout, |id| healthy.contains(&id));
            assert_eq!(tables.len(), 3, "{what}");
            assert_eq!(tables[0].healthy, *want_healthy, "{what}");
            assert_eq!(tables[0].all, *want_all, "{what}");
        }
    }

    /// (what, healthy backend ids, healthy list)
    type TierCase<'a> = (&'a str, &'a [u32], &'a [u32]);

    #[test]
    fn tiers_prefer_local_then_normal_then_standby() {
        let text = r#"
            [[service]]
            name = "api"
            policy = "prefer-local"
            vips = ["127.0.0.1:6444"]
            backends = ["10.0.0.1:1", "10.0.0.2:1,preferred", "10.0.0.3:1,standby", "192.168.1.5:1"]
        "#;
        let local: IpAddr = "192.168.1.5".parse().unwrap();
        let layout = Layout::from_config(&parse_toml(text).unwrap(), |ip| ip == local);
        let tiers: Vec<Tier> = layout.tables[0].backends.iter().map(|b| b.tier).collect();
        assert_eq!(
            tiers,
            [
                Tier::Normal,
                Tier::Preferred,
                Tier::Standby,
                Tier::Preferred
            ]
        );
        let cases: &[TierCase] = &[
            (
                "preferred and local share the top tier",
                &[0, 1, 2, 3],
                &[1, 3],
            ),
            ("one preferred down", &[0, 2, 3], &[3]),
            ("no preferred healthy: the normal one", &[0, 2], &[0]),
            ("only the standby left", &[2], &[2]),
            ("none healthy", &[], &[]),
        ];
        for (what, healthy, want) in cases {
            let tables = plan(&layout, |id| healthy.contains(&id));
            assert_eq!(tables[0].healthy, *want, "{what}");
            assert_eq!(tables[0].all, [0, 1, 2, 3], "{what}: fail-open uses all");
        }
    }

    #[test]
    fn random_policy_ignores_locality_but_keeps_standby_last() {
        let text = r#"
            [[service]]
            name = "api"
            vips = ["127.0.0.1:6444"]
            backends = ["10.0.0.1:1", "10.0.0.3:1,standby", "192.168.1.5:1"]
        "#;
        let layout = Layout::from_config(&parse_toml(text).unwrap(), |_| true);
        assert_eq!(plan(&layout, |_| true)[0].healthy, [0, 2]);
        assert_eq!(plan(&layout, |id| id == 1)[0].healthy, [1]);
    }

    #[test]
    fn plan_is_deterministic() {
        let layout = layout(TWO_FAMILIES);
        assert_eq!(
            plan(&layout, |id| id % 2 == 0),
            plan(&layout, |id| id % 2 == 0)
        );
    }

    #[test]
    fn expansion_cases() {
        let cases: &[ExpansionCase] = &[
            ("empty", &[], 8, &[]),
            ("equal weights cost one slot", &[(7, 5), (9, 5)], 8, &[7, 9]),
            ("ratio kept", &[(1, 2), (2, 4)], 8, &[1, 2, 2]),
            ("scaled to fit", &[(1, 1), (2, 9)], 5, &[1, 2, 2, 2, 2]),
            (
                "each at least once",
                &[(1, 1), (2, 1), (3, 98)],
                4,
                &[1, 2, 3, 3],
            ),
        ];
        for (what, members, capacity, want) in cases {
            assert_eq!(expand_weights(members, *capacity), *want, "{what}");
        }
    }

    #[test]
    fn expansion_keeps_proportions_and_capacity() {
        let members: Vec<(u32, u32)> = (0..300).map(|id| (id, 1 + id % 7)).collect();
        let list = expand_weights(&members, SLOTS_PER_LIST as usize);
        assert!(list.len() <= SLOTS_PER_LIST as usize);
        let mut counts: HashMap<u32, usize> = HashMap::new();
        for id in &list {
            *counts.entry(*id).or_default() += 1;
        }
        assert_eq!(counts.len(), 300, "every member keeps a slot");
        assert!(
            counts[&6] > counts[&0],
            "weight 7 gets more slots than weight 1"
        );
    }

    #[test]
    fn a_ramping_backend_holds_its_step_of_its_share() {
        let layout = layout(
            r#"
            [[service]]
            name = "api"
            vips = ["127.0.0.1:6444"]
            backends = ["127.0.0.2:1,weight=2", "127.0.0.3:1,weight=2", "127.0.0.4:1,weight=4"]
            "#,
        );
        let count = |list: &[u32], id: u32| list.iter().filter(|&&slot| slot == id).count();
        let full = plan(&layout, |_| true).remove(0);
        assert_eq!(full.healthy.len(), 4, "2:2:4 in 1:1:2 slots");
        // Backend 2 at step 1 of 10: 40 tenths against 20 and 20.
        let ramped = plan_ramped(&layout, |_| true, |id| (id == 2).then_some(1)).remove(0);
        assert_eq!(
            (
                count(&ramped.healthy, 0),
                count(&ramped.healthy, 1),
                count(&ramped.healthy, 2)
            ),
            (5, 5, 1)
        );
        assert_eq!(ramped.all, full.all, "fail-open keeps full weights");
        // Step 10 is the full weight.
        let done = plan_ramped(&layout, |_| true, |id| (id == 2).then_some(RAMP_STEPS)).remove(0);
        assert_eq!(done, full);
    }
}
