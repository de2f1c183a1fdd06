//! The clock of the daemon's heartbeat, and the wall-clock times status
//! prints.

use std::time::{SystemTime, UNIX_EPOCH};

/// Nanoseconds of CLOCK_BOOTTIME: a clock every process reads alike, that
/// goes on while the machine sleeps. The daemon writes its heartbeat in it
/// and `status` reads the heartbeat's age against it.
pub fn boottime_ns() -> u64 {
    // SAFETY: clock_gettime writes into the timespec we own.
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// The wall-clock time of a CLOCK_BOOTTIME instant, read against now.
pub fn wall_time_of(boottime: u64) -> SystemTime {
    let now_boot = boottime_ns();
    let now = SystemTime::now();
    if boottime <= now_boot {
        now - std::time::Duration::from_nanos(now_boot - boottime)
    } else {
        now + std::time::Duration::from_nanos(boottime - now_boot)
    }
}

/// `2006-01-02T15:04:05Z`: UTC, to the second (the form of Kubernetes
/// timestamps, and of the times `status` prints).
pub fn rfc3339(time: SystemTime) -> String {
    let seconds = time
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let (days, of_day) = (seconds / 86_400, seconds % 86_400);
    // Howard Hinnant's civil_from_days.
    let shifted = days as i64 + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn timestamps_are_rfc3339_in_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let leap_day = UNIX_EPOCH + Duration::from_secs(1_709_210_096);
        assert_eq!(rfc3339(leap_day), "2024-02-29T12:34:56Z");
    }
}
