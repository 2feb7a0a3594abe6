//! The PIC request path over an ordered list of segments.
//!
//! Modes (docs/pic-design.md §5.2):
//! * `FullRecompute` — every segment is prefilled, in order, from the running state.
//! * `PrefixCache` — exact-prefix reuse: running states (fp32, whole model) are
//!   snapshotted at segment boundaries in the private pool and restored on the
//!   longest matching segment prefix, as SGLang's hybrid radix cache and vLLM's align
//!   mode do. Bit-identical to `FullRecompute`, which uses the same span boundaries.
//! * `NaiveAddition` — linear layers add each segment's zero-start state
//!   (`S ← S + S_C|0`), full-attention layers take its re-rotated KV; no seams.
//! * `Hypic { seam_width, rope_fix }` — the paper's method: the first segment is
//!   reused whole, every middle segment recomputes its first `w` tokens (the seam
//!   window) through the whole stack from the composed running state, then jumps over
//!   its body with `S ← T_body S + S_body|0` and appends the body KV re-rotated by
//!   `R(b − 0)` (or not re-rotated when `rope_fix` is off); the last (query) segment
//!   is computed. Misses are prefilled alone to build their entry, then used.
//!
//! In every mode but `FullRecompute`, the private pool is checked first: a request
//! whose whole segment sequence was seen (in the same mode) is a full hit.
use super::backend::{CacheEntry, PicBackend};
use super::cpu::CpuBackend;
use super::pool::{
    CachePolicy, Departure, EntryMeta, Insert, Key, Lru, Pool, PoolEvent, PoolStats, Tier,
};
use super::spill::Spill;
use crate::error::{Error, Result};
use crate::linear::transition::Pair;
use crate::state::ModelState;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::sync::{Arc, Mutex, MutexGuard};

/// Reuse mode of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Prefill everything.
    FullRecompute,
    /// Exact-prefix reuse of segment-boundary snapshots.
    PrefixCache,
    /// Sum of zero-start states, no seams (the structurally wrong baseline).
    NaiveAddition,
    /// HYPIC: cached transitions, seam windows, RoPE re-rotation.
    Hypic {
        /// Seam window `w` in tokens (paper default 8).
        seam_width: usize,
        /// Re-rotate cached keys to their new position (`false`: ablation).
        rope_fix: bool,
    },
}

impl Mode {
    /// The paper's default: `Hypic { seam_width: 8, rope_fix: true }`.
    pub fn hypic_default() -> Self {
        Mode::Hypic {
            seam_width: 8,
            rope_fix: true,
        }
    }
    /// Body start of the public-pool entry that serves the segment at `index` of a
    /// request: the seam width `w` for a middle segment in HYPIC mode, else 0 (the
    /// first segment, reused whole; naive addition).
    pub fn body_start(&self, index: usize) -> usize {
        match self {
            Mode::Hypic { seam_width, .. } if index > 0 => *seam_width,
            _ => 0,
        }
    }

    /// Body starts of the entries a public-pool miss on a segment of `len` tokens
    /// builds, in the order they are built (one prefill): in HYPIC mode with
    /// `0 < w < len` both roles a segment can take, `[0, w]` (first in a request:
    /// whole; after another segment: body from `w`), so that a reordered request
    /// finds the entry of the other role; otherwise `[0]` (a middle segment of at
    /// most `w` tokens is computed, never cached). Empty for modes without a public
    /// pool.
    pub fn entry_body_starts(&self, len: usize) -> Vec<usize> {
        match self {
            Mode::FullRecompute | Mode::PrefixCache => vec![],
            Mode::Hypic { seam_width, .. } if *seam_width > 0 && *seam_width < len => {
                vec![0, *seam_width]
            }
            _ => vec![0],
        }
    }

    /// Mode tag hashed into private-pool keys.
    pub(crate) fn tag(&self) -> String {
        match self {
            Mode::FullRecompute => "full".into(),
            Mode::PrefixCache => "prefix".into(),
            Mode::NaiveAddition => "naive".into(),
            Mode::Hypic {
                seam_width,
                rope_fix,
            } => format!("hypic:{seam_width}:{rope_fix}"),
        }
    }
}

/// One segment of a request: its tokens and the isolation key that scopes its
/// public-pool entry. The isolation key is supplied by the caller (the control plane
/// derives it from the verified tenant and the segment's grants), never derived from
/// request text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentRef {
    /// Token ids (non-empty).
    pub tokens: Vec<u32>,
    /// Isolation key (tenant salt, or a shared key for explicitly shared segments).
    pub isolation: String,
}

