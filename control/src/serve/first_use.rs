//! The `shared_first_use` isolation option: what a tenant's first use of a
//! shared (public) cache entry costs.
//!
//! * `share` (default): the entry is used as is. A tenant can tell from the
//!   latency (or the segment's `outcome`) whether another tenant used the public
//!   segment recently: a hit means someone did.
//! * `recompute`: the first time a tenant uses a shared entry (one segment
//!   version, at one body start, in one namespace) the server drops the entry
//!   and the request recomputes and stores it again, so that use costs what a
//!   miss costs whatever other tenants did; the tenant is recorded as having
//!   paid, and its later uses hit the entry it rebuilt (or whatever is resident
//!   then). The drop takes every role's entry and leaves no departure record,
//!   so the segment's `miss_reason` is `never_seen` whether the entry was cached
//!   or cold. Each tenant pays one recomputation per shared entry; other tenants
//!   using the entry at the same moment may miss once.
//!
//! The record of who paid is bounded ([`FIRST_USE_MAX_TRACKED`]); a forgotten
//! record only makes that tenant pay again.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use dataplane::engine::EnginePools;
use dataplane::pic::Mode;
use sha2::{Digest, Sha256};

use super::bounded::BoundedMap;
use super::routes::Resolved;

/// Values of `shared_first_use`.
pub const FIRST_USE_CHOICES: [&str; 2] = ["share", "recompute"];

/// Most (tenant, shared entry) pairs remembered as paid.
pub const FIRST_USE_MAX_TRACKED: usize = 1 << 18;

/// Which tenants already paid for which shared entries.
#[derive(Debug)]
pub struct FirstUse {
    recompute: bool,
    paid: Mutex<BoundedMap<[u8; 32], ()>>,
    forced: AtomicU64,
}

impl FirstUse {
    /// The option from its configured value (`recompute` turns it on).
    pub fn new(setting: &str) -> FirstUse {
        FirstUse {
            recompute: setting == "recompute",
            paid: Mutex::new(BoundedMap::new(
                FIRST_USE_MAX_TRACKED,
                FIRST_USE_MAX_TRACKED,
                |_| 1,
            )),
            forced: AtomicU64::new(0),
        }
    }

    /// Whether first uses are recomputed.
    pub fn enabled(&self) -> bool {
        self.recompute
    }

    /// First uses turned into recomputations so far.
    pub fn forced(&self) -> u64 {
        self.forced.load(Ordering::Relaxed)
    }

    /// Before `segs` (one prompt of `tenant`, in `mode`) is scheduled: drops
    /// each shared entry the prompt would read from the public pool that this
    /// tenant has not used before, so that the request recomputes it. Returns
    /// how many entries were dropped.
    pub fn apply(
        &self,
        engine: &dyn EnginePools,
        tenant: &str,
        mode: Mode,
        segs: &[Resolved],
    ) -> usize {
        if !self.recompute {
            return 0;
        }
        let mut dropped = 0;
        for (i, r) in segs.iter().enumerate() {
            let Some(body_start) = pool_body_start(mode, i, segs.len(), r.tokens.len()) else {
                continue;
            };
            if !r.shared {
                continue;
            }
            let key = paid_key(tenant, &r.isolation, body_start, &r.tokens);
            {
                let mut paid = self.paid.lock().unwrap_or_else(|p| p.into_inner());
                if paid.get(&key).is_some() {
                    continue;
                }
                paid.insert(key, ());
            }
            self.forced.fetch_add(1, Ordering::Relaxed);
            // Every role a miss builds goes, or the role left behind would show in
            // the next miss's reason (`role_mismatch`) that another tenant used it.
            let mut roles = mode.entry_body_starts(r.tokens.len());
            if !roles.contains(&body_start) {
                roles.push(body_start);
            }
            dropped += engine.forget_segment(&r.tokens, &r.isolation, &roles);
        }
        dropped
    }
}

/// The body start at which segment `i` of `n` (of `m` tokens) is read from the
/// public pool in `mode`, or `None` when it is computed in place (the last
/// segment, full recompute, prefix cache, a segment no longer than the seam).
fn pool_body_start(mode: Mode, i: usize, n: usize, m: usize) -> Option<usize> {
    if i + 1 == n {
        return None;
    }
    match mode {
        Mode::FullRecompute | Mode::PrefixCache => None,
        Mode::NaiveAddition => Some(0),
        Mode::Hypic { seam_width, .. } => {
            let b = if i > 0 { seam_width } else { 0 };
            (b < m).then_some(b)
        }
    }
}

fn paid_key(tenant: &str, isolation: &str, body_start: usize, tokens: &[u32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"hypic-first-use-v1\0");
    for part in [tenant.as_bytes(), isolation.as_bytes()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update((body_start as u64).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_segments_read_from_the_pool_count() {
        let h = Mode::Hypic {
            seam_width: 8,
            rope_fix: true,
        };
        assert_eq!(pool_body_start(h, 0, 3, 20), Some(0));
        assert_eq!(pool_body_start(h, 1, 3, 20), Some(8));
        assert_eq!(pool_body_start(h, 1, 3, 8), None);
        assert_eq!(pool_body_start(h, 2, 3, 20), None);
        assert_eq!(pool_body_start(Mode::PrefixCache, 0, 3, 20), None);
        assert_eq!(pool_body_start(Mode::NaiveAddition, 1, 3, 20), Some(0));
    }
}
