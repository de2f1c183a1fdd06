use std::net::SocketAddr;

use anyhow::{Context, bail};
use socklb::{
    kernel::{self, Dataplane, PinPaths},
    planner::{endpoint, socket_addr},
};

/// Stop sending new connections to a backend and leave its existing ones
/// alone (or, with --undo, take it back). The running daemon applies it
/// within a second; a daemon started later applies it too.
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

pub fn drain(args: DrainArgs) -> anyhow::Result<()> {
    let addr: SocketAddr = args.backend.parse().map_err(|_| {
        socklb::config::ConfigError::Invalid(vec![socklb::config::FieldError {
            field: "BACKEND".into(),
            problem: format!("{:?} is not ADDR:PORT (IPv6 as [ADDR]:PORT)", args.backend),
        }])
    })?;
    let paths = PinPaths::new(&args.pin.pin_path);
    let mut dataplane = Dataplane::open_pinned(&paths)?;
    let target = endpoint(&addr);
    let known = dataplane
        .backend_records()
        .iter()
        .any(|(_, info)| info.target == target);
    if !known && !args.undo {
        let backends: Vec<String> = dataplane
            .backend_records()
            .iter()
            .filter_map(|(_, info)| socket_addr(&info.target).map(|addr| addr.to_string()))
            .collect();
        bail!(socklb::config::ConfigError::Invalid(vec![
            socklb::config::FieldError {
                field: "BACKEND".into(),
                problem: format!(
                    "{addr} is not a backend of any service (backends: {})",
                    backends.join(", ")
                ),
            }
        ]));
    }
    dataplane
        .request_drain(target, !args.undo)
        .context("recording the drain request")?;
    let what = if args.undo {
        "no longer draining"
    } else {
        "draining"
    };
    match kernel::lock_pin_dir(&paths) {
        Ok(_unlocked) => {
            println!("{addr}: {what}; no daemon is running, it applies when one starts")
        }
        Err(_) => println!("{addr}: {what}; the running daemon applies it within a second"),
    }
    Ok(())
}