/// How one segment was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Prefilled in place (full recompute, the query, or a seam covering it all).
    Computed,
    /// Restored from a private-pool snapshot of the running state.
    PrefixHit,
    /// Public-pool entry found and composed.
    Hit,
    /// No entry: prefilled alone to build one, then composed.
    Miss,
}

/// Why a segment was not reused although the mode reuses work: set on every
/// [`Outcome::Miss`], and on a [`Outcome::Computed`] segment that is not the query
/// (the last) in a reuse mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissReason {
    /// No entry of this segment (tokens and isolation key) in any role, and none
    /// left the pool recently: first use, or forgotten.
    NeverSeen,
    /// The entry was evicted for space (from the pool and its spill tier).
    Evicted,
    /// The entry was removed on purpose: segment update or deletion, grant
    /// revocation, invalidation sweep.
    Invalidated,
    /// The entry's spilled copy failed its checksum on restore.
    Damaged,
    /// The entry was built before but the pool refused to store it (admission
    /// policy or quota, or larger than the pool).
    NotAdmitted,
    /// An entry of this segment exists only for the other role (whole vs body from
    /// the seam width): built ahead of time for one role, or the other role's entry
    /// was refused or evicted alone.
    RoleMismatch,
    /// HYPIC mode, a middle segment no longer than the seam width: computed whole,
    /// never cached.
    TooShortForSeam,
    /// Prefix-cache mode: no snapshot of the running state after this segment
    /// prefix (the prefix differs from every cached one).
    PrivatePrefixMiss,
}

impl MissReason {
    /// Every reason, in declaration order.
    pub const ALL: [MissReason; 8] = [
        MissReason::NeverSeen,
        MissReason::Evicted,
        MissReason::Invalidated,
        MissReason::Damaged,
        MissReason::NotAdmitted,
        MissReason::RoleMismatch,
        MissReason::TooShortForSeam,
        MissReason::PrivatePrefixMiss,
    ];

    /// The snake_case name (metric label, JSON value).
    pub fn as_str(&self) -> &'static str {
        match self {
            MissReason::NeverSeen => "never_seen",
            MissReason::Evicted => "evicted",
            MissReason::Invalidated => "invalidated",
            MissReason::Damaged => "damaged",
            MissReason::NotAdmitted => "not_admitted",
            MissReason::RoleMismatch => "role_mismatch",
            MissReason::TooShortForSeam => "too_short_for_seam",
            MissReason::PrivatePrefixMiss => "private_prefix_miss",
        }
    }

    /// The reason remembered for a key that left a pool.
    fn of_departure(d: Departure) -> Self {
        match d {
            Departure::Evicted => MissReason::Evicted,
            Departure::Removed => MissReason::Invalidated,
            Departure::Damaged => MissReason::Damaged,
            Departure::Refused => MissReason::NotAdmitted,
        }
    }
}

/// Per-segment statistics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SegmentStat {
    /// Position of the segment in the request.
    pub index: usize,
    /// Its token count.
    pub tokens: usize,
    /// How it was served.
    pub outcome: Outcome,
    /// Tokens run through the model for it (entry build + seam window, or all).
    pub computed: usize,
    /// Tokens whose work was reused.
    pub reused: usize,
    /// SHA-256 of the model id and the segment's tokens (hex).
    pub content_hash: String,
    /// Why it was not reused, see [`MissReason`] (`None` for hits, the query and
    /// full recompute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub miss_reason: Option<MissReason>,
}

/// Request statistics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PicStats {
    /// Tokens run through the model.
    pub tokens_computed: usize,
    /// Tokens whose work was reused.
    pub tokens_reused: usize,
    /// Segments served from a pool (public hits and prefix hits).
    pub hits: usize,
    /// Segments that missed the public pool.
    pub misses: usize,
    /// One entry per segment, in request order.
    pub segments: Vec<SegmentStat>,
}

/// Result of [`Pic::run`] over a backend whose running state is `S`.
#[derive(Clone, Debug)]
pub struct PicOutput<S = ModelState> {
    /// Logits of the prompt's last token, `[vocab]` (host, fp32).
    pub logits: Vec<f32>,
    /// Running state after the prompt, ready for decode.
    pub state: S,
    /// Statistics.
    pub stats: PicStats,
}

/// Cached data of one layer for a segment body.
#[derive(Clone, Debug)]
pub enum EntryLayer {
    /// Linear-attention layer: the body pair and the segment's conv tail
    /// `[conv_dim, K−1]` (empty for a mixer without a conv).
    Linear {
        /// `(T_body, S_body|0 [Hv,dk,dv])`, fp32, in the storage form of the layer
        /// mixer's transition family (`MixerKind::transition_kind`; Gated DeltaNet:
        /// dense, `T_body [Hv,dk,dk]`), which the backends check before composing.
        pair: Pair,
        /// Last `K−1` conv inputs of the segment.
        conv_tail: Vec<f32>,
    },
    /// Full-attention layer: body K (rotated to in-segment positions `body_start..`)
    /// and V, `[m − body_start, Hkv, hd]` each.
    Full {
        /// Keys.
        k: Vec<f32>,
        /// Values.
        v: Vec<f32>,
    },
}

