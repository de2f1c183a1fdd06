//! The nemesis's random numbers: SplitMix64, written out here so that a
//! seed replays the same schedule on every machine and after every
//! dependency upgrade (a library's generator may change its stream).

/// A seeded generator (SplitMix64, Steele, Lea and Flood 2014).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `low..high` (`low` when the range is empty).
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            return low;
        }
        low + self.next_u64() % (high - low)
    }

    /// An index drawn with the given weights (0 when all are zero).
    pub fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u64 = weights.iter().map(|&weight| u64::from(weight)).sum();
        if total == 0 {
            return 0;
        }
        let mut draw = self.range(0, total);
        for (index, &weight) in weights.iter().enumerate() {
            if draw < u64::from(weight) {
                return index;
            }
            draw -= u64::from(weight);
        }
        weights.len() - 1
    }
}

/// A seed from the clock and the process id, for a run without `--seed`.
pub fn fresh_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64);
    Rng::new(nanos ^ u64::from(std::process::id()) << 32).next_u64() % 1_000_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_splitmix64() {
        // The reference values of SplitMix64 from seed 0.
        let mut rng = Rng::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn ranges_and_weights_stay_in_bounds() {
        let mut rng = Rng::new(7);
        for _ in 0..1000 {
            let value = rng.range(5, 9);
            assert!((5..9).contains(&value));
            assert_eq!(rng.weighted(&[0, 3, 0]), 1);
        }
        assert_eq!(rng.range(4, 4), 4);
    }
}
