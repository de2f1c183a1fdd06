//! Faults of socklb itself: killed, stopped, upgraded in place, sent
//! SIGHUP (with a valid configuration and with an invalid one), and its
//! watched configuration edited.

use std::time::Duration;

use anyhow::Result;

use super::{Hands, Nemesis, expect, said};
use crate::soak::{
    catalogue::FaultKind,
    config::{self, Edits},
    record::{Applied, Count, now_ms},
};

/// Time for a reload to be said (the watch's settle time, then the apply).
const RELOAD_SAID: Duration = Duration::from_secs(3);
/// Time for a new daemon to be said up.
const START_SAID: Duration = Duration::from_secs(30);
/// When the nemesis looks at what sockmap acceleration does.
const ACCELERATION_LOOK: Duration = Duration::from_secs(5);
/// SIGHUP follows the invalid file this long after it is written.
const SIGHUP_AFTER: Duration = Duration::from_secs(1);

const ADOPTED: &str = "adopted the pinned data plane";

impl Nemesis {
    pub(super) fn start_daemon(
        &mut self,
        hands: &mut Hands,
        applied: &mut Applied,
    ) -> Result<Option<Duration>> {
        let world = &mut *hands.world;
        match applied.planned.kind {
            FaultKind::DaemonKill => hands.life.kill(world.daemon_mut()),
            FaultKind::DaemonStop => hands.life.stop(world.daemon()),
            FaultKind::DaemonUpgrade => {
                let leaving = said(&["exiting; the data plane stays in place"]);
                expect(
                    applied,
                    "the old daemon leaving the data plane in place",
                    leaving,
                    Count::Exactly(1),
                    START_SAID,
                );
                expect(
                    applied,
                    "the new daemon adopting it",
                    said(&[ADOPTED]),
                    Count::Exactly(1),
                    START_SAID,
                );
                if let Some(problem) = hands.life.upgrade(world.daemon_mut()) {
                    applied.notes.push(problem);
                }
            }
            FaultKind::SighupValid => sighup(hands, applied, " is unchanged"),
            FaultKind::SighupInvalid => {
                config::write(&world.config_path, &config::invalid(&world.inputs), false)?;
                let words = said(&["config file changed: ", " is not valid"]);
                expect(
                    applied,
                    "the invalid file refused (watch)",
                    words,
                    Count::Exactly(1),
                    RELOAD_SAID,
                );
                return Ok(Some(SIGHUP_AFTER));
            }
            FaultKind::ConfigEdit => {
                world.edits = world.edits.edited(applied.planned.variant);
                applied
                    .notes
                    .push(Edits::describe(applied.planned.variant).to_string());
                rewrite_config(hands, applied, "the edit applied")?;
                if hands.world.edits.accelerate {
                    // A look at what acceleration does, a little later.
                    return Ok(Some(ACCELERATION_LOOK));
                }
            }
            _ => {}
        }
        Ok(None)
    }

    pub(super) fn step_daemon(
        &mut self,
        hands: &mut Hands,
        applied: &mut Applied,
    ) -> Result<Option<Duration>> {
        match applied.planned.kind {
            FaultKind::SighupInvalid => sighup(hands, applied, " is not valid"),
            FaultKind::ConfigEdit => {
                let local = hands.world.local_plain.to_string();
                let accelerated = hands
                    .world
                    .daemon()
                    .status()
                    .and_then(|status| socklb_tests::backend_field(&status, &local, "accelerated"))
                    .map_or("no figure".to_string(), |count| count.to_string());
                applied.notes.push(format!(
                    "{} s in, connections to the local server accelerated: {accelerated}",
                    ACCELERATION_LOOK.as_secs()
                ));
            }
            _ => {}
        }
        Ok(None)
    }

    pub(super) fn end_daemon(&mut self, hands: &mut Hands, applied: &mut Applied) -> Result<()> {
        let world = &mut *hands.world;
        match applied.planned.kind {
            FaultKind::DaemonKill => {
                expect(
                    applied,
                    "the new daemon adopting the data plane",
                    said(&[ADOPTED]),
                    Count::Exactly(1),
                    START_SAID,
                );
                if !hands.life.restart(world.daemon_mut()) {
                    applied
                        .notes
                        .push("the restarted socklb did not run within 30 s".into());
                }
            }
            FaultKind::DaemonStop => hands.life.cont(world.daemon()),
            FaultKind::SighupInvalid => {
                let text = config::render(&world.inputs, world.edits);
                config::write(&world.config_path, &text, true)?;
                let words = said(&["config file changed: ", " is unchanged"]);
                expect(
                    applied,
                    "the valid file back, unchanged",
                    words,
                    Count::Exactly(1),
                    RELOAD_SAID,
                );
            }
            FaultKind::ConfigEdit => {
                world.edits = Edits::default();
                rewrite_config(hands, applied, "the edit reverted")?;
            }
            _ => {}
        }
        Ok(())
    }
}

/// Writes the configuration of the current edits; the watch must apply it
/// once.
fn rewrite_config(hands: &mut Hands, applied: &mut Applied, what: &str) -> Result<()> {
    let world = &*hands.world;
    config::write(
        &world.config_path,
        &config::render(&world.inputs, world.edits),
        true,
    )?;
    let words = said(&["config file changed: ", " applied (generation"]);
    expect(applied, what, words, Count::Exactly(1), RELOAD_SAID);
    Ok(())
}

/// SIGHUP to a running socklb: one reload, said once with `result`.
fn sighup(hands: &mut Hands, applied: &mut Applied, result: &str) {
    if !hands.life.is_alive() {
        applied.notes.push("skipped: socklb was not running".into());
        return;
    }
    applied.action_ms = now_ms();
    hands.world.daemon().signal(libc::SIGHUP);
    let words = said(&["SIGHUP: ", result]);
    expect(
        applied,
        &format!("SIGHUP:{result}"),
        words,
        Count::Exactly(1),
        RELOAD_SAID,
    );
}
