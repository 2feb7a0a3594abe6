//! Spill tier of a cache pool: entries evicted for space leave their primary tier
//! (device memory on the CUDA backend, the decoded form in host memory on the CPU
//! backend) as byte blobs in host memory, each with an XXH3-64 checksum taken when it
//! is written and verified before it is decoded again.
//!
//! Why the checksum: SGLang issue #39830 served wrong answers after GDN recurrent
//! states came back from host memory. A blob whose checksum or layout does not
//! verify is dropped and counted ([`super::pool::PoolStats::spill_corrupt`]); the
//! lookup is then a miss and the caller recomputes — a corrupted entry is never used.
//!
//! Blob layout ([`Spill::encode`]): little-endian; a 4-byte magic naming the type,
//! then the type's fields; `f32` arrays as `u64` length + raw IEEE-754 values, so a
//! round trip is bit-exact.
use crate::linear::transition::{Pair, TransitionKind};
use crate::state::{KvCache, LayerState, LinearState, ModelState};

use super::engine::{EntryLayer, SegmentEntry, Snapshot};

/// A value that can be written to and read back from the spill tier.
pub trait Spill: Sized {
    /// Serialises the value (bit-exact for every `f32`).
    fn encode(&self) -> Vec<u8>;
    /// Parses a blob written by [`Spill::encode`]. Errors name what does not fit
    /// (magic, a length past the end, a shape that does not agree); never panics.
    fn decode(bytes: &[u8]) -> Result<Self, String>;
}

/// XXH3-64 of a blob.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Little-endian writer.
#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn i64(&mut self, x: i64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn f32s(&mut self, x: &[f32]) {
        self.u64(x.len() as u64);
        self.0.reserve(4 * x.len());
        for v in x {
            self.0.extend_from_slice(&v.to_le_bytes());
        }
    }
    fn i64s(&mut self, x: &[i64]) {
        self.u64(x.len() as u64);
        for v in x {
            self.i64(*v);
        }
    }
}

/// Little-endian reader over a blob; every read checks the remaining length.
struct R<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| format!("spill blob truncated reading {what} at byte {}", self.at))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }
    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let s = self.take(8, what)?;
        Ok(u64::from_le_bytes(
            s.try_into().map_err(|_| what.to_string())?,
        ))
    }
    fn usize(&mut self, what: &str) -> Result<usize, String> {
        usize::try_from(self.u64(what)?).map_err(|_| format!("{what} does not fit usize"))
    }
    fn i64(&mut self, what: &str) -> Result<i64, String> {
        Ok(self.u64(what)? as i64)
    }
    fn f32s(&mut self, what: &str) -> Result<Vec<f32>, String> {
        let n = self.usize(what)?;
        let bytes = n
            .checked_mul(4)
            .ok_or_else(|| format!("{what}: length {n} overflows"))?;
        let s = self.take(bytes, what)?;
        Ok(s.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    fn i64s(&mut self, what: &str) -> Result<Vec<i64>, String> {
        let n = self.usize(what)?;
        if n > (self.b.len() - self.at) / 8 {
            return Err(format!("spill blob truncated reading {what}"));
        }
        (0..n).map(|_| self.i64(what)).collect()
    }
    fn magic(&mut self, m: &[u8; 4]) -> Result<(), String> {
        let got = self.take(4, "magic")?;
        if got != m {
            return Err(format!(
                "spill blob magic {:?}, expected {:?}",
                String::from_utf8_lossy(got),
                String::from_utf8_lossy(m)
            ));
        }
        Ok(())
    }
    fn end(&self) -> Result<(), String> {
        if self.at != self.b.len() {
            return Err(format!(
                "spill blob has {} trailing bytes",
                self.b.len() - self.at
            ));
        }
        Ok(())
    }
}

fn kind_code(k: TransitionKind) -> u8 {
    match k {
        TransitionKind::Scalar => 0,
        TransitionKind::Diagonal => 1,
        TransitionKind::Dense => 2,
    }
}

fn kind_from(c: u8) -> Result<TransitionKind, String> {
    match c {
        0 => Ok(TransitionKind::Scalar),
        1 => Ok(TransitionKind::Diagonal),
        2 => Ok(TransitionKind::Dense),
        o => Err(format!("unknown transition kind code {o}")),
    }
}

impl Spill for SegmentEntry {
    fn encode(&self) -> Vec<u8> {
        let mut w = W::default();
        w.0.extend_from_slice(b"HSEG");
        w.u64(self.body_start as u64);
        w.u64(self.len as u64);
        w.u64(self.layers.len() as u64);
        for l in &self.layers {
            match l {
                EntryLayer::Linear { pair, conv_tail } => {
                    w.u8(0);
                    w.u8(kind_code(pair.kind()));
                    let (hv, dk, dv) = pair.dims();
                    w.u64(hv as u64);
                    w.u64(dk as u64);
                    w.u64(dv as u64);
                    w.f32s(pair.t());
                    w.f32s(pair.b());
                    w.f32s(conv_tail);
                }
                EntryLayer::Full { k, v } => {
                    w.u8(1);
                    w.f32s(k);
                    w.f32s(v);
                }
            }
        }
        w.0
    }

    fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut r = R { b: bytes, at: 0 };
        r.magic(b"HSEG")?;
        let body_start = r.usize("body_start")?;
        let len = r.usize("len")?;
        let n = r.usize("layer count")?;
        if n > bytes.len() {
            return Err(format!("layer count {n} larger than the blob"));
        }
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            match r.u8("layer tag")? {
                0 => {
                    let kind = kind_from(r.u8("transition kind")?)?;
                    let (hv, dk, dv) = (r.usize("hv")?, r.usize("dk")?, r.usize("dv")?);
                    // Pair::from_parts multiplies the dimensions unchecked.
                    if hv
                        .checked_mul(dk)
                        .and_then(|x| x.checked_mul(dk.max(dv)))
                        .is_none()
                    {
                        return Err(format!("layer {i}: dimensions {hv}x{dk}x{dv} overflow"));
                    }
                    let t = r.f32s("T")?;
                    let b = r.f32s("S_C|0")?;
                    let conv_tail = r.f32s("conv tail")?;
                    let pair = Pair::from_parts(kind, hv, dk, dv, t, b)
                        .map_err(|e| format!("layer {i}: {e}"))?;
                    layers.push(EntryLayer::Linear { pair, conv_tail });
                }
                1 => {
                    let k = r.f32s("K")?;
                    let v = r.f32s("V")?;
                    if k.len() != v.len() {
                        return Err(format!(
                            "layer {i}: K has {} values, V {}",
                            k.len(),
                            v.len()
                        ));
                    }
                    layers.push(EntryLayer::Full { k, v });
                }
                o => return Err(format!("layer {i}: unknown tag {o}")),
            }
        }
        r.end()?;
        Ok(SegmentEntry {
            body_start,
            len,
            layers,
        })
    }
}

