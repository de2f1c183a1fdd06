//! The streams: deterministic bytes and write sizes from a seed (splitmix64,
//! counter based), so that each end knows the other's bytes.

const SMALL_WRITE_MAX: u64 = 4096;
pub const LARGE_WRITE: u64 = 1 << 20;

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// splitmix64's output function.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Word `index` of the sequence with this seed: splitmix64 is counter based,
/// so any part of a stream can be made without the parts before it.
pub fn word(seed: u64, index: u64) -> u64 {
    mix(seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GAMMA)))
}

/// Bytes `position..position + out.len()` of the stream with this seed:
/// word `index` is bytes `8 * index..8 * index + 8`, little-endian.
pub fn fill_stream(seed: u64, position: u64, out: &mut [u8]) {
    // Whole blocks of words, then copied out: several times faster than
    // word by word in a debug build, which is what the tests run.
    let mut words = [0u64; 512];
    let mut done = 0;
    while done < out.len() {
        let at = position + done as u64;
        let skip = (at % 8) as usize;
        let take = (8 * words.len() - skip).min(out.len() - done);
        let count = (skip + take).div_ceil(8);
        fill_words(seed, at / 8, &mut words[..count]);
        out[done..done + take].copy_from_slice(&as_bytes(&words)[skip..skip + take]);
        done += take;
    }
}

/// Words `first..first + words.len()` of the sequence with this seed, each
/// stored little-endian.
fn fill_words(seed: u64, first: u64, words: &mut [u64]) {
    let mut counter = seed.wrapping_add(first.wrapping_mul(GAMMA));
    for slot in words {
        counter = counter.wrapping_add(GAMMA);
        *slot = mix(counter).to_le();
    }
}

pub fn as_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding and u8 no alignment; the bytes live as
    // long as the words.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), std::mem::size_of_val(words)) }
}

/// A connection's two streams.
#[derive(Clone, Copy)]
pub enum Direction {
    /// Client to server.
    Up,
    /// Server to client.
    Down,
}

impl Direction {
    /// The seed of this direction's bytes.
    pub fn seed(self, seed: u64) -> u64 {
        match self {
            Direction::Up => mix(seed ^ 0x7570_7570),
            Direction::Down => mix(seed ^ 0x646f_776e),
        }
    }

    /// The seed of this direction's write sizes.
    pub fn sizes_seed(self, seed: u64) -> u64 {
        mix(self.seed(seed) ^ 0x7369_7a65)
    }
}

#[derive(Clone, Copy, PartialEq, Debug, clap::ValueEnum)]
pub enum Writes {
    /// 1 byte to 4 KiB, random per write.
    Small,
    /// 1 MiB per write.
    Large,
}

impl Writes {
    pub fn name(self) -> &'static str {
        match self {
            Writes::Small => "small",
            Writes::Large => "large",
        }
    }

    /// The size of write `index` of a stream whose sizes come from `seed`.
    pub fn size(self, seed: u64, index: u64) -> u64 {
        match self {
            Writes::Small => 1 + word(seed, index) % SMALL_WRITE_MAX,
            Writes::Large => LARGE_WRITE,
        }
    }
}

/// The seed of connection `index` of a run.
pub fn connection_seed(seed: u64, index: u64) -> u64 {
    word(seed, index)
}
