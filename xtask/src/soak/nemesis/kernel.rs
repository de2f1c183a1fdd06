//! Faults of socklb's kernel state, as another privileged agent would
//! make them: a link detached, the SLOTS of a table rewritten, a pin
//! removed. Each is over by its end (longer than the repair bound), and
//! the end checks that socklb repaired it.

use std::{net::SocketAddr, os::fd::AsFd, path::Path, process::Command, time::Duration};

use anyhow::{Context, Result, bail};
use lb_common::names;
use socklb::dataplane::{BpfMaps, MapStore, PinPaths, sys};

use super::{Nemesis, expect, said};
use crate::soak::{
    catalogue::FaultKind,
    record::{Applied, Count, now_ms},
    world::World,
};

const MAP_PINNED: &str = "was removed or replaced by someone else; pinned the map again";

impl Nemesis {
    pub(super) fn start_kernel(
        &mut self,
        world: &mut World,
        applied: &mut Applied,
    ) -> Result<Option<Duration>> {
        let pin_path = world.daemon().pin_path.clone();
        match applied.planned.kind {
            FaultKind::LinkDetach => {
                let program =
                    names::PROGRAMS[applied.planned.variant as usize % names::PROGRAMS.len()];
                detach(&pin_path, program)?;
                applied.notes.push(format!("detached {program}"));
                let words = vec![format!("the link of {program} was detached")];
                expect(
                    applied,
                    &format!("{program} re-attached"),
                    words,
                    Count::Exactly(1),
                    self.repair(),
                );
            }
            FaultKind::SlotsRewrite => {
                let target = world.addrs[applied.planned.server.unwrap_or(0)].plain();
                rewrite_slots(&pin_path, world.inputs.plain_vip, target)?;
                // socklb's own next table (a slow start's step) may replace
                // the rewritten bank before its verification pass sees it:
                // then there is nothing to repair and nothing to say. The
                // end checks that the rewrite is not in force.
                let words = said(&["SLOTS of table", "rewritten by someone else; restoring it"]);
                expect(
                    applied,
                    "SLOTS restored",
                    words,
                    Count::AtMost(1),
                    self.repair(),
                );
            }
            FaultKind::PinRemove => self.remove_pin(&pin_path, applied)?,
            _ => {}
        }
        Ok(None)
    }

    fn remove_pin(&self, pin_path: &Path, applied: &mut Applied) -> Result<()> {
        let pins = PinPaths::new(pin_path);
        let (removed, lines) = match applied.planned.variant % 3 {
            0 => {
                let path = pins.map(names::BACKENDS);
                let line = format!("{} {MAP_PINNED}", path.display());
                (
                    path,
                    vec![("the map pinned again", line, Count::Exactly(1))],
                )
            }
            1 => {
                let line = format!(
                    "the pin of {}'s link was removed; pinned it again",
                    names::SOCKOPS
                );
                (
                    pins.link(names::SOCKOPS),
                    vec![("the link pinned again", line, Count::Exactly(1))],
                )
            }
            _ => (
                pins.dir.clone(),
                vec![
                    (
                        "a map pinned again",
                        MAP_PINNED.to_string(),
                        Count::AtLeast(1),
                    ),
                    (
                        "a link pinned again",
                        "'s link was removed; pinned it again".to_string(),
                        Count::AtLeast(1),
                    ),
                ],
            ),
        };
        let gone = if removed.is_dir() {
            std::fs::remove_dir_all(&removed)
        } else {
            std::fs::remove_file(&removed)
        };
        gone.with_context(|| format!("removing {}", removed.display()))?;
        applied.notes.push(format!("removed {}", removed.display()));
        for (what, line, count) in lines {
            expect(applied, what, vec![line], count, self.repair());
        }
        Ok(())
    }

