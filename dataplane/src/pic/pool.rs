//! Byte-accounted cache pools with pluggable admission and eviction.
//!
//! Used for the public pool of segment entries and the private pool of running-state
//! snapshots (DESIGN.md §5). The policy is a trait so that the control plane can plug
//! in Wasm policies; [`Lru`] is the built-in default.
use std::collections::HashMap;
use std::sync::Arc;

/// A 256-bit cache key (SHA-256 of the key material).
pub type Key = [u8; 32];

/// What a policy sees of one entry (or of a candidate for admission).
#[derive(Clone, Debug, PartialEq)]
pub struct EntryMeta {
    /// Cache key.
    pub key: Key,
    /// Payload bytes.
    pub bytes: usize,
    /// Hits since insertion.
    pub hits: u64,
    /// Logical clock of the last use (insert or hit); larger is more recent.
    pub last_use: u64,
    /// Logical clock at insertion.
    pub inserted: u64,
    /// Wall-clock time of the last use, milliseconds since the Unix epoch, made
    /// strictly increasing across the pool's events (two events in one millisecond
    /// get consecutive values) so that it orders uses like `last_use`.
    pub last_use_ms: u64,
    /// Wall-clock time of insertion, milliseconds since the Unix epoch (same stamp).
    pub inserted_ms: u64,
    /// Tokens that a miss would have to prefill again (recompute cost).
    pub tokens: usize,
    /// Isolation key of the owner (tenant salt), opaque to the pool.
    pub owner: String,
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Admission and eviction decisions of a pool.
pub trait CachePolicy: Send {
    /// Short name for metrics and logs.
    fn name(&self) -> &str;
    /// Whether a new entry may enter the pool (default: always). `owner_used_bytes`:
    /// bytes the candidate's owner (isolation namespace) already holds in this pool,
    /// for per-tenant quotas.
    fn admit(&mut self, _candidate: &EntryMeta, _owner_used_bytes: usize) -> bool {
        true
    }
    /// Index into `entries` of the entry to evict next, or `None` to refuse eviction
    /// (then the insertion fails). Called only with a non-empty slice.
    fn victim(&mut self, entries: &[EntryMeta]) -> Option<usize>;
}

/// Least-recently-used eviction, admit everything.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lru;

impl CachePolicy for Lru {
    fn name(&self) -> &str {
        "lru"
    }
    fn victim(&mut self, entries: &[EntryMeta]) -> Option<usize> {
        entries
            .iter()
            .enumerate()
            .min_by_key(|(_, m)| m.last_use)
            .map(|(i, _)| i)
    }
}

/// Counters of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Lookups that found an entry.
    pub hits: u64,
    /// Lookups that found none.
    pub misses: u64,
    /// Entries inserted.
    pub inserts: u64,
    /// Entries evicted for space.
    pub evictions: u64,
    /// Insertions refused (by admission, or too large, or no victim).
    pub rejected: u64,
}

/// Outcome of [`Pool::insert`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    /// Stored (possibly after evicting `evicted` entries).
    Stored {
        /// Entries evicted to make room.
        evicted: usize,
    },
    /// An entry with that key was already present; it was kept.
    Present,
    /// Not stored: the policy refused admission.
    NotAdmitted,
    /// Not stored: larger than the whole capacity, or the policy named no victim.
    NoRoom,
}

/// A pool of `Arc<V>` values with byte-accounted capacity.
pub struct Pool<V> {
    capacity: usize,
    used: usize,
    clock: u64,
    entries: HashMap<Key, (Arc<V>, EntryMeta)>,
    /// Bytes held per owner (entries with bytes > 0 only).
    by_owner: HashMap<String, usize>,
    /// Last wall-clock stamp handed out (ms), see [`EntryMeta::last_use_ms`].
    last_stamp_ms: u64,
    policy: Box<dyn CachePolicy>,
    stats: PoolStats,
}