/// A public-pool entry: one segment prefilled alone, body from `body_start`.
#[derive(Clone, Debug)]
pub struct SegmentEntry {
    /// First body token (the seam width used to build it; 0 = the whole segment).
    pub body_start: usize,
    /// Segment length in tokens.
    pub len: usize,
    /// One entry per decoder layer.
    pub layers: Vec<EntryLayer>,
}

impl SegmentEntry {
    /// Payload bytes (fp32 pairs, conv tails and KV).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                EntryLayer::Linear { pair, conv_tail } => pair.bytes() + 4 * conv_tail.len(),
                EntryLayer::Full { k, v } => 4 * (k.len() + v.len()),
            })
            .sum()
    }
}

impl CacheEntry for SegmentEntry {
    fn body_start(&self) -> usize {
        self.body_start
    }
    fn bytes(&self) -> usize {
        SegmentEntry::bytes(self)
    }
}

/// A private-pool snapshot: the running state after a segment prefix (a host
/// [`ModelState`] on the CPU, a device state on the GPU).
#[derive(Clone, Debug)]
pub struct Snapshot<S = ModelState> {
    /// Whole-model state (as the cold path keeps it).
    pub state: S,
    /// Last-token logits of the prefix, when it was a whole prompt (host, fp32).
    pub logits: Option<Vec<f32>>,
}

/// Default byte capacities of the pools.
pub const DEFAULT_PUBLIC_BYTES: usize = 1 << 30;
/// See [`DEFAULT_PUBLIC_BYTES`].
pub const DEFAULT_PRIVATE_BYTES: usize = 1 << 30;

/// The PIC engine over a backend `B`: the backend's model plus its public pool of
/// segment entries and its private pool of running-state snapshots. The request
/// logic lives here once; [`PicEngine`] is the CPU reference, `cuda::pic::GpuPicEngine`
/// (feature `cuda`) the device engine.
pub struct Pic<B: PicBackend> {
    pub(crate) backend: B,
    model_id: String,
    public: Mutex<Pool<B::Entry>>,
    private: Mutex<Pool<Snapshot<B::State>>>,
}

/// The CPU PIC engine (the executable reference of the GPU's).
pub type PicEngine = Pic<CpuBackend>;

