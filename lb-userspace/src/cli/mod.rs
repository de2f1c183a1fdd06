//! Command-line definitions, one module per subcommand.

mod check_config;
mod drain;
mod run;
mod status;
mod uninstall;

use std::{io::Write, path::PathBuf};

use clap::{Parser, Subcommand};
use socklb::{
    cgroup::CgroupError,
    config::ConfigError,
    daemon::DaemonError,
    dataplane::{DEFAULT_PIN_PATH, KernelError},
};

/// Node-local load balancer for control-plane endpoints: connects to a VIP
/// are sent to a healthy backend inside the kernel, with no proxy hop.
#[derive(Debug, Parser)]
#[command(name = "socklb", version)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Run(Box<run::RunArgs>),
    Status(status::StatusArgs),
    Uninstall(uninstall::UninstallArgs),
    CheckConfig(check_config::CheckConfigArgs),
    Drain(drain::DrainArgs),
}

/// The directory under bpffs where socklb pins its maps and links.
#[derive(Debug, clap::Args)]
struct PinPathArg {
    /// Directory (on bpffs) that holds socklb's pinned maps and links.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_PATH)]
    pin_path: PathBuf,
}

/// How a command ended: its exit status, when it is not 0.
pub type Outcome = anyhow::Result<u8>;

pub fn dispatch(cli: Cli) -> Outcome {
    match cli.command {
        Command::Run(args) => run::run(*args),
        Command::Status(args) => status::status(args),
        Command::Uninstall(args) => uninstall::uninstall(args),
        Command::CheckConfig(args) => check_config::check_config(args),
        Command::Drain(args) => drain::drain(args),
    }
}

/// Writes to stdout. A closed pipe (`socklb status | head -1`) or any
/// other write error ends the output quietly: a CLI never panics on it.
pub fn print(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(text.as_bytes());
    let _ = stdout.flush();
}

/// 2 for bad input (config, flags, addresses), 1 for everything else.
pub fn exit_status(error: &anyhow::Error) -> u8 {
    let bad_cgroup = |error: &CgroupError| matches!(error, CgroupError::Invalid { .. });
    let bad_kernel_input = |error: &KernelError| matches!(error, KernelError::NotBpffs(_));
    let bad_input = error.chain().any(|cause| {
        cause.is::<ConfigError>()
            || cause.downcast_ref::<CgroupError>().is_some_and(bad_cgroup)
            || cause
                .downcast_ref::<KernelError>()
                .is_some_and(bad_kernel_input)
            || match cause.downcast_ref::<DaemonError>() {
                Some(DaemonError::Cgroup(error)) => bad_cgroup(error),
                Some(DaemonError::Kernel(error)) => bad_kernel_input(error),
                _ => false,
            }
    });
    if bad_input { 2 } else { 1 }
}
