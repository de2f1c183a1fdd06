use anyhow::Context;
use socklb::{
    kernel::{Dataplane, PinPaths},
    status,
};

/// Show services, backends, health and redirect counts from the pinned maps.
/// Works while the daemon is not running.
///
/// Example: socklb status --json
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    pin: super::PinPathArg,
}

pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    let dataplane = Dataplane::open_pinned(&PinPaths::new(&args.pin.pin_path))?;
    let report = status::read(&dataplane);
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).context("encoding JSON")?
        );
    } else {
        print!("{report}");
    }
    Ok(())
}
