//! The wire encoding of one shipped PIC cache entry (a worker → the combiner).
//!
//! A frame is a fixed header followed by the payload, little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `HYPW` |
//! | 2 | format version ([`WIRE_VERSION`]) |
//! | 2 | reserved, 0 |
//! | 16 | model fingerprint ([`ModelFingerprint`]) |
//! | 8 | segment token count |
//! | 8 | body start (the seam width the entry was built for; 0 = whole segment) |
//! | 8 | payload length `n` in bytes |
//! | 16 | XXH3-128 of the payload |
//! | n | payload: the entry in its [`Spill`] form (per layer the transition pair `(T, S)` and conv tail of a linear layer, or the body K and V of an attention layer, as raw IEEE-754 `f32`) |
//!
//! The payload is bit-exact: an entry that is encoded and decoded equals the one
//! built. [`decode`] verifies, in this order, the magic, the version, the model
//! fingerprint, the length and the checksum before it parses anything, then the
//! parsed entry's body start; a frame that fails any check is refused with a
//! [`WireError`] that says which, and the combiner recomputes that segment (a
//! corrupt entry is never composed).
use crate::config::ModelConfig;
use crate::pic::backend::CacheEntry;
use crate::pic::spill::Spill;

/// Current format version of [`encode`].
pub const WIRE_VERSION: u16 = 1;
/// Header bytes before the payload.
pub const HEADER_BYTES: usize = 4 + 2 + 2 + 16 + 8 + 8 + 8 + 16;
const MAGIC: &[u8; 4] = b"HYPW";

/// 128-bit identity of a model as entries depend on it: XXH3-128 of its
/// configuration (every size, layer kind and constant, [`ModelConfig`]'s `Debug`
/// form) and of a sample of its weights (backend-specific, 0 when the backend gives
/// none; see [`crate::pic::PicBackend::weights_digest`]). Two processes with equal
/// fingerprints build interchangeable entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelFingerprint(pub [u8; 16]);

impl ModelFingerprint {
    /// The fingerprint of `config` with the weight digest `weights` (see the type).
    pub fn new(config: &ModelConfig, weights: u128) -> Self {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(b"hypic-model-v1\0");
        h.update(format!("{config:?}").as_bytes());
        h.update(&weights.to_le_bytes());
        ModelFingerprint(h.digest128().to_le_bytes())
    }

    /// Lower-case hex (32 characters).
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses [`ModelFingerprint::hex`].
    ///
    /// Errors: not 32 hex digits.
    pub fn from_hex(s: &str) -> Result<Self, WireError> {
        let v = hex::decode(s).map_err(|e| WireError::Malformed(format!("fingerprint: {e}")))?;
        let a: [u8; 16] = v
            .try_into()
            .map_err(|_| WireError::Malformed("fingerprint is not 16 bytes".into()))?;
        Ok(ModelFingerprint(a))
    }
}

/// Why a frame was refused by [`decode`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not an entry frame, or shorter than its header.
    #[error("not a HYPIC entry frame: {0}")]
    Malformed(String),
    /// Written by another format version.
    #[error("entry frame version {got}, this build reads version {expected}")]
    Version {
        /// Version in the frame.
        got: u16,
        /// [`WIRE_VERSION`].
        expected: u16,
    },
    /// Built by another model (configuration or weights differ).
    #[error("entry built for model {got}, this server runs model {expected}")]
    Model {
        /// Fingerprint in the frame (hex).
        got: String,
        /// The receiver's (hex).
        expected: String,
    },
    /// The payload's checksum does not verify (damaged in transit or in memory).
    #[error("entry payload checksum mismatch (XXH3-128 {got}, header says {expected})")]
    Checksum {
        /// Checksum of the bytes received (hex).
        got: String,
        /// Checksum in the header (hex).
        expected: String,
    },
    /// The payload verified but does not parse, or does not describe the segment
    /// the header names.
    #[error("entry payload does not parse: {0}")]
    Payload(String),
}

