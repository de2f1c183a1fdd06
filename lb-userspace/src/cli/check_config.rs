use std::path::PathBuf;

use socklb::config;

/// Validate a config file and print what was understood, or every error.
///
/// Example: socklb check-config /etc/socklb/socklb.toml
#[derive(Debug, clap::Args)]
pub struct CheckConfigArgs {
    /// The TOML file to check.
    file: PathBuf,
}

pub fn check_config(args: CheckConfigArgs) -> super::Outcome {
    let config = config::load_file(&args.file)?;
    super::print(&config.to_string());
    Ok(0)
}
