//! What the test helper binaries (tests/src/bin) share on their command
//! lines: clap value parsers for durations given as numbers, and joining
//! a cgroup before any work. A usage error exits with status 2 (clap's).

use std::{path::Path, time::Duration};

/// `--…-ms N`: N milliseconds.
pub fn millis(text: &str) -> Result<Duration, String> {
    text.parse()
        .map(Duration::from_millis)
        .map_err(|error| format!("{text:?} is not a number of milliseconds: {error}"))
}

/// `--…-seconds N`: N seconds.
pub fn seconds(text: &str) -> Result<Duration, String> {
    text.parse()
        .map(Duration::from_secs)
        .map_err(|error| format!("{text:?} is not a number of seconds: {error}"))
}

/// Moves this process into the cgroup directory `dir`: a v2 one (its
/// connects then go through the programs attached there), or a v1 memory
/// cgroup.
pub fn join_cgroup(dir: &Path) -> Result<(), String> {
    std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
        .map_err(|error| format!("joining cgroup {}: {error}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_whole_numbers_of_their_unit() {
        assert_eq!(millis("250"), Ok(Duration::from_millis(250)));
        assert_eq!(seconds("3"), Ok(Duration::from_secs(3)));
        for bad in ["", "1.5", "-1", "2s"] {
            assert!(millis(bad).is_err(), "{bad:?}");
        }
    }
}