/// The header fields of a frame (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Model fingerprint.
    pub model: ModelFingerprint,
    /// Segment token count.
    pub tokens: u64,
    /// Body start of the entry.
    pub body_start: u64,
    /// Payload length, bytes.
    pub payload_len: u64,
    /// XXH3-128 of the payload.
    pub checksum: u128,
}

/// XXH3-128 of `bytes`.
pub fn checksum(bytes: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(bytes)
}

/// Encodes `entry` (a segment of `tokens` tokens, built by the model `model`) as one
/// frame. Bytes: [`HEADER_BYTES`] plus the entry's [`Spill`] form.
pub fn encode<E: Spill + CacheEntry>(entry: &E, tokens: usize, model: ModelFingerprint) -> Vec<u8> {
    let payload = entry.encode();
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&model.0);
    out.extend_from_slice(&(tokens as u64).to_le_bytes());
    out.extend_from_slice(&(entry.body_start() as u64).to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&checksum(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Reads and checks a frame's header (magic, version, model; not the checksum).
///
/// Errors: [`WireError::Malformed`], [`WireError::Version`], [`WireError::Model`].
pub fn header(frame: &[u8], model: ModelFingerprint) -> Result<Header, WireError> {
    if frame.len() < HEADER_BYTES {
        return Err(WireError::Malformed(format!(
            "{} bytes, the header alone has {HEADER_BYTES}",
            frame.len()
        )));
    }
    if &frame[..4] != MAGIC {
        return Err(WireError::Malformed(format!(
            "magic {:?}",
            String::from_utf8_lossy(&frame[..4])
        )));
    }
    let version = u16::from_le_bytes([frame[4], frame[5]]);
    if version != WIRE_VERSION {
        return Err(WireError::Version {
            got: version,
            expected: WIRE_VERSION,
        });
    }
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&frame[8..24]);
    let got = ModelFingerprint(fp);
    if got != model {
        return Err(WireError::Model {
            got: got.hex(),
            expected: model.hex(),
        });
    }
    let mut c = [0u8; 16];
    c.copy_from_slice(&frame[48..64]);
    Ok(Header {
        model: got,
        tokens: u64_at(frame, 24),
        body_start: u64_at(frame, 32),
        payload_len: u64_at(frame, 40),
        checksum: u128::from_le_bytes(c),
    })
}

/// Checks a frame without parsing its payload: header (as [`header`]), payload
/// length, checksum, and that it is the entry of a `tokens`-token segment with body
/// start `body_start`. What the combiner does on arrival; [`decode`] checks again.
///
/// Errors: see [`WireError`].
pub fn verify(
    frame: &[u8],
    model: ModelFingerprint,
    tokens: usize,
    body_start: usize,
) -> Result<(), WireError> {
    let h = checked(frame, model, tokens)?;
    if h.body_start != body_start as u64 {
        return Err(WireError::Payload(format!(
            "entry with body start {}, expected {body_start}",
            h.body_start
        )));
    }
    Ok(())
}

fn checked(frame: &[u8], model: ModelFingerprint, tokens: usize) -> Result<Header, WireError> {
    let h = header(frame, model)?;
    let payload = &frame[HEADER_BYTES..];
    if payload.len() as u64 != h.payload_len {
        return Err(WireError::Malformed(format!(
            "payload of {} bytes, header says {}",
            payload.len(),
            h.payload_len
        )));
    }
    let got = checksum(payload);
    if got != h.checksum {
        return Err(WireError::Checksum {
            got: format!("{got:032x}"),
            expected: format!("{:032x}", h.checksum),
        });
    }
    if h.tokens != tokens as u64 {
        return Err(WireError::Payload(format!(
            "entry of a {}-token segment, expected {tokens} tokens",
            h.tokens
        )));
    }
    Ok(h)
}

/// Verifies a frame written by [`encode`] against the receiver's model and the
/// segment it should hold (`tokens` tokens), and parses its entry.
///
/// Errors: see [`WireError`]; a frame whose token count or body start disagrees
/// with the segment or the payload is [`WireError::Payload`].
pub fn decode<E: Spill + CacheEntry>(
    frame: &[u8],
    model: ModelFingerprint,
    tokens: usize,
) -> Result<E, WireError> {
    let h = checked(frame, model, tokens)?;
    let payload = &frame[HEADER_BYTES..];
    let e = E::decode(payload).map_err(WireError::Payload)?;
    if e.body_start() as u64 != h.body_start {
        return Err(WireError::Payload(format!(
            "payload body start {}, header says {}",
            e.body_start(),
            h.body_start
        )));
    }
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pic::engine::{EntryLayer, SegmentEntry};
    use crate::pic::{PicBackend, PicEngine};

    fn engine() -> PicEngine {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/qwen3_5");
        let model = crate::model::Model::load(&dir, &mut |_, _| {}).unwrap();
        PicEngine::new(std::sync::Arc::new(model), "m", 1 << 26, 1 << 26)
    }

    fn bits(e: &SegmentEntry) -> Vec<u32> {
        let mut v = vec![e.body_start as u32, e.len as u32];
        for l in &e.layers {
            match l {
                EntryLayer::Linear { pair, conv_tail } => {
                    v.extend(pair.t().iter().map(|x| x.to_bits()));
                    v.extend(pair.b().iter().map(|x| x.to_bits()));
                    v.extend(conv_tail.iter().map(|x| x.to_bits()));
                }
                EntryLayer::Full { k, v: vv } => {
                    v.extend(k.iter().map(|x| x.to_bits()));
                    v.extend(vv.iter().map(|x| x.to_bits()));
                }
            }
        }
        v
    }

    /// A built entry survives encode → decode bit for bit; every damaged payload
    /// byte, a wrong version and another model are refused by name.
    #[test]
    fn parallel_wire_round_trip_is_bit_exact_and_corruption_is_detected() {
        let eng = engine();
        let tokens: Vec<u32> = (0..40u32).map(|i| (i * 13 + 5) % 300).collect();
        let e = eng.build_entry(&tokens, 8).unwrap();
        let fp = ModelFingerprint::new(eng.pic_backend().config(), 7);
        let frame = encode(&e, tokens.len(), fp);
        let back: SegmentEntry = decode(&frame, fp, tokens.len()).unwrap();
        assert_eq!(bits(&back), bits(&e));
        assert_eq!(back.bytes(), e.bytes());

        // One flipped bit anywhere in the payload: checksum mismatch.
        for at in [HEADER_BYTES, HEADER_BYTES + 100, frame.len() - 1] {
            let mut bad = frame.clone();
            bad[at] ^= 0x10;
            let err = decode::<SegmentEntry>(&bad, fp, tokens.len()).unwrap_err();
            assert!(matches!(err, WireError::Checksum { .. }), "{err}");
        }
        // Truncated.
        let err = decode::<SegmentEntry>(&frame[..frame.len() - 4], fp, tokens.len()).unwrap_err();
        assert!(matches!(err, WireError::Malformed(_)), "{err}");
        // Another version.
        let mut bad = frame.clone();
        bad[4] = 9;
        let err = decode::<SegmentEntry>(&bad, fp, tokens.len()).unwrap_err();
        assert_eq!(
            err,
            WireError::Version {
                got: 9,
                expected: WIRE_VERSION
            }
        );
        // Another model (weights digest differs).
        let other = ModelFingerprint::new(eng.pic_backend().config(), 8);
        let err = decode::<SegmentEntry>(&frame, other, tokens.len()).unwrap_err();
        assert!(matches!(err, WireError::Model { .. }), "{err}");
        assert!(err.to_string().contains(&other.hex()));
        // Another segment length.
        let err = decode::<SegmentEntry>(&frame, fp, tokens.len() + 1).unwrap_err();
        assert!(matches!(err, WireError::Payload(_)), "{err}");
        assert_eq!(ModelFingerprint::from_hex(&fp.hex()).unwrap(), fp);
    }
}
