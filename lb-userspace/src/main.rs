//! The `socklb` command: a thin CLI over the socklb library.

mod cli;

use std::process::ExitCode;

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
        .init();
    match cli::dispatch(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("socklb: {error:#}");
            ExitCode::from(cli::exit_status(&error))
        }
    }
}
