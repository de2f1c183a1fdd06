//! Faults of one server: killed, restarted, hung, blackholed, slow,
//! flapping, or moved to another address through discovery.

use std::{net::SocketAddr, time::Duration};

use anyhow::Result;

use super::{DISCOVERY_SAID, Nemesis, expect, said};
use crate::soak::{
    catalogue::FaultKind,
    record::{Applied, Count},
    world::World,
};

/// Down and up, each this long, while a server flaps.
const FLAP: Duration = Duration::from_millis(450);

impl Nemesis {
    /// The backends of a server: its api address (where discovery has it)
    /// and its plain one.
    fn server_addrs(&self, world: &World, server: usize) -> Vec<SocketAddr> {
        let addrs = &world.addrs[server];
        vec![addrs.tls(self.moved.contains(&server)), addrs.plain()]
    }

    /// One transition line per backend of the fault.
    fn expect_transitions(&self, applied: &mut Applied, to: &str, count: Count, within: Duration) {
        for addr in applied.fault_addrs.clone() {
            let words = vec![format!("{addr} {to}:")];
            expect(applied, &format!("{addr} {to}"), words, count, within);
        }
    }

    /// Kills a server and starts it again, answering normally.
    fn restart_server(world: &mut World, server: usize) -> Result<()> {
        world.servers[server].kill();
        world.servers[server] = world.spawn_server(server)?;
        world.wait_server(server)
    }

    pub(super) fn start_server(
        &mut self,
        world: &mut World,
        applied: &mut Applied,
    ) -> Result<Option<Duration>> {
        let server = applied.planned.server.unwrap_or(0);
        applied.fault_addrs = self.server_addrs(world, server);
        match applied.planned.kind {
            FaultKind::ServerKill => world.servers[server].kill(),
            FaultKind::ServerHang => world.servers[server].signal(libc::SIGUSR1),
            FaultKind::ServerBlackhole => world.blackhole(server, true)?,
            FaultKind::ServerRestart => {
                Self::restart_server(world, server)?;
                // A restart may be over before any probe sees it.
                let both = self.detect() + self.rise();
                self.expect_transitions(applied, "unhealthy", Count::AtMost(1), both);
                self.expect_transitions(applied, "healthy", Count::AtMost(1), both);
                return Ok(None);
            }
            FaultKind::ServerSlow => {
                world.servers[server].signal(libc::SIGUSR2);
                let within = Duration::from_millis(applied.planned.duration_ms);
                self.expect_transitions(applied, "unhealthy", Count::Observe, within);
                return Ok(None);
            }
            FaultKind::ServerFlap => {
                world.servers[server].kill();
                self.flapping_down.push(server);
                return Ok(Some(FLAP));
            }
            FaultKind::ServerReaddress => {
                return self.move_server(world, applied, true).map(|()| None);
            }
            _ => return Ok(None),
        }
        self.expect_transitions(applied, "unhealthy", Count::Exactly(1), self.detect());
        Ok(None)
    }

    /// Moves a server to its second address (`away`) or back, through the
    /// EndpointSlice and the state file; socklb must say the change once.
    fn move_server(&mut self, world: &mut World, applied: &mut Applied, away: bool) -> Result<()> {
        let server = applied.planned.server.unwrap_or(0);
        let (base, alt) = (
            world.addrs[server].tls(false),
            world.addrs[server].tls(true),
        );
        let (old, new) = if away { (base, alt) } else { (alt, base) };
        if away {
            applied.fault_addrs = vec![base];
            world.alt_address(server, true)?;
            self.moved.push(server);
        } else {
            applied.stale_after_end = vec![alt];
            self.moved.retain(|moved| *moved != server);
        }
        world.put_slice(&self.moved, true);
        world.write_state_file(&self.moved)?;
        let new_word = format!("+{new}");
        let old_word = format!("-{old}");
        let words = said(&["discovery: api: ", &new_word, &old_word, "(endpointslices)"]);
        expect(
            applied,
            &format!("{new_word}, {old_word}"),
            words,
            Count::Exactly(1),
            DISCOVERY_SAID,
        );
        Ok(())
    }

    pub(super) fn step_server(
        &mut self,
        world: &mut World,
        applied: &mut Applied,
    ) -> Result<Option<Duration>> {
        if applied.planned.kind != FaultKind::ServerFlap {
            return Ok(None);
        }
        let server = applied.planned.server.unwrap_or(0);
        if let Some(index) = self.flapping_down.iter().position(|down| *down == server) {
            self.flapping_down.remove(index);
            world.servers[server] = world.spawn_server(server)?;
        } else {
            world.servers[server].kill();
            self.flapping_down.push(server);
        }
        Ok(Some(FLAP))
    }

    pub(super) fn end_server(
        &mut self,
        world: &mut World,
        applied: &mut Applied,
    ) -> Result<Option<Duration>> {
        let server = applied.planned.server.unwrap_or(0);
        match applied.planned.kind {
            FaultKind::ServerKill | FaultKind::ServerHang => Self::restart_server(world, server)?,
            FaultKind::ServerBlackhole => world.blackhole(server, false)?,
            FaultKind::ServerSlow => {
                world.servers[server].signal(libc::SIGUSR2);
                return Ok(None);
            }
            FaultKind::ServerFlap => {
                if let Some(index) = self.flapping_down.iter().position(|down| *down == server) {
                    self.flapping_down.remove(index);
                    world.servers[server] = world.spawn_server(server)?;
                }
                world.wait_server(server)?;
                return Ok(None);
            }
            FaultKind::ServerReaddress => {
                self.move_server(world, applied, false)?;
                // The second address goes once socklb has seen the change
                // (and closed the connections it had sent there).
                return Ok(Some(Duration::from_millis(self.bounds.detect_ms)));
            }
            _ => return Ok(None),
        }
        self.expect_transitions(applied, "healthy", Count::Exactly(1), self.rise());
        Ok(None)
    }

    pub(super) fn finish_server(&mut self, world: &mut World, applied: &mut Applied) -> Result<()> {
        if applied.planned.kind == FaultKind::ServerReaddress {
            world.alt_address(applied.planned.server.unwrap_or(0), false)?;
        }
        Ok(())
    }
}
