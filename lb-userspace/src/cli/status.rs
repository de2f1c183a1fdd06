use anyhow::Context;
use socklb::{
    daemon::control,
    dataplane::{PinPaths, install, lock::RunPaths, pins},
    privileges, status,
};

/// Show the daemon's liveness, whether the data plane is attached, and the
/// services, backends, health and counters, from the pinned maps and the
/// kernel. Works while the daemon is not running.
///
/// With --check, print nothing but failures and exit with: 0 when the
/// daemon runs, the data plane is attached, no service is handed back and
/// every service has a healthy backend; else, gravest first, 4 when the
/// data plane is not attached, 3 when the daemon is not running, 6 when
/// the kernel hands a service's VIPs back (the daemon gone), 5 when a
/// service has no healthy backend; 1 when the status cannot be read
/// (nothing installed, no privileges).
///
/// Example: socklb status --json
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Exit non-zero unless socklb is ready (for liveness and readiness
    /// probes); see the exit statuses above.
    #[arg(long)]
    check: bool,
    #[command(flatten)]
    pin: super::PinPathArg,
}

pub fn status(args: StatusArgs) -> super::Outcome {
    privileges::require("status", &privileges::READ)?;
    let paths = PinPaths::new(&args.pin.pin_path);
    pins::check_pin_dir(&paths)?;
    let maps = install::open_pinned(&paths)?;
    let mut report = status::read(&maps, &paths);
    if report.daemon.running && !args.check {
        // Only the daemon knows its reloads and discovery; a daemon that
        // does not answer leaves them out.
        let socket = RunPaths::of(&paths).control;
        report.daemon_info = control::ask(&socket, &control::Request::Info)
            .ok()
            .and_then(|reply| reply.info);
    }
    if args.check {
        let failures = report.check();
        for failure in &failures {
            super::print(&format!("not ready: {failure}\n"));
        }
        return Ok(failures.first().map_or(0, |failure| failure.exit_status()));
    }
    if args.json {
        let text = serde_json::to_string_pretty(&report).context("encoding JSON")?;
        super::print(&format!("{text}\n"));
    } else {
        super::print(&report.to_string());
    }
    Ok(0)
}
