//! Builds the older socklb versions that tests/tests/upgrade.rs upgrades
//! from, into their cache under target/ (see `socklb_tests::old_socklb_bin_at`),
//! and prints each binary's path. `cargo xtask test` runs it in the
//! background at the start of the suites, so that the minutes of building
//! take the CPU the other suites leave instead of holding up a lane.
//! SOCKLB_BIN names the socklb whose target/ directory holds the cache.

use clap::Parser;
use socklb_tests::{FIRST_LAYOUT_COMMIT, SOCKET_STORAGE_COMMIT, old_socklb_bin_at};

/// Builds and caches older socklb versions.
#[derive(Debug, Parser)]
#[command(name = "oldsocklb")]
struct Args {
    /// The commits to build (default: every commit upgrade.rs upgrades
    /// from).
    commits: Vec<String>,
}

fn main() {
    let Args { mut commits } = Args::parse();
    if commits.is_empty() {
        commits = [FIRST_LAYOUT_COMMIT, SOCKET_STORAGE_COMMIT]
            .map(String::from)
            .to_vec();
    }
    for commit in &commits {
        println!("{}", old_socklb_bin_at(commit).display());
    }
}
