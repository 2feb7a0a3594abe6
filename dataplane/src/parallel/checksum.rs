//! The checksum a device transport computes over a shipped entry on the sender's
//! device and again on the receiver's after the copy (`cuda::peer`; the kernel is
//! `dataplane/kernels/hash.cu`). This module is its CPU reference and defines it:
//!
//! * a buffer of `n` bytes is read as words `w_i`, `i < ⌈n/4⌉`, each the
//!   little-endian `u32` of bytes `4i .. 4i+3` (missing bytes of the last word are 0);
//! * [`word_sum`]: `Σ_i mix64((i·K1) ⊕ (seed·K2) ⊕ w_i) mod 2⁶⁴` ([`mix64`] the
//!   SplitMix64 finaliser, products wrapping), the part the device computes in
//!   parallel (integer addition: the same for any grid and order of atomics);
//! * [`buffer_hash`]: `mix64(word_sum ⊕ n)`;
//! * [`entry_checksum`]: XXH3-64 of the entry's shape `(len, body_start)` and, per
//!   buffer in order, its byte length and [`buffer_hash`] with the buffer's ordinal
//!   as the seed.
//!
//! Since `mix64` is a bijection, changing any one word of a buffer always changes
//! its word sum; a reordering of buffers changes the seeds. It is an integrity check
//! against faults (a bad copy, a flipped bit), not a defence against an adversary.

/// Multiplier of the word index.
pub const K1: u64 = 0x9E37_79B9_7F4A_7C15;
/// Multiplier of the seed.
pub const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// The SplitMix64 finaliser (a bijection of `u64`).
pub fn mix64(mut z: u64) -> u64 {
    z ^= z >> 30;
    z = z.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 27;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The word sum of `bytes` under `seed` (see the module docs); what the kernel
/// `hash_word_sum` accumulates.
pub fn word_sum(bytes: &[u8], seed: u64) -> u64 {
    let s = seed.wrapping_mul(K2);
    bytes
        .chunks(4)
        .enumerate()
        .map(|(i, c)| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            let w = u32::from_le_bytes(w) as u64;
            mix64((i as u64).wrapping_mul(K1) ^ s ^ w)
        })
        .fold(0u64, u64::wrapping_add)
}

/// The hash of one buffer from its word sum and byte length.
pub fn finish(sum: u64, n: usize) -> u64 {
    mix64(sum ^ n as u64)
}

/// The hash of one buffer (`finish(word_sum(bytes, seed), bytes.len())`).
pub fn buffer_hash(bytes: &[u8], seed: u64) -> u64 {
    finish(word_sum(bytes, seed), bytes.len())
}

/// The checksum of an entry of `len` tokens with body from `body_start` from the
/// `(byte length, buffer_hash)` of each of its buffers, in order (buffer `j` hashed
/// with seed `j`).
pub fn combine(len: usize, body_start: usize, buffers: &[(usize, u64)]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"hypic-entry-sum-v1\0");
    h.update(&(len as u64).to_le_bytes());
    h.update(&(body_start as u64).to_le_bytes());
    for (n, x) in buffers {
        h.update(&(*n as u64).to_le_bytes());
        h.update(&x.to_le_bytes());
    }
    h.digest()
}

/// The checksum of an entry whose buffers (raw bytes, in order) are `buffers`.
pub fn entry_checksum(len: usize, body_start: usize, buffers: &[&[u8]]) -> u64 {
    let parts: Vec<(usize, u64)> = buffers
        .iter()
        .enumerate()
        .map(|(j, b)| (b.len(), buffer_hash(b, j as u64)))
        .collect();
    combine(len, body_start, &parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        (0..n as u64)
            .map(|i| (mix64(i ^ seed.wrapping_mul(K1)) >> 24) as u8)
            .collect()
    }

    /// The word sum is the plain sum of the per-word terms, whatever the split: the
    /// device may add partial sums in any order.
    #[test]
    fn parallel_checksum_sum_is_split_invariant() {
        let b = bytes(4099, 7);
        let whole = word_sum(&b, 3);
        for cut in [4usize, 64, 1024, 4096] {
            let s = &b[..];
            let (head, tail) = s.split_at(cut);
            // The tail's word indices continue from the head's.
            let t: u64 = tail
                .chunks(4)
                .enumerate()
                .map(|(i, c)| {
                    let mut w = [0u8; 4];
                    w[..c.len()].copy_from_slice(c);
                    mix64(
                        ((i + cut / 4) as u64).wrapping_mul(K1)
                            ^ 3u64.wrapping_mul(K2)
                            ^ u32::from_le_bytes(w) as u64,
                    )
                })
                .fold(0, u64::wrapping_add);
            assert_eq!(word_sum(head, 3).wrapping_add(t), whole, "cut {cut}");
        }
    }

    /// Every single-bit flip, a swap of two words, a shortened buffer and a swap of
    /// two buffers change the checksum; equal inputs give equal checksums.
    #[test]
    fn parallel_checksum_detects_flips_swaps_and_lengths() {
        let a = bytes(258, 1);
        let b = bytes(64, 2);
        let base = entry_checksum(10, 2, &[&a, &b]);
        assert_eq!(base, entry_checksum(10, 2, &[&a.clone(), &b.clone()]));
        for i in 0..a.len() {
            for bit in 0..8 {
                let mut x = a.clone();
                x[i] ^= 1 << bit;
                assert_ne!(entry_checksum(10, 2, &[&x, &b]), base, "byte {i} bit {bit}");
            }
        }
        let mut sw = a.clone();
        sw.swap(0, 4);
        sw.swap(1, 5);
        sw.swap(2, 6);
        sw.swap(3, 7);
        assert_ne!(sw, a);
        assert_ne!(entry_checksum(10, 2, &[&sw, &b]), base);
        assert_ne!(entry_checksum(10, 2, &[&a[..256], &b]), base);
        assert_ne!(entry_checksum(10, 2, &[&b, &a]), base);
        assert_ne!(entry_checksum(10, 0, &[&a, &b]), base);
        // A trailing zero byte is not the same buffer as none.
        let mut z = a.clone();
        z.push(0);
        assert_ne!(buffer_hash(&z, 0), buffer_hash(&a, 0));
    }

    /// Fixed values, so that the kernel and this reference cannot drift together.
    #[test]
    fn parallel_checksum_known_values() {
        assert_eq!(mix64(0), 0);
        assert_eq!(word_sum(&[], 5), 0);
        assert_eq!(word_sum(&[1, 0, 0, 0], 0), mix64(1));
        assert_eq!(word_sum(&[1], 0), mix64(1));
        assert_eq!(
            word_sum(&[1, 2, 3, 4, 5], 2),
            mix64(0x0403_0201 ^ 2u64.wrapping_mul(K2))
                .wrapping_add(mix64(K1 ^ 2u64.wrapping_mul(K2) ^ 5))
        );
    }
}
