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
use super::pool::{CachePolicy, Departure, Insert, Key, Lru, Pool, PoolStats};
use crate::config::LayerKind;
use crate::error::{Error, Result};
use crate::linear::transition::Pair;
use crate::model::{Logits, Model};
use crate::state::{LayerState, ModelState};
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

/// Result of [`PicEngine::run`].
#[derive(Clone, Debug)]
pub struct PicOutput {
    /// Logits of the prompt's last token, `[vocab]`.
    pub logits: Vec<f32>,
    /// Running state after the prompt, ready for decode.
    pub state: ModelState,
    /// Statistics.
    pub stats: PicStats,
}

/// Cached data of one layer for a segment body.
#[derive(Clone, Debug)]
pub enum EntryLayer {
    /// Linear layer: the body pair and the segment's conv tail `[conv_dim, K−1]`.
    Linear {
        /// `(T_body [Hv,dk,dk], S_body|0 [Hv,dk,dv])`, fp32.
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

/// A private-pool snapshot: the running state after a segment prefix.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// Whole-model state (fp32, as the cold path keeps it).
    pub state: ModelState,
    /// Last-token logits of the prefix, when it was a whole prompt.
    pub logits: Option<Vec<f32>>,
}

/// Default byte capacities of the pools.
pub const DEFAULT_PUBLIC_BYTES: usize = 1 << 30;
/// See [`DEFAULT_PUBLIC_BYTES`].
pub const DEFAULT_PRIVATE_BYTES: usize = 1 << 30;

/// The PIC engine: a model plus its public and private pools.
pub struct PicEngine {
    model: Arc<Model>,
    model_id: String,
    public: Mutex<Pool<SegmentEntry>>,
    private: Mutex<Pool<Snapshot>>,
}

fn for_each_spilled<V>(p: &mut Pool<V>, mut f: impl FnMut(&mut Pool<V>, &Key)) {
    for k in p.spilled_keys() {
        f(p, &k);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PicEngine {
    /// Engine over `model` (identified by `model_id` in cache keys) with LRU pools of
    /// the given byte capacities.
    pub fn new(
        model: Arc<Model>,
        model_id: &str,
        public_bytes: usize,
        private_bytes: usize,
    ) -> Self {
        PicEngine {
            model,
            model_id: model_id.to_string(),
            public: Mutex::new(Pool::new(public_bytes, Box::new(Lru))),
            private: Mutex::new(Pool::new(private_bytes, Box::new(Lru))),
        }
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
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
    pub fn enable_spill(&self, public_bytes: usize, private_bytes: usize) {
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

    fn public_key(content: &Key, isolation: &str, body_start: usize) -> Key {
        public_key(content, isolation, body_start)
    }

    fn prefix_keys(
        &self,
        mode: &Mode,
        tenant: &str,
        contents: &[Key],
        segs: &[SegmentRef],
    ) -> Vec<Key> {
        prefix_keys(&self.model_id, mode, tenant, contents, segs)
    }

    fn validate(&self, segments: &[SegmentRef]) -> Result<()> {
        validate_segments(&self.model.config, segments)
    }

    /// Serves one request: prefix/PIC reuse per `mode`, then the query segment.
    ///
    /// `tenant` scopes the private pool (running states are never shared across
    /// tenants); each segment's `isolation` scopes its public-pool entry.
    ///
    /// Errors: no segments, an empty segment, a token outside the vocabulary, a prompt
    /// over the context limit.
    pub fn run(&self, segments: &[SegmentRef], mode: Mode, tenant: &str) -> Result<PicOutput> {
        self.validate(segments)?;
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
        let prefix_keys = if use_private {
            self.prefix_keys(&mode, tenant, &contents, segments)
        } else {
            vec![]
        };

        // 1. Longest private-pool prefix.
        let mut state = self.model.new_state();
        let mut start = 0usize;
        if use_private {
            let mut pool = lock(&self.private);
            for i in (1..=n).rev() {
                if !pool.contains(&prefix_keys[i - 1]) {
                    continue;
                }
                // A spilled snapshot whose checksum fails is dropped: a miss.
                let Some(snap) = pool.get(&prefix_keys[i - 1]) else {
                    continue;
                };
                if i == n {
                    let Some(logits) = snap.logits.clone() else {
                        continue;
                    };
                    drop(pool);
                    for (j, seg) in segments.iter().enumerate().take(n) {
                        stats
                            .segments
                            .push(stat(j, Outcome::PrefixHit, 0, seg.tokens.len()));
                    }
                    stats.hits = n;
                    stats.tokens_reused = segments.iter().map(|s| s.tokens.len()).sum();
                    return Ok(PicOutput {
                        logits,
                        state: snap.state.clone(),
                        stats,
                    });
                }
                state = snap.state.clone();
                start = i;
                for (j, seg) in segments.iter().enumerate().take(i) {
                    stats
                        .segments
                        .push(stat(j, Outcome::PrefixHit, 0, seg.tokens.len()));
                }
                break;
            }
        }

        // 2. Remaining segments.
        let mut logits = vec![];
        for i in start..n {
            let seg = &segments[i];
            let m = seg.tokens.len();
            let last = i + 1 == n;
            let body_start = mode.body_start(i);
            let compute_here = last
                || matches!(mode, Mode::FullRecompute | Mode::PrefixCache)
                || (matches!(mode, Mode::Hypic { .. }) && body_start >= m);
            if compute_here {
                let out = self.model.prefill(
                    &seg.tokens,
                    &mut state,
                    if last { Logits::Last } else { Logits::None },
                )?;
                logits = out.logits;
                let reason = computed_reason(&mode, last, || {
                    use_private
                        .then(|| lock(&self.private).departure(&prefix_keys[i]))
                        .flatten()
                });
                stats.segments.push(SegmentStat {
                    miss_reason: reason,
                    ..stat(i, Outcome::Computed, m, 0)
                });
            } else {
                let key = Self::public_key(&contents[i], &seg.isolation, body_start);
                let found = lock(&self.public).get(&key);
                let (entry, outcome, reason) = match found {
                    Some(e) => (e, Outcome::Hit, None),
                    None => {
                        let roles = miss_roles(&mode, body_start, m);
                        let keys: Vec<Key> = roles
                            .iter()
                            .map(|&b| Self::public_key(&contents[i], &seg.isolation, b))
                            .collect();
                        let reason = public_miss_reason(&lock(&self.public), &key, &keys);
                        // Every role in one prefill, in the canonical order, so that an
                        // entry is the same whichever role missed first.
                        let built = self.build_entries(&seg.tokens, &roles)?;
                        let mut needed = None;
                        let mut pool = lock(&self.public);
                        for ((b, k), e) in roles.iter().zip(keys).zip(built) {
                            let e = Arc::new(e);
                            if *b == body_start {
                                needed = Some(e);
                            } else if !pool.contains(&k) {
                                let bytes = e.bytes();
                                let _: Insert = pool.insert(k, e, bytes, m, &seg.isolation);
                            }
                        }
                        let e = needed.ok_or_else(|| {
                            Error::Input("no cache entry was built for the segment".into())
                        })?;
                        // The role used now last: the most recent under LRU.
                        let _: Insert = pool.insert(key, e.clone(), e.bytes(), m, &seg.isolation);
                        (e, Outcome::Miss, Some(reason))
                    }
                };
                let rope_fix = match mode {
                    Mode::Hypic { rope_fix, .. } => rope_fix,
                    _ => true,
                };
                let naive = mode == Mode::NaiveAddition;
                self.compose(&seg.tokens, &entry, &mut state, naive, rope_fix)?;
                let window = body_start.min(m);
                let (computed, reused) = match outcome {
                    Outcome::Hit => (window, m - window),
                    _ => (m + window, 0),
                };
                stats.segments.push(SegmentStat {
                    miss_reason: reason,
                    ..stat(i, outcome, computed, reused)
                });
            }
            if use_private {
                let snap = Snapshot {
                    state: state.clone(),
                    logits: if last { Some(logits.clone()) } else { None },
                };
                let bytes = snap.state.bytes() + 4 * logits.len();
                let owner = tenant.to_string();
                lock(&self.private).insert(prefix_keys[i], Arc::new(snap), bytes, 0, &owner);
            }
        }
        tally(&mut stats);
        Ok(PicOutput {
            logits,
            state,
            stats,
        })
    }

    /// Prefills `tokens` alone (fresh state, positions from 0) and keeps, per layer,
    /// the body `[body_start, m)`: linear layers' pair and conv tail, attention
    /// layers' KV.
    pub fn build_entry(&self, tokens: &[u32], body_start: usize) -> Result<SegmentEntry> {
        self.build_entries(tokens, &[body_start])?
            .pop()
            .ok_or_else(|| Error::Input("no cache entry was built".into()))
    }

    /// [`PicEngine::build_entry`] for several body starts (seam widths) with one
    /// prefill: the projections, MLPs and attention run once; each extra body start
    /// adds one gated-delta-rule pass per linear layer. Returns the entries in the
    /// order of `body_starts` (each clamped to the segment length).
    pub fn build_entries(
        &self,
        tokens: &[u32],
        body_starts: &[usize],
    ) -> Result<Vec<SegmentEntry>> {
        let model = &self.model;
        let mut state = model.new_state();
        let positions: Vec<i64> = (0..tokens.len() as i64).collect();
        let mut x = model.embed(tokens);
        let c = &model.config;
        let row = c.num_kv_heads * c.head_dim;
        let froms: Vec<usize> = body_starts.iter().map(|&b| b.min(tokens.len())).collect();
        let mut layers: Vec<Vec<EntryLayer>> = froms
            .iter()
            .map(|_| Vec::with_capacity(c.num_layers))
            .collect();
        for (i, ls) in state.layers.iter_mut().enumerate() {
            let out = model.layer_forward_capture_many(i, &mut x, &positions, ls, &froms)?;
            match (ls, out.pairs.len() == froms.len(), out.kv) {
                (LayerState::Linear(s), true, _) => {
                    for (dst, pair) in layers.iter_mut().zip(out.pairs) {
                        dst.push(EntryLayer::Linear {
                            pair,
                            conv_tail: s.conv.clone(),
                        });
                    }
                }
                (LayerState::Full(_), _, Some((k, v))) => {
                    for (dst, &from) in layers.iter_mut().zip(&froms) {
                        dst.push(EntryLayer::Full {
                            k: k[from * row..].to_vec(),
                            v: v[from * row..].to_vec(),
                        });
                    }
                }
                _ => {
                    return Err(Error::Input(format!(
                        "layer {i}: capture returned no cache data"
                    )))
                }
            }
        }
        Ok(froms
            .into_iter()
            .zip(layers)
            .map(|(from, layers)| SegmentEntry {
                body_start: from,
                len: tokens.len(),
                layers,
            })
            .collect())
    }

    /// Places a cached segment after the running `state` at position
    /// `b = state.next_position`: recomputes the seam window `tokens[..body_start]`
    /// through the whole stack, then composes the body (or adds it, `naive`).
    fn compose(
        &self,
        tokens: &[u32],
        e: &SegmentEntry,
        state: &mut ModelState,
        naive: bool,
        rope_fix: bool,
    ) -> Result<()> {
        let model = &self.model;
        let c = &model.config;
        let b = state.next_position;
        if e.body_start > 0 {
            model.prefill(&tokens[..e.body_start], state, Logits::None)?;
        }
        let (nkv, hd) = (c.num_kv_heads, c.head_dim);
        let body = e.len - e.body_start;
        for (i, (ls, el)) in state.layers.iter_mut().zip(&e.layers).enumerate() {
            match (ls, el, c.layer_kinds[i]) {
                (
                    LayerState::Linear(s),
                    EntryLayer::Linear { pair, conv_tail },
                    LayerKind::Linear,
                ) => {
                    let r = if naive {
                        pair.apply_naive(&mut s.recurrent)
                    } else {
                        pair.apply(&mut s.recurrent)
                    };
                    r.map_err(|e| Error::Input(format!("layer {i}: {e}")))?;
                    s.conv.clone_from(conv_tail);
                }
                (LayerState::Full(kv), EntryLayer::Full { k, v }, LayerKind::Full) => {
                    let mut k = k.clone();
                    if rope_fix && b != 0 {
                        for tok in k.chunks_exact_mut(nkv * hd) {
                            model.rope().apply(tok, hd, b);
                        }
                    }
                    kv.k.extend_from_slice(&k);
                    kv.v.extend_from_slice(v);
                    let p0 = b + e.body_start as i64;
                    kv.positions.extend((0..body as i64).map(|j| p0 + j));
                }
                _ => {
                    return Err(Error::Input(format!(
                        "layer {i}: cache entry does not match the model"
                    )))
                }
            }
        }
        state.next_position = b + e.len as i64;
        Ok(())
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
impl PicEngine {
    fn entry_key(&self, tokens: &[u32], isolation: &str, body_start: usize) -> Key {
        Self::public_key(&self.content_key(tokens), isolation, body_start)
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

    /// [`PicEngine::prefetch`] for several body starts, building every missing entry
    /// in one prefill ([`PicEngine::build_entries`]). Results in the order of
    /// `body_starts`.
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
        let keys: Vec<Key> = body_starts
            .iter()
            .map(|&b| self.entry_key(tokens, isolation, b))
            .collect();
        let mut p = lock(&self.public);
        keys.iter().filter(|k| p.remove(k)).count()
    }

    /// As [`Self::evict_segment`], but the removals leave no departure record: a
    /// later miss on these entries reports `never_seen` whether or not they were
    /// present.
    pub fn forget_segment(&self, tokens: &[u32], isolation: &str, body_starts: &[usize]) -> usize {
        let keys: Vec<Key> = body_starts
            .iter()
            .map(|&b| self.entry_key(tokens, isolation, b))
            .collect();
        let mut p = lock(&self.public);
        keys.iter().filter(|k| p.remove_unrecorded(k)).count()
    }
}
