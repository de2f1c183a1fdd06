//! The `socklb` command: a thin CLI over the socklb library.

mod cli;

use std::{io::Write, process::ExitCode};

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SOCKLB_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,lb_ebpf=trace")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // A log line that cannot be written (stderr closed) is lost, and
        // the daemon goes on; by default the subscriber would report the
        // failure with eprintln!, which panics on that same closed stderr.
        .log_internal_errors(false)
        .init();
    match cli::dispatch(args) {
        Ok(status) => ExitCode::from(status),
        Err(error) => {
            let _ = writeln!(
                std::io::stderr(),
                "socklb: {}",
                socklb::errors::chain(error.as_ref())
            );
            ExitCode::from(cli::exit_status(&error))
        }
    }
}
