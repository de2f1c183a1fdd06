//! One verification pass over everything socklb owns: the pins, the links
//! and the cgroup they attach to, and every map's contents. Whatever
//! differs from what socklb wrote is repaired at once, with one WARN line
//! that says what changed and what was done.

use std::collections::HashMap;

use tracing::warn;

use lb_common::names;

use super::state::Owner;
use crate::{
    dataplane::{LinkProblem, PinPaths, Running, install},
    errors,
};

/// A problem the pass cannot repair yet. One entry per kind (a map pin
/// counts by its name), so what the verifier remembers is bounded by what
/// socklb owns, whatever the errors say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Unrepairable {
    MapPin(&'static str),
    /// The daemon could not open its pins (out of descriptors or memory).
    PinsUnchecked,
    CgroupGone,
    SkMsg,
    ReadMaps,
}

/// Remembers the problems that cannot be repaired yet (a cgroup that is
/// gone), so that each is said once while it lasts, and forgotten once its
/// check passes.
#[derive(Debug, Default)]
pub struct Verifier {
    unrepairable: HashMap<Unrepairable, String>,
}

impl Verifier {
    /// Verifies and repairs; returns the `repair::*` kind of each repair.
    pub fn pass(
        &mut self,
        paths: &PinPaths,
        running: &mut Running,
        owner: &mut Owner,
    ) -> Vec<usize> {
        let mut done = Vec::new();
        self.map_pins(paths, running, &mut done);
        self.links(running, owner, &mut done);
        self.sk_msg(paths, running, &mut done);
        self.maps(running, owner, &mut done);
        if owner.is_dirty() {
            owner.write(&mut running.maps);
        }
        done
    }

    fn map_pins(&mut self, paths: &PinPaths, running: &mut Running, done: &mut Vec<usize>) {
        let install::MapPinCheck { missing, unchecked } =
            install::check_map_pins(paths, &running.maps, &running.pinned);
        self.unrepairable.retain(|kind, _| match kind {
            Unrepairable::MapPin(name) => missing.contains(name),
            _ => true,
        });
        match unchecked.first() {
            Some((name, error)) => self.say_once(
                Unrepairable::PinsUnchecked,
                format!(
                    "could not check socklb's pins ({}: {error}); left them as they are until they can be read",
                    paths.map(name).display()
                ),
            ),
            None => {
                if self.forget(Unrepairable::PinsUnchecked) {
                    warn!("socklb's pins can be checked again");
                }
            }
        }
        for name in missing {
            let path = paths.map(name);
            match install::repin_map(paths, &running.maps, name) {
                Ok(()) => {
                    warn!(
                        "{} was removed or replaced by someone else; pinned the map again",
                        path.display()
                    );
                    done.push(lb_common::repair::MAP_PIN);
                }
                Err(error) => self.say_once(
                    Unrepairable::MapPin(name),
                    format!(
                        "{} was removed by someone else and pinning it again failed: {}",
                        path.display(),
                        errors::chain(&error)
                    ),
                ),
            }
        }
    }

    fn links(&mut self, running: &mut Running, owner: &mut Owner, done: &mut Vec<usize>) {
        let problems = running.attachment.check();
        if problems.contains(&LinkProblem::CgroupGone) {
            self.say_once(
                Unrepairable::CgroupGone,
                format!(
                    "the cgroup {} socklb attaches to was removed; nothing is redirected until a cgroup is created there again",
                    running.attachment.cgroup().path.display()
                ),
            );
            return;
        }
        if self.forget(Unrepairable::CgroupGone) {
            warn!(
                "a cgroup exists again at {}",
                running.attachment.cgroup().path.display()
            );
        }
        if problems.is_empty() {
            return;
        }
        match running.attachment.repair(&mut running.ebpf, &problems) {
            Ok(repairs) => {
                for (kind, line) in repairs {
                    warn!("data plane: {line}");
                    done.push(kind);
                }
            }
            Err(error) => warn!(
                "data plane: {} could not be repaired: {}",
                problems
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
                errors::chain(&error)
            ),
        }
        let cgroup_id = running.attachment.cgroup().id;
        if owner.settings().attached_cgroup_id != cgroup_id {
            owner.set_attached_cgroup(cgroup_id);
            owner.write(&mut running.maps);
        }
    }

    /// The sk_msg program on the sockhash: without it, connections that
    /// sock_ops pairs from then on take the normal path, and nothing else
    /// would say so.
    fn sk_msg(&mut self, paths: &PinPaths, running: &mut Running, done: &mut Vec<usize>) {
        if install::sk_msg_attached(running) != Some(false) {
            self.forget(Unrepairable::SkMsg);
            return;
        }
        let sockhash = paths.map(names::SOCKHASH);
        match install::reattach_sk_msg(running, paths) {
            Ok(()) => {
                self.forget(Unrepairable::SkMsg);
                warn!(
                    "data plane: the sk_msg program was detached from {} by someone else; attached it again (connections paired meanwhile stay on the normal path)",
                    sockhash.display()
                );
                done.push(lb_common::repair::LINK);
            }
            Err(error) => self.say_once(
                Unrepairable::SkMsg,
                format!(
                    "data plane: the sk_msg program was detached from {} by someone else and attaching it again failed: {}",
                    sockhash.display(),
                    errors::chain(&error)
                ),
            ),
        }
    }

    fn maps(&mut self, running: &mut Running, owner: &mut Owner, done: &mut Vec<usize>) {
        let drifts = match owner.verify(&running.maps) {
            Ok(drifts) => drifts,
            Err(error) => {
                self.say_once(
                    Unrepairable::ReadMaps,
                    format!(
                        "reading the maps to verify them failed: {}",
                        errors::chain(&error)
                    ),
                );
                return;
            }
        };
        self.forget(Unrepairable::ReadMaps);
        if drifts.is_empty() {
            return;
        }
        for drift in &drifts {
            warn!("{drift} by someone else; restoring it");
            done.push(drift.kind());
        }
        if let Err(error) = owner.repair(&mut running.maps, &drifts) {
            warn!(
                "restoring the maps failed, will retry: {}",
                errors::chain(&error)
            );
        }
    }

    /// Says `text` unless a problem of this kind is already said and not
    /// over; a changed text for the same kind is not said again.
    fn say_once(&mut self, kind: Unrepairable, text: String) {
        if let std::collections::hash_map::Entry::Vacant(entry) = self.unrepairable.entry(kind) {
            warn!("{text}");
            entry.insert(text);
        }
    }

    /// Forgets a problem whose check passed; returns whether it was said.
    fn forget(&mut self, kind: Unrepairable) -> bool {
        self.unrepairable.remove(&kind).is_some()
    }
}
