//! Faults of the node: socklb's cgroup starved of CPU, and put under
//! memory pressure (v1 controllers: see `world::NodeCgroups`).

use std::time::Duration;

use anyhow::Result;

use super::Nemesis;
use crate::soak::{catalogue::FaultKind, record::Applied, world::World};

/// socklb may use this share of one CPU while starved.
pub const STARVED_PERCENT: u32 = 10;
/// The memory limit's headroom above the usage when pressure starts.
pub const MEMORY_HEADROOM: u64 = 16 << 20;

impl Nemesis {
    pub(super) fn start_node(
        &mut self,
        world: &mut World,
        applied: &mut Applied,
    ) -> Result<Option<Duration>> {
        match applied.planned.kind {
            FaultKind::CpuStarve => world.node.starve(STARVED_PERCENT)?,
            FaultKind::MemoryPressure => {
                self.oom_before = world.node.oom_kills();
                self.failures_before = world.node.memory_failures();
                let usage = world.node.press(MEMORY_HEADROOM)?;
                applied.notes.push(format!(
                    "limit {} MiB (usage {:.1} MiB + {})",
                    (usage + MEMORY_HEADROOM) >> 20,
                    usage as f64 / f64::from(1 << 20),
                    MEMORY_HEADROOM >> 20
                ));
            }
            _ => {}
        }
        Ok(None)
    }

    pub(super) fn end_node(&mut self, world: &mut World, applied: &mut Applied) -> Result<()> {
        match applied.planned.kind {
            FaultKind::CpuStarve => world.node.unstarve()?,
            FaultKind::MemoryPressure => {
                world.node.relieve()?;
                let hits = world
                    .node
                    .memory_failures()
                    .saturating_sub(self.failures_before);
                applied
                    .notes
                    .push(format!("{hits} allocations met the limit"));
                let killed = world.node.oom_kills().saturating_sub(self.oom_before);
                if killed > 0 {
                    applied
                        .notes
                        .push(format!("the memory limit killed {killed} process(es)"));
                }
            }
            _ => {}
        }
        Ok(())
    }
}