impl Spill for Snapshot {
    fn encode(&self) -> Vec<u8> {
        let mut w = W::default();
        w.0.extend_from_slice(b"HSNP");
        w.i64(self.state.next_position);
        match &self.logits {
            None => w.u8(0),
            Some(l) => {
                w.u8(1);
                w.f32s(l);
            }
        }
        w.u64(self.state.layers.len() as u64);
        for l in &self.state.layers {
            match l {
                LayerState::Linear(s) => {
                    w.u8(0);
                    w.f32s(&s.conv);
                    w.f32s(&s.recurrent);
                }
                LayerState::Full(kv) => {
                    w.u8(1);
                    w.f32s(&kv.k);
                    w.f32s(&kv.v);
                    w.i64s(&kv.positions);
                }
            }
        }
        w.0
    }

    fn decode(bytes: &[u8]) -> Result<Self, String> {
        let mut r = R { b: bytes, at: 0 };
        r.magic(b"HSNP")?;
        let next_position = r.i64("next_position")?;
        let logits = match r.u8("logits tag")? {
            0 => None,
            1 => Some(r.f32s("logits")?),
            o => return Err(format!("unknown logits tag {o}")),
        };
        let n = r.usize("layer count")?;
        if n > bytes.len() {
            return Err(format!("layer count {n} larger than the blob"));
        }
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            match r.u8("layer tag")? {
                0 => {
                    let conv = r.f32s("conv tail")?;
                    let recurrent = r.f32s("recurrent state")?;
                    layers.push(LayerState::Linear(LinearState { conv, recurrent }));
                }
                1 => {
                    let k = r.f32s("K")?;
                    let v = r.f32s("V")?;
                    let positions = r.i64s("positions")?;
                    if k.len() != v.len() || (positions.is_empty() != k.is_empty()) {
                        return Err(format!(
                            "layer {i}: K {} / V {} values for {} positions",
                            k.len(),
                            v.len(),
                            positions.len()
                        ));
                    }
                    layers.push(LayerState::Full(KvCache { k, v, positions }));
                }
                o => return Err(format!("layer {i}: unknown tag {o}")),
            }
        }
        r.end()?;
        Ok(Snapshot {
            state: ModelState {
                layers,
                next_position,
            },
            logits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> SegmentEntry {
        let pair = Pair::from_parts(
            TransitionKind::Dense,
            2,
            3,
            2,
            (0..18).map(|i| i as f32 * 0.5 - 3.0).collect(),
            (0..12).map(|i| (i as f32).sin()).collect(),
        )
        .expect("shape");
        SegmentEntry {
            body_start: 8,
            len: 40,
            layers: vec![
                EntryLayer::Linear {
                    pair,
                    conv_tail: vec![f32::MIN_POSITIVE, -0.0, 1e-30],
                },
                EntryLayer::Full {
                    k: vec![1.5, -2.25, f32::MAX],
                    v: vec![0.1, 0.2, 0.3],
                },
            ],
        }
    }

    fn bits(e: &SegmentEntry) -> Vec<u32> {
        e.encode()
            .chunks(4)
            .map(|c| c.iter().fold(0u32, |a, &b| a << 8 | b as u32))
            .collect()
    }

    #[test]
    fn segment_entry_round_trip_is_bit_exact() {
        let e = entry();
        let d = SegmentEntry::decode(&e.encode()).expect("decode");
        assert_eq!(bits(&d), bits(&e));
        assert_eq!((d.body_start, d.len, d.layers.len()), (8, 40, 2));
        match &d.layers[0] {
            EntryLayer::Linear { pair, conv_tail } => {
                assert_eq!(pair.t()[5], -0.5);
                assert_eq!(pair.kind(), TransitionKind::Dense);
                assert_eq!(conv_tail[1].to_bits(), (-0.0f32).to_bits());
            }
            EntryLayer::Full { .. } => panic!("layer 0 should be linear"),
        }
    }

    #[test]
    fn snapshot_round_trip_is_exact() {
        let s = Snapshot {
            state: ModelState {
                layers: vec![
                    LayerState::Linear(LinearState {
                        conv: vec![1.0, 2.0],
                        recurrent: vec![3.0; 7],
                    }),
                    LayerState::Full(KvCache {
                        k: vec![4.0; 6],
                        v: vec![5.0; 6],
                        positions: vec![0, 7, -3],
                    }),
                ],
                next_position: 99,
            },
            logits: Some(vec![0.25, -1.0]),
        };
        let d = <Snapshot>::decode(&s.encode()).expect("decode");
        assert_eq!(d.state, s.state);
        assert_eq!(d.logits, s.logits);
    }

    #[test]
    fn damaged_blobs_are_refused_with_a_reason() {
        let b = entry().encode();
        // Every truncation is an error, never a panic.
        for cut in 0..b.len() {
            assert!(SegmentEntry::decode(&b[..cut]).is_err(), "cut {cut}");
        }
        let mut wrong = b.clone();
        wrong[0] = b'X';
        assert!(SegmentEntry::decode(&wrong).unwrap_err().contains("magic"));
        let mut extra = b.clone();
        extra.push(0);
        assert!(SegmentEntry::decode(&extra)
            .unwrap_err()
            .contains("trailing"));
        // A length field blown up does not allocate or panic.
        let mut huge = b.clone();
        huge[54..62].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(SegmentEntry::decode(&huge).is_err());
        assert!(<Snapshot>::decode(&b).unwrap_err().contains("magic"));
    }

    #[test]
    fn checksum_sees_a_single_bit_flip() {
        let b = entry().encode();
        let c = checksum(&b);
        for i in [0, b.len() / 2, b.len() - 1] {
            let mut f = b.clone();
            f[i] ^= 1;
            assert_ne!(checksum(&f), c, "flip at {i}");
        }
    }

    #[test]
    fn overflowing_dimensions_are_refused_not_panicked_on() {
        for kind in 0..3u8 {
            let mut w = W::default();
            w.0.extend_from_slice(b"HSEG");
            w.u64(0);
            w.u64(1);
            w.u64(1);
            w.u8(0);
            w.u8(kind);
            w.u64(1 << 33); // hv
            w.u64(1 << 33); // dk
            w.u64(1 << 33); // dv
            w.f32s(&[]);
            w.f32s(&[]);
            w.f32s(&[]);
            let r = std::panic::catch_unwind(|| SegmentEntry::decode(&w.0));
            assert!(
                matches!(r, Ok(Err(_))),
                "kind {kind}: {:?}",
                r.map(|x| x.is_ok())
            );
        }
    }
}
