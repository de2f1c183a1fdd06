//! The wire: the client's 64-byte header and the server's 56-byte report.

use ring::digest::Context;

use crate::stream::Writes;

pub const HEADER_LEN: usize = 64;
pub const REPORT_LEN: usize = 56;
const MAGIC: [u8; 4] = *b"SCK1";
/// The byte count of a direction that streams until it is stopped.
pub const UNBOUNDED: u64 = u64::MAX;
/// The report's offset when no byte was wrong.
pub const NO_MISMATCH: u64 = u64::MAX;

/// What the server plays on a connection.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Role {
    /// Both streams (either may be empty or unbounded), then the report.
    Duplex = 1,
    ResetByServer = 2,
    /// The first connection of `reset-by-client`.
    ResetVictim = 3,
    /// The second: how did the first one's reader end?
    ResetQuery = 4,
    Rcvlowat = 5,
    Pingpong = 6,
}

impl Role {
    fn from_code(code: u8) -> Option<Self> {
        [
            Role::Duplex,
            Role::ResetByServer,
            Role::ResetVictim,
            Role::ResetQuery,
            Role::Rcvlowat,
            Role::Pingpong,
        ]
        .into_iter()
        .find(|role| *role as u8 == code)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Header {
    pub role: Role,
    pub writes: Writes,
    /// The server sends with splice(2).
    pub splice: bool,
    /// Bytes client to server (UNBOUNDED: until stopped).
    pub up: u64,
    /// Bytes server to client.
    pub down: u64,
    pub seed: u64,
    /// Names the first connection of `reset-by-client`.
    pub token: u64,
    /// Bytes per second each side sends at most (0: as fast as it can).
    pub rate: u64,
    /// How long the server takes to answer after the client's EOF (a
    /// server that works on the request), in milliseconds.
    pub answer_delay_ms: u64,
}

impl Header {
    pub fn new(role: Role, seed: u64) -> Self {
        Header {
            role,
            writes: Writes::Small,
            splice: false,
            up: 0,
            down: 0,
            seed,
            token: 0,
            rate: 0,
            answer_delay_ms: 0,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut bytes = [0u8; HEADER_LEN];
        bytes[..4].copy_from_slice(&MAGIC);
        bytes[4] = self.role as u8;
        bytes[5] = (self.writes == Writes::Large) as u8;
        bytes[6] = self.splice as u8;
        let fields = [
            self.up,
            self.down,
            self.seed,
            self.token,
            self.rate,
            self.answer_delay_ms,
        ];
        for (slot, value) in fields.iter().enumerate() {
            bytes[8 + slot * 8..16 + slot * 8].copy_from_slice(&value.to_be_bytes());
        }
        bytes
    }

    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Self, String> {
        if bytes[..4] != MAGIC {
            return Err(format!("not a streamcheck header: {:02x?}", &bytes[..8]));
        }
        Ok(Header {
            role: Role::from_code(bytes[4]).ok_or(format!("unknown role {}", bytes[4]))?,
            writes: if bytes[5] == 1 {
                Writes::Large
            } else {
                Writes::Small
            },
            splice: bytes[6] == 1,
            up: be_u64(bytes, 8),
            down: be_u64(bytes, 16),
            seed: be_u64(bytes, 24),
            token: be_u64(bytes, 32),
            rate: be_u64(bytes, 40),
            answer_delay_ms: be_u64(bytes, 48),
        })
    }
}

fn be_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// The server's account of a connection, sent after the client's EOF.
pub struct Report {
    /// Bytes it received.
    pub received: u64,
    /// The offset of the first wrong byte, or NO_MISMATCH.
    pub mismatch: u64,
    /// Bytes it sent before the report.
    pub sent: u64,
    /// SHA-256 of what it received.
    pub digest: [u8; 32],
}

impl Report {
    pub fn encode(&self) -> [u8; REPORT_LEN] {
        let mut bytes = [0u8; REPORT_LEN];
        bytes[..8].copy_from_slice(&self.received.to_be_bytes());
        bytes[8..16].copy_from_slice(&self.mismatch.to_be_bytes());
        bytes[16..24].copy_from_slice(&self.sent.to_be_bytes());
        bytes[24..].copy_from_slice(&self.digest);
        bytes
    }

    pub fn decode(bytes: &[u8]) -> Option<Self> {
        (bytes.len() == REPORT_LEN).then(|| Report {
            received: be_u64(bytes, 0),
            mismatch: be_u64(bytes, 8),
            sent: be_u64(bytes, 16),
            digest: bytes[24..].try_into().expect("32 bytes"),
        })
    }
}

pub fn finish_digest(context: Context) -> [u8; 32] {
    context
        .finish()
        .as_ref()
        .try_into()
        .expect("SHA-256 is 32 bytes")
}
