//! Bounded in-memory maps for the server's caches of catalog data, so that no
//! sequence of requests can grow them without limit.
//!
//! [`BoundedMap`] keeps at most a number of entries and a total weight (e.g.
//! tokens) and drops the oldest insertions first; [`KeySet`] is a set of
//! strings with a cap on its size. Both answer `get`-style lookups through a
//! shared reference (lookups do not refresh an entry), and a dropped entry only
//! costs a recomputation (tokenising a segment again) or leaves a cache entry
//! to ordinary eviction.
use std::borrow::Borrow;
use std::collections::BTreeSet;
use std::hash::Hash;

/// A map holding at most `max_entries` entries and `max_weight` total weight
/// (`weight` of each value, at least 1 per entry); inserting past either bound
/// drops the oldest insertions first. A single value heavier than
/// `max_weight` is not kept.
pub struct BoundedMap<K: Hash + Eq, V> {
    /// Values with the weight they were charged at insertion.
    map: hashlink::LinkedHashMap<K, (V, usize)>,
    weight: fn(&V) -> usize,
    max_entries: usize,
    max_weight: usize,
    total: usize,
}

impl<K: Hash + Eq, V> std::fmt::Debug for BoundedMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundedMap")
            .field("entries", &self.map.len())
            .field("weight", &self.total)
            .field("max_entries", &self.max_entries)
            .field("max_weight", &self.max_weight)
            .finish()
    }
}

impl<K: Hash + Eq, V> BoundedMap<K, V> {
    /// An empty map with the given bounds and weight function.
    pub fn new(max_entries: usize, max_weight: usize, weight: fn(&V) -> usize) -> Self {
        BoundedMap {
            map: hashlink::LinkedHashMap::new(),
            weight,
            max_entries: max_entries.max(1),
            max_weight: max_weight.max(1),
            total: 0,
        }
    }

    /// Inserts (replacing an older value under `key`), then drops the oldest
    /// entries until both bounds hold. Returns the replaced value.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let old = self.remove(&key);
        let w = (self.weight)(&value).max(1);
        if w > self.max_weight {
            return old;
        }
        while self.map.len() >= self.max_entries || self.total + w > self.max_weight {
            match self.map.pop_front() {
                Some((_, (_, vw))) => self.total -= vw,
                None => break,
            }
        }
        self.total += w;
        self.map.insert(key, (value, w));
        old
    }

    /// The value under `key`.
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.map.get(key).map(|(v, _)| v)
    }

    /// Removes and returns the value under `key`.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (v, w) = self.map.remove(key)?;
        self.total -= w;
        Some(v)
    }

    /// The entry under `key`, to fill with [`BoundedEntry::or_default`].
    pub fn entry(&mut self, key: K) -> BoundedEntry<'_, K, V> {
        BoundedEntry { map: self, key }
    }

    /// Entries, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.map.iter().map(|(k, (v, _))| (k, v))
    }

    /// Keys, oldest first.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.map.keys()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Total weight held.
    pub fn weight(&self) -> usize {
        self.total
    }

    /// Removes everything.
    pub fn clear(&mut self) {
        self.map.clear();
        self.total = 0;
    }
}

/// An entry of a [`BoundedMap`] (see [`BoundedMap::entry`]).
pub struct BoundedEntry<'a, K: Hash + Eq, V> {
    map: &'a mut BoundedMap<K, V>,
    key: K,
}

impl<'a, K: Hash + Eq + Clone, V: Default> BoundedEntry<'a, K, V> {
    /// The value under the key, inserting the default first when absent. The
    /// value stays charged at the weight it had when inserted: use it for values
    /// that bound themselves (such as [`KeySet`]).
    pub fn or_default(self) -> &'a mut V {
        if self.map.get(&self.key).is_none() {
            self.map.insert(self.key.clone(), V::default());
        }
        &mut self
            .map
            .map
            .get_mut(&self.key)
            .expect("inserted above (a default value is never heavier than the bound)")
            .0
    }
}

/// Most strings a [`KeySet`] holds.
pub const KEY_SET_CAP: usize = 64;

/// A set of at most [`KEY_SET_CAP`] strings; inserting into a full set drops its
/// smallest element first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeySet(BTreeSet<String>);

impl KeySet {
    /// Adds `key`; returns whether it was new.
    pub fn insert(&mut self, key: String) -> bool {
        if self.0.contains(&key) {
            return false;
        }
        if self.0.len() >= KEY_SET_CAP {
            self.0.pop_first();
        }
        self.0.insert(key)
    }

    /// The strings, in order.
    pub fn iter(&self) -> impl Iterator<Item = &String> {
        self.0.iter()
    }

    /// Strings held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_map_keeps_both_bounds() {
        let mut m: BoundedMap<u32, Vec<u8>> = BoundedMap::new(4, 10, |v| v.len());
        for i in 0..100 {
            m.insert(i, vec![0; 3]);
            assert!(m.len() <= 4 && m.weight() <= 10, "{m:?}");
        }
        assert_eq!(m.len(), 3, "weight 10 holds three of weight 3");
        assert!(m.get(&99).is_some() && m.get(&96).is_none());
        assert_eq!(m.remove(&99).map(|v| v.len()), Some(3));
        assert_eq!(m.weight(), 6);
        m.insert(7, vec![0; 11]); // heavier than the whole bound: not kept
        assert!(m.get(&7).is_none());
        m.entry(8).or_default().push(1);
        assert_eq!(m.get(&8), Some(&vec![1]));
        m.clear();
        assert_eq!((m.len(), m.weight()), (0, 0));
    }

    #[test]
    fn key_set_is_capped() {
        let mut s = KeySet::default();
        for i in 0..1000 {
            s.insert(format!("{i:04}"));
        }
        assert_eq!(s.len(), KEY_SET_CAP);
        assert!(!s.insert("0999".into()));
    }
}