fn for_each_spilled<V>(p: &mut Pool<V>, mut f: impl FnMut(&mut Pool<V>, &Key)) {
    for k in p.spilled_keys() {
        f(p, &k);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<B: PicBackend> Pic<B> {
    /// Engine over `backend` (its model identified by `model_id` in cache keys) with
    /// LRU pools of the given byte capacities.
    pub fn with_backend(
        backend: B,
        model_id: &str,
        public_bytes: usize,
        private_bytes: usize,
    ) -> Self {
        Pic {
            backend,
            model_id: model_id.to_string(),
            public: Mutex::new(Pool::new(public_bytes, Box::new(Lru))),
            private: Mutex::new(Pool::new(private_bytes, Box::new(Lru))),
        }
    }

    /// The backend.
    pub fn pic_backend(&self) -> &B {
        &self.backend
    }

    /// Replaces the public pool's policy.
    pub fn set_public_policy(&self, p: Box<dyn CachePolicy>) {
        lock(&self.public).set_policy(p);
    }
    /// Replaces the private pool's policy.
    pub fn set_private_policy(&self, p: Box<dyn CachePolicy>) {
        lock(&self.private).set_policy(p);
    }

    /// Gives the public and private pools host spill tiers of the given byte
    /// capacities (0: none): entries evicted for space are kept as checksummed
    /// blobs and restored on a later hit after the checksum verifies
    /// ([`super::spill`]).
    pub fn enable_spill(&self, public_bytes: usize, private_bytes: usize)
    where
        Snapshot<B::State>: Spill,
    {
        lock(&self.public).enable_spill(public_bytes);
        lock(&self.private).enable_spill(private_bytes);
    }

    /// `(entries, bytes, capacity)` of the public and private spill tiers.
    pub fn spill_usage(&self) -> [(usize, usize, usize); 2] {
        [
            lock(&self.public).spill_usage(),
            lock(&self.private).spill_usage(),
        ]
    }

    /// Fault injection for tests: damages every spilled blob of both pools (one bit
    /// at byte `at`); returns how many were damaged.
    #[doc(hidden)]
    pub fn damage_spilled(&self, at: usize) -> usize {
        let mut n = 0;
        for_each_spilled(&mut lock(&self.public), |p, k| {
            n += p.damage_spilled(k, at) as usize
        });
        for_each_spilled(&mut lock(&self.private), |p, k| {
            n += p.damage_spilled(k, at) as usize
        });
        n
    }

    /// `(entries, bytes, stats)` of the public pool.
    pub fn public_usage(&self) -> (usize, usize, PoolStats) {
        let p = lock(&self.public);
        (p.len(), p.used_bytes(), p.stats())
    }
    /// `(entries, bytes, stats)` of the private pool.
    pub fn private_usage(&self) -> (usize, usize, PoolStats) {
        let p = lock(&self.private);
        (p.len(), p.used_bytes(), p.stats())
    }

    /// Drops every cached entry and snapshot owned by `isolation` (e.g. on grant
    /// revocation or segment update); returns how many were removed.
    pub fn invalidate_owner(&self, isolation: &str) -> usize {
        lock(&self.public).remove_owner(isolation) + lock(&self.private).remove_owner(isolation)
    }

    /// Clears both pools.
    pub fn clear(&self) {
        lock(&self.public).clear();
        lock(&self.private).clear();
    }

    /// SHA-256 (hex) of the model id and a segment's tokens.
    pub fn content_hash(&self, tokens: &[u32]) -> String {
        hex::encode(self.content_key(tokens))
    }

    fn content_key(&self, tokens: &[u32]) -> Key {
        content_key(&self.model_id, tokens)
    }

    pub(crate) fn validate(&self, segments: &[SegmentRef]) -> Result<()> {
        validate_segments(self.backend.config(), segments)
    }

    fn get_public(&self, key: &Key) -> Option<Arc<B::Entry>> {
        self.backend.decoding(|| lock(&self.public).get(key))
    }

    /// Serves one request: prefix/PIC reuse per `mode`, then the query segment.
    ///
    /// `tenant` scopes the private pool (running states are never shared across
    /// tenants); each segment's `isolation` scopes its public-pool entry. A run of
    /// consecutive composed segments (public hits and misses) goes to the backend
    /// together ([`PicBackend::compose_run`]); a computed segment (the query, every
    /// segment of full recompute and prefix cache, a middle segment inside its seam
    /// window) is prefilled on its own.
    ///
    /// Errors: no segments, an empty segment, a token outside the vocabulary, a prompt
    /// over the context limit ([`Error::Input`]); backend failures.
    pub fn run(
        &self,
        segments: &[SegmentRef],
        mode: Mode,
        tenant: &str,
    ) -> Result<PicOutput<B::State>> {
        self.validate(segments)?;
        let be = &self.backend;
        let n = segments.len();
        let contents: Vec<Key> = segments
            .iter()
            .map(|s| self.content_key(&s.tokens))
            .collect();
        let mut stats = PicStats::default();
        let stat = |i: usize, outcome: Outcome, computed: usize, reused: usize| SegmentStat {
            index: i,
            tokens: segments[i].tokens.len(),
            outcome,
            computed,
            reused,
            content_hash: hex::encode(contents[i]),
            miss_reason: None,
        };
        let use_private = mode != Mode::FullRecompute && mode != Mode::NaiveAddition;
        let pkeys = if use_private {
            prefix_keys(&self.model_id, &mode, tenant, &contents, segments)
        } else {
            vec![]
        };

        // 1. Longest private-pool prefix.
        let mut state = be.new_state()?;
        let mut start = 0usize;
        if use_private {
            let mut pool = lock(&self.private);
            for i in (1..=n).rev() {
                if !pool.contains(&pkeys[i - 1]) {
                    continue;
                }
                // A spilled snapshot whose checksum fails is dropped: a miss.
                let Some(snap) = be.decoding(|| pool.get(&pkeys[i - 1])) else {
                    continue;
                };
                if i == n {
                    let Some(logits) = snap.logits.clone() else {
                        continue;
                    };
                    drop(pool);
                    for (j, s) in segments.iter().enumerate() {
                        stats
                            .segments
                            .push(stat(j, Outcome::PrefixHit, 0, s.tokens.len()));
                    }
                    stats.hits = n;
                    stats.tokens_reused = segments.iter().map(|s| s.tokens.len()).sum();
                    return Ok(PicOutput {
                        logits,
                        state: be.clone_state(&snap.state)?,
                        stats,
                    });
                }
                state = be.clone_state(&snap.state)?;
                start = i;
                for (j, s) in segments[..i].iter().enumerate() {
                    stats
                        .segments
                        .push(stat(j, Outcome::PrefixHit, 0, s.tokens.len()));
                }
                break;
            }
        }

        // 2. Remaining segments.
        let rope_fix = match mode {
            Mode::Hypic { rope_fix, .. } => rope_fix,
            _ => true,
        };
        let naive = mode == Mode::NaiveAddition;
        let compute_here = |i: usize| {
            i + 1 == n
                || matches!(mode, Mode::FullRecompute | Mode::PrefixCache)
                || (matches!(mode, Mode::Hypic { .. })
                    && mode.body_start(i) >= segments[i].tokens.len())
        };
        let mut logits = vec![];
        let mut i = start;
        while i < n {
            if compute_here(i) {
                let seg = &segments[i];
                let last = i + 1 == n;
                logits = be.prefill(&seg.tokens, &mut state, last)?;
                let reason = computed_reason(&mode, last, || {
                    use_private
                        .then(|| lock(&self.private).departure(&pkeys[i]))
                        .flatten()
                });
                stats.segments.push(SegmentStat {
                    miss_reason: reason,
                    ..stat(i, Outcome::Computed, seg.tokens.len(), 0)
                });
                if use_private {
                    let snap = Snapshot {
                        state: be.clone_state(&state)?,
                        logits: if last { Some(logits.clone()) } else { None },
                    };
                    let bytes = B::state_bytes(&snap.state) + 4 * logits.len();
                    lock(&self.private).insert(pkeys[i], Arc::new(snap), bytes, 0, tenant);
                }
                i += 1;
                continue;
            }
            let mut j = i;
            let mut entries = vec![];
            while j < n && !compute_here(j) {
                let seg = &segments[j];
                let body_start = mode.body_start(j);
                let key = public_key(&contents[j], &seg.isolation, body_start);
                entries.push(match self.get_public(&key) {
                    Some(e) => (e, Outcome::Hit, None),
                    None => {
                        let (e, reason) = self.build_roles(
                            &seg.tokens,
                            &seg.isolation,
                            &contents[j],
                            mode,
                            body_start,
                        )?;
                        (e, Outcome::Miss, Some(reason))
                    }
                });
                j += 1;
            }
            let run: Vec<(&[u32], &B::Entry)> = segments[i..j]
                .iter()
                .zip(&entries)
                .map(|(s, (e, _, _))| (&s.tokens[..], &**e))
                .collect();
            let keep = if use_private {
                self.snapshots_to_keep(&state, j - i)
            } else {
                0
            };
            let snaps = be.compose_run(&run, &mut state, naive, rope_fix, keep)?;
            for (k, (e, outcome, reason)) in entries.iter().enumerate() {
                let m = segments[i + k].tokens.len();
                let window = e.body_start().min(m);
                let (computed, reused) = match outcome {
                    Outcome::Hit => (window, m - window),
                    _ => (m + window, 0),
                };
                stats.segments.push(SegmentStat {
                    miss_reason: *reason,
                    ..stat(i + k, *outcome, computed, reused)
                });
            }
            for (k, snap_state) in snaps {
                let snap = Snapshot {
                    state: snap_state,
                    logits: None,
                };
                let bytes = B::state_bytes(&snap.state);
                lock(&self.private).insert(pkeys[i + k], Arc::new(snap), bytes, 0, tenant);
            }
            i = j;
        }
        tally(&mut stats);
        Ok(PicOutput {
            logits,
            state,
            stats,
        })
    }

    /// How many of a run of `n` composed segments get a private-pool snapshot: as many
    /// as the pool (capacity plus its spill tier) can hold at the size of `state`'s
    /// recurrent part, counted from the run's end. Inserting one snapshot per segment
    /// into an LRU pool keeps only the newest that fit, so earlier ones would only be
    /// made to be evicted.
    fn snapshots_to_keep(&self, state: &B::State, n: usize) -> usize {
        let per = B::recurrent_bytes(state).max(1);
        let pool = lock(&self.private);
        let room = pool.capacity_bytes() + pool.spill_usage().2;
        (room / per).min(n)
    }

    /// A public-pool miss on a segment (`tokens` under `isolation`, content key
    /// `content`) whose position needs the entry of `body_start`: decides the miss
    /// reason, builds that entry and the segment's entries for its other roles
    /// ([`Mode::entry_body_starts`]) that are not resident (one
    /// [`PicBackend::build_entries`] call over every role, in the canonical order),
    /// and offers them to the pool, the needed one last (the most recent under LRU).
    fn build_roles(
        &self,
        tokens: &[u32],
        isolation: &str,
        content: &Key,
        mode: Mode,
        body_start: usize,
    ) -> Result<(Arc<B::Entry>, MissReason)> {
        let m = tokens.len();
        let roles = miss_roles(&mode, body_start, m);
        let keys: Vec<Key> = roles
            .iter()
            .map(|&b| public_key(content, isolation, b))
            .collect();
        let key = public_key(content, isolation, body_start);
        let (reason, wanted) = {
            let pool = lock(&self.public);
            let wanted: Vec<bool> = roles
                .iter()
                .zip(&keys)
                .map(|(b, k)| *b == body_start || !pool.contains(k))
                .collect();
            (public_miss_reason(&pool, &key, &keys), wanted)
        };
        let built = self.backend.build_entries(tokens, &roles, &wanted)?;
        let mut needed = None;
        for (((b, k), e), w) in roles.iter().zip(keys).zip(built).zip(wanted) {
            match e {
                Some(e) if *b == body_start => needed = Some(Arc::new(e)),
                Some(e) if w => {
                    let bytes = e.bytes();
                    let _: Insert = lock(&self.public).insert(k, Arc::new(e), bytes, m, isolation);
                }
                _ => {}
            }
        }
        let e = needed
            .ok_or_else(|| Error::Input("no cache entry was built for the segment".into()))?;
        let bytes = e.bytes();
        let _: Insert = lock(&self.public).insert(key, e.clone(), bytes, m, isolation);
        Ok((e, reason))
    }

    /// Prefills `tokens` alone (fresh state, positions from 0) and keeps, per layer,
    /// the body `[body_start, m)` (clamped to `m`): linear layers' pair and conv
    /// tail, attention layers' KV.
    ///
    /// Errors: backend failures (the GPU rejects an empty span).
    pub fn build_entry(&self, tokens: &[u32], body_start: usize) -> Result<B::Entry> {
        self.build_entries(tokens, &[body_start])?
            .pop()
            .ok_or_else(|| Error::Input("no cache entry was built".into()))
    }

    /// [`Pic::build_entry`] for several body starts (seam widths); the CPU builds
    /// them in one prefill. Returns the entries in the order of `body_starts`.
    pub fn build_entries(&self, tokens: &[u32], body_starts: &[usize]) -> Result<Vec<B::Entry>> {
        let wanted = vec![true; body_starts.len()];
        self.backend
            .build_entries(tokens, body_starts, &wanted)?
            .into_iter()
            .map(|e| e.ok_or_else(|| Error::Input("no cache entry was built".into())))
            .collect()
    }
}

/// Content key of a segment: SHA-256 of the model id and its tokens (shared by the
/// CPU and GPU engines, so both address the same entries).
pub(crate) fn content_key(model_id: &str, tokens: &[u32]) -> Key {
    let mut h = Sha256::new();
    h.update(b"hypic-segment-v1\0");
    h.update(model_id.as_bytes());
    h.update([0]);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// Public-pool key: content key, isolation key and body start.
pub(crate) fn public_key(content: &Key, isolation: &str, body_start: usize) -> Key {
    let mut h = Sha256::new();
    h.update(b"hypic-public-v1\0");
    h.update(content);
    h.update((isolation.len() as u64).to_le_bytes());
    h.update(isolation.as_bytes());
    h.update((body_start as u64).to_le_bytes());
    h.finalize().into()
}

/// Private-pool keys of every segment prefix `segs[..=i]` (model, mode, tenant,
/// contents and isolation keys).
pub(crate) fn prefix_keys(
    model_id: &str,
    mode: &Mode,
    tenant: &str,
    contents: &[Key],
    segs: &[SegmentRef],
) -> Vec<Key> {
    let mut h = Sha256::new();
    h.update(b"hypic-private-v1\0");
    h.update(model_id.as_bytes());
    h.update([0]);
    h.update(mode.tag().as_bytes());
    h.update([0]);
    h.update((tenant.len() as u64).to_le_bytes());
    h.update(tenant.as_bytes());
    contents
        .iter()
        .zip(segs)
        .map(|(c, s)| {
            h.update(c);
            h.update((s.isolation.len() as u64).to_le_bytes());
            h.update(s.isolation.as_bytes());
            h.clone().finalize().into()
        })
        .collect()
}

/// Request checks shared by the engines: at least one segment, none empty, token ids
/// inside the vocabulary, total within the context limit.
pub(crate) fn validate_segments(
    c: &crate::config::ModelConfig,
    segments: &[SegmentRef],
) -> Result<()> {
    if segments.is_empty() {
        return Err(Error::Input("a request needs at least one segment".into()));
    }
    let vocab = c.vocab_size;
    let mut total = 0usize;
    for (i, s) in segments.iter().enumerate() {
        if s.tokens.is_empty() {
            return Err(Error::Input(format!("segment {i} is empty")));
        }
        if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Input(format!(
                "segment {i}: token id {t} is outside the vocabulary ({vocab})"
            )));
        }
        total += s.tokens.len();
    }
    let max = c.max_position_embeddings;
    if total > max {
        return Err(Error::Input(format!(
            "prompt has {total} tokens, over the context limit of {max}"
        )));
    }
    Ok(())
}

/// Body starts a public-pool miss on a segment of `len` tokens builds in one prefill
/// ([`Mode::entry_body_starts`]), always including `body_start` (the role needed),
/// ascending.
pub(crate) fn miss_roles(mode: &Mode, body_start: usize, len: usize) -> Vec<usize> {
    let mut roles = mode.entry_body_starts(len);
    if !roles.contains(&body_start) {
        roles.push(body_start);
        roles.sort_unstable();
    }
    roles
}

/// Why the public-pool lookup of `key` missed: how that key last left the pool
/// (evicted, invalidated, damaged, refused), else whether an entry of the same
/// segment for another role (`role_keys`, any of which may equal `key`) is resident,
/// else never seen. Not a lookup: counters and recency are untouched.
pub(crate) fn public_miss_reason<V>(pool: &Pool<V>, key: &Key, role_keys: &[Key]) -> MissReason {
    if let Some(d) = pool.departure(key) {
        return MissReason::of_departure(d);
    }
    if role_keys.iter().any(|k| k != key && pool.contains(k)) {
        return MissReason::RoleMismatch;
    }
    MissReason::NeverSeen
}

/// Why a segment computed in place was not reused: `None` for the query (`last`)
/// and in full recompute; in prefix-cache mode how the snapshot after this prefix
/// left the private pool (`private_departure`, asked only then) or else
/// [`MissReason::PrivatePrefixMiss`]; in HYPIC mode a middle segment inside its
/// seam window, [`MissReason::TooShortForSeam`].
pub(crate) fn computed_reason(
    mode: &Mode,
    last: bool,
    private_departure: impl FnOnce() -> Option<Departure>,
) -> Option<MissReason> {
    if last {
        return None;
    }
    match mode {
        Mode::FullRecompute => None,
        Mode::PrefixCache => Some(
            private_departure()
                .map(MissReason::of_departure)
                .unwrap_or(MissReason::PrivatePrefixMiss),
        ),
        Mode::Hypic { .. } => Some(MissReason::TooShortForSeam),
        Mode::NaiveAddition => None,
    }
}

/// Sums the per-segment statistics into the request totals.
pub(crate) fn tally(stats: &mut PicStats) {
    for s in &stats.segments {
        stats.tokens_computed += s.computed;
        stats.tokens_reused += s.reused;
        match s.outcome {
            Outcome::Hit | Outcome::PrefixHit => stats.hits += 1,
            Outcome::Miss => stats.misses += 1,
            Outcome::Computed => {}
        }
    }
}

/// A body start listed twice gets the result of its first listing.
pub(crate) fn fill_duplicates(
    body_starts: &[usize],
    mut out: Vec<(Prefetch, usize)>,
) -> Vec<(Prefetch, usize)> {
    for j in 0..body_starts.len() {
        if let Some(first) = body_starts[..j].iter().position(|&b| b == body_starts[j]) {
            out[j] = out[first];
        }
    }
    out
}

/// Residency and remembered history of one public-pool entry (one segment's tokens,
/// one isolation key, one body start), for explaining a miss ([`Pic::entry_report`]).
#[derive(Clone, Debug)]
pub struct EntryReport {
    /// Body start of the entry (0: the segment used first; the seam width: after
    /// another segment in HYPIC mode).
    pub body_start: usize,
    /// False when no entry of this role is ever built: the segment is no longer
    /// than `body_start` (a middle segment inside the seam window is computed whole).
    pub cacheable: bool,
    /// The tier that holds it now, if any.
    pub tier: Option<Tier>,
    /// Its metadata (bytes, hits, times) when present.
    pub meta: Option<EntryMeta>,
    /// Its remembered events, oldest first (empty: never seen or forgotten).
    pub events: Vec<PoolEvent>,
}

/// What [`PicEngine::prefetch`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Prefetch {
    /// The entry was already resident.
    Present,
    /// The entry was built and stored.
    Stored,
    /// Built, but the pool refused it (admission policy or no room).
    Refused,
    /// Nothing to cache: the segment is no longer than the seam window.
    NotNeeded,
}
/// Ahead-of-time segment registration (`hypic serve`'s `/v1/segments`): build a
/// segment's public-pool entry before any request uses it, read its residency,
/// drop it.
impl<B: PicBackend> Pic<B> {
    fn entry_key(&self, tokens: &[u32], isolation: &str, body_start: usize) -> Key {
        public_key(&self.content_key(tokens), isolation, body_start)
    }

