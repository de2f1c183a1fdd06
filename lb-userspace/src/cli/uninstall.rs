use socklb::kernel::{self, PinPaths};

/// Detach socklb's programs and remove every pin it owns, and nothing else.
///
/// Example: socklb uninstall --pin-path /sys/fs/bpf/socklb
#[derive(Debug, clap::Args)]
pub struct UninstallArgs {
    #[command(flatten)]
    pin: super::PinPathArg,
}

pub fn uninstall(args: UninstallArgs) -> anyhow::Result<()> {
    let removed = kernel::uninstall(&PinPaths::new(&args.pin.pin_path))?;
    for path in removed {
        println!("removed {}", path.display());
    }
    Ok(())
}
