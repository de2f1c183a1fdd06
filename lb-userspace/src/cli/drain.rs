use std::net::SocketAddr;

use anyhow::{Context, bail};
use socklb::{
    config::{ConfigError, FieldError},
    convert::{endpoint, socket_addr},
    daemon::control::{self, Request},
    dataplane::{
        KernelError, MapStore, PinPaths, install,
        lock::{self, RunPaths},
        pins,
    },
    privileges,
};

/// Stop sending new connections to a backend and leave its existing ones
/// alone (or, with --undo, take it back). A running daemon applies it at
/// once; without one it is recorded and applied when a daemon starts.
/// Undoing a drain that is not in force changes nothing and succeeds.
///
/// Example: socklb drain 10.0.0.12:6443
#[derive(Debug, clap::Args)]
pub struct DrainArgs {
    /// The backend, as ADDR:PORT; every service that has it is affected.
    backend: String,
    /// Take the backend back instead.
    #[arg(long)]
    undo: bool,
    #[command(flatten)]
    pin: super::PinPathArg,
}

fn bad_backend(problem: String) -> ConfigError {
    ConfigError::Invalid(vec![FieldError {
        field: "BACKEND".into(),
        problem,
    }])
}

pub fn drain(args: DrainArgs) -> super::Outcome {
    let addr: SocketAddr = args.backend.parse().map_err(|_| {
        bad_backend(format!(
            "{:?} is not ADDR:PORT (IPv6 as [ADDR]:PORT)",
            args.backend
        ))
    })?;
    privileges::require("drain", &privileges::ALL)?;
    let paths = PinPaths::new(&args.pin.pin_path);
    pins::check_pin_dir(&paths)?;
    match lock::lock(&paths) {
        Ok(_lock) => drain_without_daemon(&paths, addr, args.undo),
        Err(KernelError::Locked { pid, .. }) => {
            let request = Request::Drain {
                backend: addr.to_string(),
                undo: args.undo,
            };
            let socket = RunPaths::of(&paths).control;
            let reply = control::ask(&socket, &request).with_context(|| {
                format!(
                    "the daemon (pid {pid}) holds the install but does not answer on {}",
                    socket.display()
                )
            })?;
            if !reply.ok {
                bail!(bad_backend(
                    reply.message.trim_start_matches("BACKEND: ").to_string()
                ));
            }
            super::print(&format!("{}\n", reply.message));
            Ok(0)
        }
        Err(error) => Err(error.into()),
    }
}

/// Records the request in the pinned maps, under the install lock; the
/// next daemon applies it.
fn drain_without_daemon(paths: &PinPaths, addr: SocketAddr, undo: bool) -> super::Outcome {
    let mut maps = install::open_pinned(paths)?;
    let target = endpoint(&addr);
    let draining = maps.drains()?.contains(&target);
    if undo {
        if !draining {
            super::print(&format!("{addr} is not draining; nothing to do\n"));
            return Ok(0);
        }
        maps.delete_drain(&target)?;
        super::print(&format!(
            "{addr}: no longer draining; no daemon is running, it applies when one starts\n"
        ));
        return Ok(0);
    }
    let records = maps.backends()?;
    if !records.iter().any(|(_, info)| info.target == target) {
        let known: Vec<String> = records
            .iter()
            .filter_map(|(_, info)| socket_addr(&info.target).map(|addr| addr.to_string()))
            .collect();
        bail!(bad_backend(format!(
            "{addr} is not a backend of any service (backends: {})",
            known.join(", ")
        )));
    }
    if draining {
        super::print(&format!("{addr} is already draining\n"));
        return Ok(0);
    }
    maps.put_drain(&target)?;
    super::print(&format!(
        "{addr}: draining; no daemon is running, it applies when one starts\n"
    ));
    Ok(0)
}