impl<V> Pool<V> {
    /// Empty pool of `capacity` bytes with `policy`.
    pub fn new(capacity: usize, policy: Box<dyn CachePolicy>) -> Self {
        Pool {
            capacity,
            used: 0,
            clock: 0,
            entries: HashMap::new(),
            by_owner: HashMap::new(),
            last_stamp_ms: 0,
            policy,
            stats: PoolStats::default(),
        }
    }

    /// Replaces the policy (entries are kept).
    pub fn set_policy(&mut self, policy: Box<dyn CachePolicy>) {
        self.policy = policy;
    }

    /// Name of the active policy.
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// Looks `key` up, counting a hit or a miss and refreshing recency on a hit.
    pub fn get(&mut self, key: &Key) -> Option<Arc<V>> {
        self.clock += 1;
        let stamp = self.stamp_ms();
        match self.entries.get_mut(key) {
            Some((v, m)) => {
                m.hits += 1;
                m.last_use = self.clock;
                m.last_use_ms = stamp;
                self.stats.hits += 1;
                Some(v.clone())
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Metadata of the entry under `key`, if resident (O(1); not counted as a lookup
    /// and does not touch its recency).
    pub fn meta(&self, key: &Key) -> Option<&EntryMeta> {
        self.entries.get(key).map(|(_, m)| m)
    }

    /// True when `key` is present (no statistics, no recency change).
    pub fn contains(&self, key: &Key) -> bool {
        self.entries.contains_key(key)
    }

    /// Inserts `value` of `bytes` bytes, evicting per the policy until it fits.
    pub fn insert(
        &mut self,
        key: Key,
        value: Arc<V>,
        bytes: usize,
        tokens: usize,
        owner: &str,
    ) -> Insert {
        if self.entries.contains_key(&key) {
            return Insert::Present;
        }
        self.clock += 1;
        let stamp = self.stamp_ms();
        let meta = EntryMeta {
            key,
            bytes,
            hits: 0,
            last_use: self.clock,
            inserted: self.clock,
            last_use_ms: stamp,
            inserted_ms: stamp,
            tokens,
            owner: owner.to_string(),
        };
        if !self.policy.admit(&meta, self.owner_bytes(owner)) {
            self.stats.rejected += 1;
            return Insert::NotAdmitted;
        }
        if bytes > self.capacity {
            self.stats.rejected += 1;
            return Insert::NoRoom;
        }
        let mut evicted = 0;
        while self.used + bytes > self.capacity {
            let metas: Vec<EntryMeta> = self.entries.values().map(|(_, m)| m.clone()).collect();
            let victim = match self.policy.victim(&metas) {
                Some(i) if i < metas.len() => metas[i].key,
                _ => {
                    self.stats.rejected += 1;
                    return Insert::NoRoom;
                }
            };
            self.remove(&victim);
            self.stats.evictions += 1;
            evicted += 1;
        }
        self.used += bytes;
        *self.by_owner.entry(meta.owner.clone()).or_default() += bytes;
        self.entries.insert(key, (value, meta));
        self.stats.inserts += 1;
        Insert::Stored { evicted }
    }

    /// Removes `key`; returns whether it was present.
    pub fn remove(&mut self, key: &Key) -> bool {
        match self.entries.remove(key) {
            Some((_, m)) => {
                self.used -= m.bytes;
                if let Some(b) = self.by_owner.get_mut(&m.owner) {
                    *b -= m.bytes;
                    if *b == 0 {
                        self.by_owner.remove(&m.owner);
                    }
                }
                true
            }
            None => false,
        }
    }

    /// Removes every entry whose owner equals `owner`; returns how many.
    pub fn remove_owner(&mut self, owner: &str) -> usize {
        let keys: Vec<Key> = self
            .entries
            .iter()
            .filter(|(_, (_, m))| m.owner == owner)
            .map(|(k, _)| *k)
            .collect();
        keys.iter().for_each(|k| {
            self.remove(k);
        });
        keys.len()
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.by_owner.clear();
        self.used = 0;
    }

    /// The next wall-clock stamp: now in ms, or one more than the last stamp.
    fn stamp_ms(&mut self) -> u64 {
        self.last_stamp_ms = unix_ms().max(self.last_stamp_ms + 1);
        self.last_stamp_ms
    }

    /// Bytes held by entries of `owner`.
    pub fn owner_bytes(&self, owner: &str) -> usize {
        self.by_owner.get(owner).copied().unwrap_or(0)
    }

    /// Metadata of every entry (unordered).
    pub fn entries(&self) -> Vec<EntryMeta> {
        self.entries.values().map(|(_, m)| m.clone()).collect()
    }

    /// Bytes in use.
    pub fn used_bytes(&self) -> usize {
        self.used
    }
    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> usize {
        self.capacity
    }
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Counters.
    pub fn stats(&self) -> PoolStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> Key {
        [i; 32]
    }

    #[test]
    fn lru_evicts_least_recent_and_accounts_bytes() {
        let mut p: Pool<u32> = Pool::new(100, Box::new(Lru));
        assert_eq!(
            p.insert(k(1), Arc::new(1), 40, 10, "a"),
            Insert::Stored { evicted: 0 }
        );
        assert_eq!(
            p.insert(k(2), Arc::new(2), 40, 10, "a"),
            Insert::Stored { evicted: 0 }
        );
        assert_eq!(p.used_bytes(), 80);
        assert_eq!((p.owner_bytes("a"), p.owner_bytes("b")), (80, 0));
        // Wall-clock stamps: strictly increasing, and near now.
        let (t1, t2) = (
            p.meta(&k(1)).map(|m| m.inserted_ms),
            p.meta(&k(2)).map(|m| m.inserted_ms),
        );
        assert!(t1 < t2, "{t1:?} {t2:?}");
        assert!(t2.unwrap_or(0).abs_diff(unix_ms()) < 60_000);
        let lookups = p.stats().hits + p.stats().misses;
        assert_eq!(
            p.meta(&k(2)).map(|m| (m.bytes, m.owner.as_str())),
            Some((40, "a"))
        );
        assert!(p.meta(&k(3)).is_none());
        assert_eq!(
            p.stats().hits + p.stats().misses,
            lookups,
            "meta is not a lookup"
        );
        assert!(p.get(&k(1)).is_some()); // 1 is now more recent than 2
        assert_eq!(
            p.insert(k(3), Arc::new(3), 40, 10, "a"),
            Insert::Stored { evicted: 1 }
        );
        assert!(p.contains(&k(1)) && !p.contains(&k(2)) && p.contains(&k(3)));
        assert_eq!(p.used_bytes(), 80);
        assert_eq!(p.stats().evictions, 1);
        assert_eq!(p.insert(k(4), Arc::new(4), 101, 10, "a"), Insert::NoRoom);
        assert_eq!(p.insert(k(1), Arc::new(9), 1, 1, "a"), Insert::Present);
        assert_eq!(*p.get(&k(1)).unwrap(), 1);
        assert!(p.get(&k(2)).is_none());
        assert_eq!(p.stats().hits, 2);
        assert_eq!(p.stats().misses, 1);
    }

    struct Never;
    impl CachePolicy for Never {
        fn name(&self) -> &str {
            "never"
        }
        fn admit(&mut self, c: &EntryMeta, _owner_used_bytes: usize) -> bool {
            c.tokens > 5
        }
        fn victim(&mut self, _: &[EntryMeta]) -> Option<usize> {
            None
        }
    }

    #[test]
    fn policy_controls_admission_and_eviction() {
        let mut p: Pool<u32> = Pool::new(50, Box::new(Never));
        assert_eq!(p.insert(k(1), Arc::new(1), 10, 3, "a"), Insert::NotAdmitted);
        assert_eq!(
            p.insert(k(1), Arc::new(1), 40, 30, "a"),
            Insert::Stored { evicted: 0 }
        );
        assert_eq!(p.insert(k(2), Arc::new(2), 40, 30, "a"), Insert::NoRoom);
        assert_eq!(p.stats().rejected, 2);
        assert_eq!(p.remove_owner("a"), 1);
        assert_eq!(p.used_bytes(), 0);
    }
}