    /// Builds the public-pool entry of `tokens` under `isolation` for `body_start`
    /// (0: the segment used first in a request, or by naive addition; the seam width
    /// `w`: the segment used after another in HYPIC mode), unless it is resident.
    /// Returns what happened and the entry's bytes (0 when not stored).
    ///
    /// Errors: empty segment, a token outside the vocabulary, over the context limit.
    pub fn prefetch(
        &self,
        tokens: &[u32],
        isolation: &str,
        body_start: usize,
    ) -> Result<(Prefetch, usize)> {
        self.prefetch_many(tokens, isolation, &[body_start])?
            .pop()
            .ok_or_else(|| Error::Input("no prefetch result".into()))
    }

    /// [`Pic::prefetch`] for several body starts, building every missing entry
    /// with one [`PicBackend::build_entries`] call (one prefill on the CPU).
    /// Results in the order of `body_starts`.
    pub fn prefetch_many(
        &self,
        tokens: &[u32],
        isolation: &str,
        body_starts: &[usize],
    ) -> Result<Vec<(Prefetch, usize)>> {
        self.validate(&[SegmentRef {
            tokens: tokens.to_vec(),
            isolation: isolation.to_string(),
        }])?;
        let mut out = vec![(Prefetch::NotNeeded, 0); body_starts.len()];
        let mut missing = vec![];
        for (j, &b) in body_starts.iter().enumerate() {
            if b > 0 && b >= tokens.len() {
                continue;
            }
            let key = self.entry_key(tokens, isolation, b);
            match self.resident_key(&key) {
                Some(bytes) => out[j] = (Prefetch::Present, bytes),
                None if missing.iter().any(|&(_, mb, _)| mb == b) => {}
                None => missing.push((j, b, key)),
            }
        }
        if missing.is_empty() {
            return Ok(fill_duplicates(body_starts, out));
        }
        let starts: Vec<usize> = missing.iter().map(|&(_, b, _)| b).collect();
        let built = self.build_entries(tokens, &starts)?;
        for ((j, _, key), e) in missing.into_iter().zip(built) {
            let bytes = e.bytes();
            let r = lock(&self.public).insert(key, Arc::new(e), bytes, tokens.len(), isolation);
            out[j] = match r {
                Insert::Stored { .. } => (Prefetch::Stored, bytes),
                Insert::Present => (Prefetch::Present, bytes),
                Insert::NotAdmitted | Insert::NoRoom => (Prefetch::Refused, 0),
            };
        }
        Ok(fill_duplicates(body_starts, out))
    }

