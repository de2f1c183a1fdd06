//! One verification pass over everything socklb owns: the pins, the links
//! and the cgroup they attach to, and every map's contents. Whatever
//! differs from what socklb wrote is repaired at once, with one WARN line
//! that says what changed and what was done.

use std::collections::HashSet;

use tracing::warn;

use lb_common::names;

use super::state::Owner;
use crate::{
    dataplane::{LinkProblem, PinPaths, Running, install},
    errors,
};

/// Remembers the problems that cannot be repaired yet (a cgroup that is
/// gone), so that each is said once, and again once it is over.
#[derive(Debug, Default)]
pub struct Verifier {
    unrepairable: HashSet<String>,
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
        for name in install::missing_map_pins(paths, &running.maps, &running.pinned) {
            let path = paths.map(name);
            match install::repin_map(paths, &running.maps, name) {
                Ok(()) => {
                    warn!(
                        "{} was removed or replaced by someone else; pinned the map again",
                        path.display()
                    );
                    done.push(lb_common::repair::MAP_PIN);
                }
                Err(error) => self.say_once(format!(
                    "{} was removed by someone else and pinning it again failed: {}",
                    path.display(),
                    errors::chain(&error)
                )),
            }
        }
    }

    fn links(&mut self, running: &mut Running, owner: &mut Owner, done: &mut Vec<usize>) {
        let problems = running.attachment.check();
        let gone = problems.contains(&LinkProblem::CgroupGone);
        let gone_text = format!(
            "the cgroup {} socklb attaches to was removed; nothing is redirected until a cgroup is created there again",
            running.attachment.cgroup().path.display()
        );
        if gone {
            self.say_once(gone_text);
            return;
        }
        if self.unrepairable.remove(&gone_text) {
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
            return;
        }
        let sockhash = paths.map(names::SOCKHASH);
        match install::reattach_sk_msg(running, paths) {
            Ok(()) => {
                warn!(
                    "data plane: the sk_msg program was detached from {} by someone else; attached it again (connections paired meanwhile stay on the normal path)",
                    sockhash.display()
                );
                done.push(lb_common::repair::LINK);
            }
            Err(error) => self.say_once(format!(
                "data plane: the sk_msg program was detached from {} by someone else and attaching it again failed: {}",
                sockhash.display(),
                errors::chain(&error)
            )),
        }
    }

    fn maps(&mut self, running: &mut Running, owner: &mut Owner, done: &mut Vec<usize>) {
        let drifts = match owner.verify(&running.maps) {
            Ok(drifts) => drifts,
            Err(error) => {
                self.say_once(format!(
                    "reading the maps to verify them failed: {}",
                    errors::chain(&error)
                ));
                return;
            }
        };
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

    fn say_once(&mut self, text: String) {
        if self.unrepairable.insert(text.clone()) {
            warn!("{text}");
        }
    }
}
