//! Microbenchmarks of the daemon's pure parts at 3, 100 and 10,000
//! backends: building the selection tables (layout, plan, weight expansion)
//! and the health bookkeeping of one probe round.
//!
//! Run with `cargo bench -p lb-userspace --bench planner`.

use std::{
    hint::black_box,
    net::{IpAddr, SocketAddr},
};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use socklb::{
    config::{Backend, Config, HealthSettings, parse_toml},
    health::{HealthTracker, ProbeFailure},
    planner::{self, Layout},
};

const SIZES: [usize; 3] = [3, 100, 10_000];

/// Slots in one list of a selection table (the kernel's SLOTS_PER_LIST).
const SLOTS_PER_LIST: usize = 1024;

/// One IPv4 service with `count` backends of weights 1, 2 and 3 in turn.
/// The service is parsed from TOML with one backend; the backends are then
/// set directly, since validation caps a family at 1024 backends and the
/// planner's cost beyond that is still worth knowing.
fn config_with(count: usize) -> Config {
    let mut config = parse_toml(
        r#"
        [[service]]
        name = "apiserver"
        vips = ["127.0.0.1:6444"]
        backends = ["10.0.0.1:6443"]
        "#,
    )
    .expect("a valid service");
    let service = &mut config.services[0];
    let template = service.backends[0].clone();
    service.backends = (0..count)
        .map(|index| Backend {
            addr: SocketAddr::from((
                [10, (index >> 16) as u8, (index >> 8) as u8, index as u8],
                6443,
            )),
            weight: 1 + (index % 3) as u32,
            ..template.clone()
        })
        .collect();
    config
}

/// The default policy (random) never asks; none of the backends is local.
fn no_local_address(_ip: IpAddr) -> bool {
    false
}

/// Nine backends in ten are healthy.
fn mostly_healthy(id: u32) -> bool {
    !id.is_multiple_of(10)
}

fn selection_table(c: &mut Criterion) {
    let mut group = c.benchmark_group("selection_table");
    for count in SIZES {
        let config = config_with(count);
        group.bench_with_input(
            BenchmarkId::new("layout_and_plan", count),
            &config,
            |b, config| {
                b.iter(|| {
                    let layout = Layout::from_config(black_box(config), no_local_address);
                    planner::plan(&layout, mostly_healthy)
                })
            },
        );
        let layout = Layout::from_config(&config, no_local_address);
        group.bench_with_input(BenchmarkId::new("plan", count), &layout, |b, layout| {
            b.iter(|| planner::plan(black_box(layout), mostly_healthy))
        });
        let members: Vec<(u32, u32)> = (0..count as u32).map(|id| (id, 1 + id % 3)).collect();
        group.bench_with_input(
            BenchmarkId::new("expand_weights", count),
            &members,
            |b, members| b.iter(|| planner::expand_weights(black_box(members), SLOTS_PER_LIST)),
        );
    }
    group.finish();
}

/// One probe round: an outcome recorded for every backend. Every tenth
/// backend keeps failing, so its tracker goes down once and then holds.
fn health_bookkeeping(c: &mut Criterion) {
    let mut group = c.benchmark_group("health_bookkeeping");
    let settings = HealthSettings::default();
    for count in SIZES {
        let mut trackers = vec![HealthTracker::unknown(&settings); count];
        let outcomes: Vec<Result<(), ProbeFailure>> = (0..count as u32)
            .map(|id| {
                if mostly_healthy(id) {
                    Ok(())
                } else {
                    Err(ProbeFailure::Refused)
                }
            })
            .collect();
        group.bench_function(BenchmarkId::new("record_round", count), |b| {
            b.iter(|| {
                let mut transitions = 0;
                for (tracker, outcome) in trackers.iter_mut().zip(&outcomes) {
                    if tracker.record(black_box(outcome), "connect ok").is_some() {
                        transitions += 1;
                    }
                }
                transitions
            })
        });
    }
    group.finish();
}

criterion_group!(benches, selection_table, health_bookkeeping);
criterion_main!(benches);