    /// Residency and remembered history of the public-pool entry of `tokens` under
    /// `isolation` for `body_start` (see [`EntryReport`]). Not counted as a lookup.
    pub fn entry_report(&self, tokens: &[u32], isolation: &str, body_start: usize) -> EntryReport {
        let key = self.entry_key(tokens, isolation, body_start);
        let p = lock(&self.public);
        EntryReport {
            body_start,
            cacheable: body_start == 0 || body_start < tokens.len(),
            tier: p.tier_of(&key),
            meta: p.meta(&key).cloned(),
            events: p.history(&key),
        }
    }

    fn resident_key(&self, key: &Key) -> Option<usize> {
        lock(&self.public).meta(key).map(|m| m.bytes)
    }

    /// Bytes of the resident public-pool entry of `tokens` under `isolation` for
    /// `body_start`, if any. Not counted as a lookup.
    pub fn resident_bytes(
        &self,
        tokens: &[u32],
        isolation: &str,
        body_start: usize,
    ) -> Option<usize> {
        self.resident_key(&self.entry_key(tokens, isolation, body_start))
    }

    /// Removes the public-pool entries of `tokens` under `isolation` for each of
    /// `body_starts`; returns how many were present.
    pub fn evict_segment(&self, tokens: &[u32], isolation: &str, body_starts: &[usize]) -> usize {
        self.remove_entries(tokens, isolation, body_starts, Pool::remove)
    }

    /// As [`Self::evict_segment`], but the removals leave no departure record: a
    /// later miss on these entries reports `never_seen` whether or not they were
    /// present.
    pub fn forget_segment(&self, tokens: &[u32], isolation: &str, body_starts: &[usize]) -> usize {
        self.remove_entries(tokens, isolation, body_starts, Pool::remove_unrecorded)
    }

    fn remove_entries(
        &self,
        tokens: &[u32],
        isolation: &str,
        body_starts: &[usize],
        remove: fn(&mut Pool<B::Entry>, &Key) -> bool,
    ) -> usize {
        let keys: Vec<Key> = body_starts
            .iter()
            .map(|&b| self.entry_key(tokens, isolation, b))
            .collect();
        let mut p = lock(&self.public);
        keys.iter().filter(|k| remove(&mut p, k)).count()
    }
}
