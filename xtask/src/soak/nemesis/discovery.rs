//! Faults of discovery: the k3s state file rewritten, the apiserver
//! restarted, a watch answered 410 Gone, the EndpointSlice emptied.

use std::time::Duration;

use anyhow::Result;

use super::{Hands, Nemesis, expect, said};
use crate::soak::{
    catalogue::FaultKind,
    record::{Applied, Count, now_ms},
    world::World,
};

/// Time for a discovery change to be said.
pub(super) const DISCOVERY_SAID: Duration = Duration::from_secs(5);
/// The watch's backoff after the API returns may wait this long.
const BACKOFF: Duration = Duration::from_secs(30);

const NO_REMOVAL: &[&str] = &["discovery: api: -"];
const FAILED: &[&str] = &["discovery: api: endpointslices failed"];
const AGAIN: &[&str] = &["discovery: api: ", "lists 5 backends again"];
const FROM_STATE_FILE: &[&str] = &["discovery: api: ", "(k3s-state)"];

impl Nemesis {
    pub(super) fn start_discovery(
        &mut self,
        hands: &mut Hands,
        applied: &mut Applied,
    ) -> Result<Option<Duration>> {
        let world = &mut *hands.world;
        match applied.planned.kind {
            FaultKind::StateFileRewrite => {
                let mut servers = world.api_addrs(&self.moved);
                servers.rotate_left(1 + applied.planned.variant as usize % 3);
                servers.pop();
                world.write_state_file_with(&servers)?;
                let what = "no change from the state file while EndpointSlices rule";
                expect(
                    applied,
                    what,
                    said(FROM_STATE_FILE),
                    Count::AtMost(0),
                    DISCOVERY_SAID,
                );
            }
            FaultKind::ApiserverRestart => {
                world.api.stop();
                let within = Duration::from_millis(applied.planned.duration_ms) + DISCOVERY_SAID;
                expect(
                    applied,
                    "no backend removed while the API is away",
                    said(NO_REMOVAL),
                    Count::AtMost(0),
                    within,
                );
                expect(
                    applied,
                    "the failing watch said once",
                    said(FAILED),
                    Count::AtMost(1),
                    within,
                );
            }
            FaultKind::ApiGone => self.gone(hands, applied),
            FaultKind::SliceEmptied => {
                world.put_slice(&self.moved, false);
                let words = said(&["discovery: api: ", "lists no backend"]);
                expect(
                    applied,
                    "the empty slice refused, the set kept",
                    words,
                    Count::Exactly(1),
                    DISCOVERY_SAID,
                );
            }
            _ => {}
        }
        Ok(None)
    }

    /// socklb stopped for a moment misses a change (a label) and the
    /// compaction after it: its watch, resumed from before the change,
    /// gets 410 Gone and lists again. A 410 is routine: said at most once,
    /// and its end with it.
    fn gone(&mut self, hands: &mut Hands, applied: &mut Applied) {
        let world = &mut *hands.world;
        self.gone_before = world.api.stats().gone_sent;
        let alive = hands.life.is_alive();
        if alive {
            hands.life.stop(world.daemon());
        }
        world.api.close_watches();
        let mut spec = world.slice_spec(&self.moved, true);
        spec.labels.insert("soak/turn".into(), now_ms().to_string());
        world.api.put_slice("default", "kubernetes", &spec);
        world.api.compact();
        if alive {
            hands.life.cont(world.daemon());
        }
        expect(
            applied,
            "no backend removed by the relist",
            said(NO_REMOVAL),
            Count::AtMost(0),
            DISCOVERY_SAID,
        );
        expect(
            applied,
            "the 410 said once",
            said(FAILED),
            Count::AtMost(1),
            DISCOVERY_SAID,
        );
        expect(
            applied,
            "the relist said once",
            said(AGAIN),
            Count::AtMost(1),
            DISCOVERY_SAID,
        );
    }

    pub(super) fn end_discovery(&mut self, world: &mut World, applied: &mut Applied) -> Result<()> {
        match applied.planned.kind {
            FaultKind::StateFileRewrite => {
                world.write_state_file(&self.moved)?;
                let what = "no change from the state file while EndpointSlices rule";
                expect(
                    applied,
                    what,
                    said(FROM_STATE_FILE),
                    Count::AtMost(0),
                    DISCOVERY_SAID,
                );
            }
            FaultKind::ApiserverRestart => {
                world.api.resume();
                expect(
                    applied,
                    "the watch following again, said once",
                    said(AGAIN),
                    Count::AtMost(1),
                    BACKOFF,
                );
            }
            FaultKind::ApiGone => {
                let gone = world.api.stats().gone_sent.saturating_sub(self.gone_before);
                applied.notes.push(format!("{gone} × 410 Gone sent"));
            }
            FaultKind::SliceEmptied => {
                world.put_slice(&self.moved, true);
                expect(
                    applied,
                    "the slice followed again",
                    said(AGAIN),
                    Count::Exactly(1),
                    DISCOVERY_SAID,
                );
            }
            _ => {}
        }
        Ok(())
    }
}