    pub(super) fn end_kernel(&mut self, world: &mut World, applied: &mut Applied) -> Result<()> {
        let pin_path = &world.daemon().pin_path;
        let pins = PinPaths::new(pin_path);
        let unrepaired = match applied.planned.kind {
            FaultKind::SlotsRewrite => {
                let target = world.addrs[applied.planned.server.unwrap_or(0)].plain();
                slots_hijacked(pin_path, world.inputs.plain_vip, target)?.then(|| {
                    "every slot of the plain service still sends connects to one server".to_string()
                })
            }
            FaultKind::LinkDetach => names::PROGRAMS
                .iter()
                .find(|program| !attached(&pins, program))
                .map(|program| format!("the link of {program} is not attached")),
            _ => pins
                .maps()
                .chain(pins.links())
                .find(|(_, path)| !path.exists())
                .map(|(name, _)| format!("{name} is not pinned")),
        };
        if let Some(what) = unrepaired {
            let since = now_ms().saturating_sub(applied.start_ms);
            applied
                .breaches
                .push(format!("{what} {since} ms after {}", applied.name()));
        }
        Ok(())
    }
}

/// Whether a program's pinned link is attached to a cgroup.
fn attached(pins: &PinPaths, program: &str) -> bool {
    sys::open_pinned(&pins.link(program))
        .and_then(|fd| sys::link_info(fd.as_fd()))
        .is_ok_and(|info| info.cgroup_id != 0)
}

/// `bpftool link detach` of one of socklb's pinned links.
fn detach(pin_path: &Path, program: &str) -> Result<()> {
    let fd = sys::open_pinned(&PinPaths::new(pin_path).link(program))
        .with_context(|| format!("opening the pinned link of {program}"))?;
    let info = sys::link_info(fd.as_fd()).context("link info")?;
    let output = Command::new("bpftool")
        .args(["link", "detach", "id", &info.id.to_string()])
        .output()
        .context("running bpftool (Debian package bpftool)")?;
    if !output.status.success() {
        bail!(
            "bpftool link detach {}: {}",
            info.id,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

fn open_maps(pin_path: &Path) -> Result<BpfMaps> {
    BpfMaps::open_pinned(&PinPaths::new(pin_path)).map_err(|error| anyhow::anyhow!("{error}"))
}

/// The active healthy slots of a VIP's table: (bank, slots).
fn active_slots(maps: &BpfMaps, vip: SocketAddr) -> Result<(u32, Vec<lb_common::BackendSlot>)> {
    let services = maps
        .services()
        .map_err(|error| anyhow::anyhow!("{error}"))?;
    let vip = socklb::convert::endpoint(&vip);
    let (_, entry) = services
        .into_iter()
        .find(|(key, _)| *key == vip)
        .context("the VIP's table")?;
    let slots = maps
        .slots(entry.bank_base, entry.healthy_slots)
        .map_err(|error| anyhow::anyhow!("{error}"))?;
    Ok((entry.bank_base, slots))
}

/// Whether every active slot of the VIP sends connects to `target`.
fn slots_hijacked(pin_path: &Path, vip: SocketAddr, target: SocketAddr) -> Result<bool> {
    let target = socklb::convert::endpoint(&target);
    let (_, slots) = active_slots(&open_maps(pin_path)?, vip)?;
    Ok(!slots.is_empty() && slots.iter().all(|slot| slot.target == target))
}

/// Points every healthy slot of a VIP's active table at `target`, as
/// another agent writing socklb's maps would. A write that lands in a
/// bank socklb has just retired (it swaps banks on every table change) is
/// made again, a few times at most.
fn rewrite_slots(pin_path: &Path, vip: SocketAddr, target: SocketAddr) -> Result<()> {
    let mut maps = open_maps(pin_path)?;
    let target = socklb::convert::endpoint(&target);
    for _ in 0..5 {
        let (bank, slots) = active_slots(&maps, vip)?;
        let rewritten: Vec<_> = slots
            .into_iter()
            .map(|slot| lb_common::BackendSlot { target, ..slot })
            .collect();
        maps.put_slots(bank, &rewritten)
            .map_err(|error| anyhow::anyhow!("{error}"))?;
        if active_slots(&maps, vip)?.0 == bank {
            return Ok(());
        }
    }
    bail!("socklb swapped the table's banks under each of five writes")
}
