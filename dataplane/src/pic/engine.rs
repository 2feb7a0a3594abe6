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
use crate::parallel::wire::{self, ModelFingerprint};
use crate::parallel::{EntrySource, Shipped, Supply};
use crate::state::ModelState;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

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
    /// Of `computed`, the seam window's tokens: recomputed at the segment's new
    /// position before its cached body was placed (a `hit` or `miss` after the
    /// first segment in HYPIC mode; 0 otherwise).
    #[serde(default)]
    pub seam: usize,
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
    /// Seam-window tokens recomputed (the sum of the segments' `seam`; part of
    /// `tokens_computed`).
    #[serde(default)]
    pub seam_tokens: usize,
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
    fingerprint: OnceLock<ModelFingerprint>,
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
            fingerprint: OnceLock::new(),
        }
    }

    /// The identity of this engine's model as shipped entries carry it
    /// ([`ModelFingerprint`]: configuration and the backend's weight digest).
    pub fn model_fingerprint(&self) -> ModelFingerprint {
        *self.fingerprint.get_or_init(|| {
            ModelFingerprint::new(self.backend.config(), self.backend.weights_digest())
        })
    }

    /// The cold segments of a request: those the engine would miss in the public
    /// pool and build, as [`Pic::run`] would serve the request now (after the
    /// longest private-pool prefix; neither the query nor a segment computed in
    /// place). Each comes with the body starts its miss builds
    /// ([`Mode::entry_body_starts`] plus the needed one, ascending). Only a look:
    /// no counters or recency change, nothing is built. Empty for the modes without
    /// a public pool and for an invalid request.
    pub fn cold_segments(
        &self,
        segments: &[SegmentRef],
        mode: Mode,
        tenant: &str,
    ) -> Vec<(usize, Vec<usize>)> {
        if matches!(mode, Mode::FullRecompute | Mode::PrefixCache)
            || self.validate(segments).is_err()
        {
            return vec![];
        }
        let contents: Vec<Key> = segments
            .iter()
            .map(|s| self.content_key(&s.tokens))
            .collect();
        let n = segments.len();
        let mut from = 0;
        if mode != Mode::NaiveAddition {
            let pkeys = prefix_keys(&self.model_id, &mode, tenant, &contents, segments);
            let pool = lock(&self.private);
            if let Some(i) = (1..=n).rev().find(|&i| pool.contains(&pkeys[i - 1])) {
                from = i;
            }
        }
        let pool = lock(&self.public);
        (from..n)
            .filter(|&j| !computed_in_place(&mode, j, segments))
            .filter_map(|j| {
                let b = mode.body_start(j);
                let key = public_key(&contents[j], &segments[j].isolation, b);
                (!pool.contains(&key)).then(|| (j, miss_roles(&mode, b, segments[j].tokens.len())))
            })
            .collect()
    }

    /// [`Pic::begin`] with the entries of some cold segments supplied by `source`
    /// (a scatter over workers): at a public-pool miss on a supplied segment the
    /// engine waits for its entries instead of building them (composing the
    /// segments before it meanwhile), verifies and stores them as it would its own
    /// (the segment is still a `miss` with the same reason and counts), and builds
    /// the entry itself when the source gives it up or its frames do not verify.
    ///
    /// Errors: as [`Pic::begin`].
    pub fn begin_with_source(
        &self,
        segments: Vec<SegmentRef>,
        mode: Mode,
        tenant: &str,
        source: Option<Arc<dyn EntrySource>>,
    ) -> Result<PicJob<B>> {
        let mut job = self.begin(segments, mode, tenant)?;
        job.source = source;
        Ok(job)
    }

    /// The entries of a supplied segment (one per role of `plan`): wire frames
    /// decoded, device entries taken as they are (the scatter verified their
    /// checksum on this device); or why they cannot be used.
    fn supplied_entries(
        &self,
        source: &dyn EntrySource,
        plan: &RolePlan,
        frames: Vec<Shipped>,
        tokens: &[u32],
    ) -> std::result::Result<Vec<Option<B::Entry>>, String> {
        let fp = self.model_fingerprint();
        if source.model() != fp {
            return Err(format!(
                "the scatter verified entries of model {}, this engine runs {}",
                source.model().hex(),
                fp.hex()
            ));
        }
        if frames.len() != plan.roles.len() {
            return Err(format!(
                "{} entries shipped, the segment needs {}",
                frames.len(),
                plan.roles.len()
            ));
        }
        let mut out = Vec::with_capacity(frames.len());
        for (f, &b) in frames.into_iter().zip(&plan.roles) {
            let e: B::Entry = match f {
                Shipped::Frame(f) => self
                    .backend
                    .decoding(|| wire::decode(&f, fp, tokens.len()))
                    .map_err(|e| e.to_string())?,
                Shipped::Device(d) => {
                    if d.model() != fp || d.tokens() != tokens.len() {
                        return Err(format!(
                            "a device entry of model {} for {} tokens, expected model {} \
                             and {} tokens",
                            d.model().hex(),
                            d.tokens(),
                            fp.hex(),
                            tokens.len()
                        ));
                    }
                    *d.into_any()
                        .downcast::<B::Entry>()
                        .map_err(|_| "a device entry of another backend type".to_string())?
                }
            };
            if e.body_start() != b {
                return Err(format!(
                    "entry with body start {}, expected {b}",
                    e.body_start()
                ));
            }
            out.push(Some(e));
        }
        Ok(out)
    }

    /// The backend.
    pub fn pic_backend(&self) -> &B {
        &self.backend
    }

    /// Replaces the public pool's policy.
    pub fn set_public_policy(&self, p: Box<dyn CachePolicy>) {
        lock(&self.public).set_policy(p);
    }
    /// Sets (or with `None` removes) the observer told of every change of the
    /// public pool (insert, spill, restore, eviction, removal, clear): the hook of
    /// the control plane's residency directory. The private pool (running-state
    /// snapshots of one tenant's prompt prefixes) is not observed.
    pub fn set_residency_observer(&self, o: Option<Arc<dyn super::pool::PoolObserver>>) {
        lock(&self.public).set_observer(o);
    }

    /// The public-pool key of `tokens` under `isolation` for `body_start`: what
    /// [`super::pool::ResidencyChange::key`] names the entry by.
    pub fn public_entry_key(&self, tokens: &[u32], isolation: &str, body_start: usize) -> Key {
        self.entry_key(tokens, isolation, body_start)
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
    /// window) is prefilled on its own. The same steps as [`Pic::begin`] and
    /// [`Pic::advance`] with an unbounded budget (every segment prefilled, and every
    /// missed entry built, in one call).
    ///
    /// Errors: no segments, an empty segment, a token outside the vocabulary, a prompt
    /// over the context limit ([`Error::Input`]); backend failures.
    pub fn run(
        &self,
        segments: &[SegmentRef],
        mode: Mode,
        tenant: &str,
    ) -> Result<PicOutput<B::State>> {
        let mut job = self.begin(segments.to_vec(), mode, tenant)?;
        while !job.is_done() {
            self.advance(&mut job, usize::MAX, true)?;
        }
        job.take_output()
            .ok_or_else(|| Error::Input("the request produced no output".into()))
    }

    /// Starts a request's prompt processing as a job that [`Pic::advance`] moves on
    /// by a token budget at a time (the scheduler's token-budget loop); no model work
    /// yet.
    ///
    /// Errors: as [`Pic::run`] for an invalid request.
    pub fn begin(&self, segments: Vec<SegmentRef>, mode: Mode, tenant: &str) -> Result<PicJob<B>> {
        self.validate(&segments)?;
        let contents: Vec<Key> = segments
            .iter()
            .map(|s| self.content_key(&s.tokens))
            .collect();
        let use_private = mode != Mode::FullRecompute && mode != Mode::NaiveAddition;
        let pkeys = if use_private {
            prefix_keys(&self.model_id, &mode, tenant, &contents, &segments)
        } else {
            vec![]
        };
        Ok(PicJob {
            segments,
            mode,
            tenant: tenant.to_string(),
            contents,
            pkeys,
            use_private,
            stats: PicStats::default(),
            state: None,
            i: 0,
            step: Step::Prefix,
            logits: vec![],
            output: None,
            source: None,
            probed: None,
        })
    }

    /// The piece [`Pic::advance`] would prefill next if `job` stands at a segment
    /// computed in place (the query, or a segment of full recompute / prefix cache)
    /// with `budget` tokens (`progress`: as in [`Pic::advance`]); `None` when its next
    /// step is anything else, the budget allows no piece, or the backend runs
    /// [`PicBackend::prefill_many`] one item after the other (nothing to gain). Used to
    /// gather the pieces of several requests into one [`Pic::advance_computed_many`].
    pub fn computed_piece(&self, job: &PicJob<B>, budget: usize, progress: bool) -> Option<usize> {
        if !self.backend.batches_prefills() {
            return None;
        }
        match job.step {
            Step::Compute { at } => piece(job.segments[job.i].tokens.len() - at, budget, progress),
            _ => None,
        }
    }

    /// Prefills a piece of `pieces[j]` tokens of the computed segment each `jobs[j]`
    /// stands at (as [`Pic::computed_piece`] sized it) in one
    /// [`PicBackend::prefill_many`], then moves each job on as [`Pic::advance`] does
    /// after such a piece (a finished segment is recorded and snapshotted). Several
    /// requests' queries thus share one batched forward.
    ///
    /// Errors: a job not at a computed segment or a piece past its end
    /// ([`Error::Input`], nothing run); backend failures (every job in the batch is
    /// then unusable).
    pub fn advance_computed_many(
        &self,
        jobs: &mut [&mut PicJob<B>],
        pieces: &[usize],
    ) -> Result<()> {
        if jobs.len() != pieces.len() {
            return Err(Error::Input(format!(
                "{} pieces for {} jobs",
                pieces.len(),
                jobs.len()
            )));
        }
        // (start, length, segment length) of each job's piece.
        let mut spans = Vec::with_capacity(jobs.len());
        for (j, (job, &n)) in jobs.iter().zip(pieces).enumerate() {
            let Step::Compute { at } = job.step else {
                return Err(Error::Input(format!(
                    "job {j} is not at a computed segment"
                )));
            };
            let m = job.segments[job.i].tokens.len();
            if n == 0 || at + n > m {
                return Err(Error::Input(format!(
                    "job {j}: a piece of {n} tokens at {at} of a {m}-token segment"
                )));
            }
            spans.push((at, n, m));
        }
        let logits = {
            let mut items: Vec<(&[u32], &mut B::State, bool)> = jobs
                .iter_mut()
                .zip(&spans)
                .map(|(job, &(at, n, m))| {
                    let i = job.i;
                    let last = i + 1 == job.segments.len() && at + n == m;
                    let PicJob {
                        segments, state, ..
                    } = &mut **job;
                    let state = state.as_mut().expect("state after the prefix match");
                    (&segments[i].tokens[at..at + n], state, last)
                })
                .collect();
            self.backend.prefill_many(&mut items)?
        };
        for ((job, (at, n, m)), lg) in jobs.iter_mut().zip(spans).zip(logits) {
            if at + n < m {
                job.step = Step::Compute { at: at + n };
                continue;
            }
            job.logits = lg;
            self.finish_computed(job)?;
            job.i += 1;
            job.step = job.next_step();
            // As `advance` goes on after a piece: a finished prompt gets its output
            // now (no model work with a budget of 0).
            self.advance(job, 0, false)?;
        }
        Ok(())
    }

    /// A key shared by requests whose prompts start alike (tenant, mode and first
    /// segment) while that start is not cached yet: the private-pool key of the first
    /// segment's snapshot; `None` when the mode keeps no snapshots or the snapshot is
    /// already in the pool (one request then has nothing to wait for from another).
    pub fn prefix_group(&self, job: &PicJob<B>) -> Option<Key> {
        let k = job.pkeys.first()?;
        (!lock(&self.private).contains(k)).then_some(*k)
    }

    /// Whether `job` stands at a segment computed in place (where
    /// [`Pic::advance_to_computed`] stops).
    pub fn at_computed(&self, job: &PicJob<B>) -> bool {
        matches!(job.step, Step::Compute { .. })
    }

    /// Whether `job` has yet to look up its prompt prefix in the private pool.
    pub fn before_prefix(&self, job: &PicJob<B>) -> bool {
        matches!(job.step, Step::Prefix)
    }

    /// Advances `job` by at most `budget` tokens of model work (`usize::MAX`: to the
    /// end), in its order of steps: the private-pool prefix match, then per
    /// segment a prefill (computed segments) or a public-pool lookup, the build of a
    /// missed entry, and the composition of a run of cached segments (seam windows),
    /// then the query. Returns the tokens run through the model.
    ///
    /// A computed segment longer than what is left of the budget is prefilled in
    /// pieces whose lengths are multiples of [`PREFILL_ALIGN`]; a missed entry is
    /// built in such pieces when the backend can
    /// ([`PicBackend::build_entries_start`]), else in one step. With `progress`, a
    /// call does at least one piece even over the budget (up to [`PREFILL_ALIGN`]
    /// tokens, a missed entry the backend builds whole, or one segment's seam
    /// window), so the caller's oldest prefill always moves; without, it may do
    /// nothing. A composition step counts its seam windows and stops between
    /// segments when the budget is spent. A job with an [`EntrySource`]
    /// ([`Pic::begin_with_source`]) whose next entry is still being shipped composes
    /// what it has, then (with `progress`) waits up to 5 ms for it and returns,
    /// possibly having run nothing; the source's deadlines bound how often.
    ///
    /// Errors: backend failures (the job is then unusable).
    pub fn advance(&self, job: &mut PicJob<B>, budget: usize, progress: bool) -> Result<usize> {
        self.advance_until(job, budget, progress, false)
    }

    /// [`Pic::advance`] that stops before prefilling a segment computed in place
    /// (leaving that piece to [`Pic::advance_computed_many`], batched with other
    /// requests'): the prefix match, lookups, builds and compositions before it run
    /// within `budget` as `advance` runs them. Returns the tokens run.
    ///
    /// Errors: as [`Pic::advance`].
    pub fn advance_to_computed(
        &self,
        job: &mut PicJob<B>,
        budget: usize,
        progress: bool,
    ) -> Result<usize> {
        self.advance_until(job, budget, progress, true)
    }

    /// [`Pic::advance`]; with `stop_at_computed`, returns at a computed segment
    /// instead of prefilling it.
    fn advance_until(
        &self,
        job: &mut PicJob<B>,
        budget: usize,
        progress: bool,
        stop_at_computed: bool,
    ) -> Result<usize> {
        let mut used = 0usize;
        loop {
            let left = budget.saturating_sub(used);
            // Whether this piece must run even over the budget.
            let must = progress && used == 0;
            match std::mem::replace(&mut job.step, Step::Done) {
                Step::Done => return Ok(used),
                Step::Query => {
                    let mut stats = std::mem::take(&mut job.stats);
                    tally(&mut stats);
                    job.output = Some(PicOutput {
                        logits: std::mem::take(&mut job.logits),
                        state: job.state.take().expect("state after the prefix match"),
                        stats,
                    });
                    return Ok(used);
                }
                Step::Prefix => {
                    if self.match_prefix(job)? {
                        return Ok(used);
                    }
                    job.step = job.next_step();
                }
                Step::Compute { at } => {
                    if stop_at_computed {
                        job.step = Step::Compute { at };
                        return Ok(used);
                    }
                    let i = job.i;
                    let m = job.segments[i].tokens.len();
                    let Some(n) = piece(m - at, left, must) else {
                        job.step = Step::Compute { at };
                        return Ok(used);
                    };
                    let last = i + 1 == job.segments.len();
                    let state = job.state.as_mut().expect("state after the prefix match");
                    let tokens = &job.segments[i].tokens[at..at + n];
                    let logits = self.backend.prefill(tokens, state, last && at + n == m)?;
                    used += n;
                    if at + n < m {
                        job.step = Step::Compute { at: at + n };
                        continue;
                    }
                    job.logits = logits;
                    self.finish_computed(job)?;
                    job.i += 1;
                    job.step = job.next_step();
                }
                Step::Gather {
                    end,
                    mut entries,
                    build,
                    composed,
                    keep,
                } => {
                    if let Some(mut b) = build {
                        let m = job.segments[end].tokens.len();
                        let Some(n) = piece(m - b.done, left, must) else {
                            job.step = Step::Gather {
                                end,
                                entries,
                                build: Some(b),
                                composed,
                                keep,
                            };
                            return Ok(used);
                        };
                        let tokens = &job.segments[end].tokens;
                        self.backend.build_entries_continue(
                            &mut *b.partial,
                            tokens,
                            b.done,
                            b.done + n,
                        )?;
                        used += n;
                        b.done += n;
                        if b.done < m {
                            job.step = Step::Gather {
                                end,
                                entries,
                                build: Some(b),
                                composed,
                                keep,
                            };
                            continue;
                        }
                        let built = self.backend.build_entries_finish(b.partial, tokens)?;
                        let seg = &job.segments[end];
                        let e = self.store_roles(&seg.tokens, &seg.isolation, b.plan, built)?;
                        entries.push((e, Outcome::Miss, Some(b.reason)));
                        job.step = Step::Gather {
                            end: end + 1,
                            entries,
                            build: None,
                            composed,
                            keep,
                        };
                        continue;
                    }
                    if end == job.segments.len() || job.compute_here(end) {
                        let keep = match keep {
                            Some(k) => k,
                            None => self.run_keep(job, end),
                        };
                        job.step = Step::Compose {
                            end,
                            entries,
                            composed,
                            keep,
                        };
                        continue;
                    }
                    let seg = &job.segments[end];
                    let body_start = job.mode.body_start(end);
                    let key = public_key(&job.contents[end], &seg.isolation, body_start);
                    // A segment whose lookup missed before (its scattered entries not
                    // yet in, or its build left for a later call) is counted once only.
                    let probed = job.probed.take() == Some(end);
                    let found = if probed && !lock(&self.public).contains(&key) {
                        None
                    } else {
                        self.get_public(&key)
                    };
                    if let Some(e) = found {
                        entries.push((e, Outcome::Hit, None));
                        job.step = Step::Gather {
                            end: end + 1,
                            entries,
                            build: None,
                            composed,
                            keep,
                        };
                        continue;
                    }
                    // A scattered segment: its entries come from a worker.
                    if let Some(src) = job.source.clone() {
                        let wait = if must { SOURCE_WAIT } else { Duration::ZERO };
                        match src.take(end, wait) {
                            Supply::Local => {}
                            Supply::Pending => {
                                if entries.len() > composed {
                                    job.probed = Some(end);
                                    // Compose what is in while the rest is shipped.
                                    let run_end = job.run_end(end);
                                    let keep = match keep {
                                        Some(k) => k,
                                        None => self.run_keep(job, run_end),
                                    };
                                    job.step = Step::Compose {
                                        end: run_end,
                                        entries,
                                        composed,
                                        keep,
                                    };
                                    continue;
                                }
                                job.probed = Some(end);
                                job.step = Step::Gather {
                                    end,
                                    entries,
                                    build: None,
                                    composed,
                                    keep,
                                };
                                return Ok(used);
                            }
                            Supply::Ready(frames) => {
                                let seg = &job.segments[end];
                                let (plan, reason) = self.plan_roles(
                                    &seg.tokens,
                                    &seg.isolation,
                                    &job.contents[end],
                                    job.mode,
                                    body_start,
                                );
                                match self.supplied_entries(&*src, &plan, frames, &seg.tokens) {
                                    Ok(built) => {
                                        let e = self.store_roles(
                                            &seg.tokens,
                                            &seg.isolation,
                                            plan,
                                            built,
                                        )?;
                                        entries.push((e, Outcome::Miss, Some(reason)));
                                        job.step = Step::Gather {
                                            end: end + 1,
                                            entries,
                                            build: None,
                                            composed,
                                            keep,
                                        };
                                        continue;
                                    }
                                    // Never composed: built here below instead.
                                    Err(why) => src.rejected(end, &why),
                                }
                            }
                        }
                    }
                    let seg = &job.segments[end];
                    let m = seg.tokens.len();
                    if !must && m > left && left < PREFILL_ALIGN {
                        // Start the build in the next call (its first piece).
                        job.probed = Some(end);
                        job.step = Step::Gather {
                            end,
                            entries,
                            build: None,
                            composed,
                            keep,
                        };
                        return Ok(used);
                    }
                    let (plan, reason) = self.plan_roles(
                        &seg.tokens,
                        &seg.isolation,
                        &job.contents[end],
                        job.mode,
                        body_start,
                    );
                    let partial = if m > left {
                        self.backend.build_entries_start(&seg.tokens, &plan.roles)?
                    } else {
                        None
                    };
                    match partial {
                        Some(partial) => {
                            job.step = Step::Gather {
                                end,
                                entries,
                                build: Some(Build {
                                    plan,
                                    reason,
                                    partial,
                                    done: 0,
                                }),
                                composed,
                                keep,
                            };
                        }
                        None if m > left && !must => {
                            // Built whole, over the budget: only as a call's first piece.
                            job.probed = Some(end);
                            job.step = Step::Gather {
                                end,
                                entries,
                                build: None,
                                composed,
                                keep,
                            };
                            return Ok(used);
                        }
                        None => {
                            let built = self.backend.build_entries(
                                &seg.tokens,
                                &plan.roles,
                                &plan.wanted,
                            )?;
                            used += m;
                            let e = self.store_roles(&seg.tokens, &seg.isolation, plan, built)?;
                            entries.push((e, Outcome::Miss, Some(reason)));
                            job.step = Step::Gather {
                                end: end + 1,
                                entries,
                                build: None,
                                composed,
                                keep,
                            };
                        }
                    }
                }
                Step::Compose {
                    end,
                    entries,
                    composed,
                    keep,
                } => {
                    let (i, len) = (job.i, end - job.i);
                    if composed == entries.len() {
                        if composed == len {
                            self.finish_run(job, &entries);
                            job.i = end;
                            job.step = job.next_step();
                        } else {
                            // A scattered run: gather the rest.
                            job.step = Step::Gather {
                                end: i + composed,
                                entries,
                                build: None,
                                composed,
                                keep: Some(keep),
                            };
                        }
                        continue;
                    }
                    // The segments of this call: as many as the budget's seam
                    // windows allow, at least one when nothing ran yet.
                    let mut to = composed;
                    let mut cost = 0usize;
                    while to < entries.len() {
                        let m = job.segments[i + to].tokens.len();
                        let w = entries[to].0.body_start().min(m);
                        if to > composed && cost + w > left {
                            break;
                        }
                        if to == composed && !must && w > left {
                            break;
                        }
                        cost += w;
                        to += 1;
                    }
                    if to == composed {
                        job.step = Step::Compose {
                            end,
                            entries,
                            composed,
                            keep,
                        };
                        return Ok(used);
                    }
                    let run: Vec<(&[u32], &B::Entry)> = job.segments[i + composed..i + to]
                        .iter()
                        .zip(&entries[composed..to])
                        .map(|(s, (e, _, _))| (&s.tokens[..], &**e))
                        .collect();
                    // Snapshots for the run's last `keep` segments, those of this part.
                    let first_kept = len - keep.min(len);
                    let keep_here = to - first_kept.clamp(composed, to);
                    let state = job.state.as_mut().expect("state after the prefix match");
                    let rope_fix = match job.mode {
                        Mode::Hypic { rope_fix, .. } => rope_fix,
                        _ => true,
                    };
                    let naive = job.mode == Mode::NaiveAddition;
                    let snaps = self
                        .backend
                        .compose_run(&run, state, naive, rope_fix, keep_here)?;
                    used += cost;
                    for (k, snap_state) in snaps {
                        let snap = Snapshot {
                            state: snap_state,
                            logits: None,
                        };
                        let bytes = B::state_bytes(&snap.state);
                        lock(&self.private).insert(
                            job.pkeys[i + composed + k],
                            Arc::new(snap),
                            bytes,
                            0,
                            &job.tenant,
                        );
                    }
                    job.step = Step::Compose {
                        end,
                        entries,
                        composed: to,
                        keep,
                    };
                }
            }
        }
    }

    /// Private-pool snapshots for the run `job.i..end` (see
    /// [`Pic::snapshots_to_keep`]; 0 when the mode keeps none).
    fn run_keep(&self, job: &PicJob<B>, end: usize) -> usize {
        match job.state.as_ref() {
            Some(state) if job.use_private => self.snapshots_to_keep(state, end - job.i),
            _ => 0,
        }
    }

    /// Step 1 of a job: the longest private-pool prefix. Returns `true` when the
    /// whole request was a hit (the job is then done).
    fn match_prefix(&self, job: &mut PicJob<B>) -> Result<bool> {
        let be = &self.backend;
        let n = job.segments.len();
        job.state = Some(be.new_state()?);
        if !job.use_private {
            return Ok(false);
        }
        let mut pool = lock(&self.private);
        for i in (1..=n).rev() {
            if !pool.contains(&job.pkeys[i - 1]) {
                continue;
            }
            // A spilled snapshot whose checksum fails is dropped: a miss.
            let Some(snap) = be.decoding(|| pool.get(&job.pkeys[i - 1])) else {
                continue;
            };
            if i == n {
                let Some(logits) = snap.logits.clone() else {
                    continue;
                };
                drop(pool);
                let mut stats = PicStats::default();
                for j in 0..n {
                    let m = job.segments[j].tokens.len();
                    stats.segments.push(job.stat(j, Outcome::PrefixHit, 0, m));
                }
                stats.hits = n;
                stats.tokens_reused = job.segments.iter().map(|s| s.tokens.len()).sum();
                job.output = Some(PicOutput {
                    logits,
                    state: be.clone_state(&snap.state)?,
                    stats,
                });
                job.state = None;
                job.step = Step::Done;
                return Ok(true);
            }
            job.state = Some(be.clone_state(&snap.state)?);
            job.i = i;
            for j in 0..i {
                let m = job.segments[j].tokens.len();
                let st = job.stat(j, Outcome::PrefixHit, 0, m);
                job.stats.segments.push(st);
            }
            break;
        }
        Ok(false)
    }

    /// A computed segment `job.i` is done: its statistics and, in the modes that use
    /// it, the private-pool snapshot after it.
    fn finish_computed(&self, job: &mut PicJob<B>) -> Result<()> {
        let i = job.i;
        let last = i + 1 == job.segments.len();
        let use_private = job.use_private;
        let reason = computed_reason(&job.mode, last, || {
            use_private
                .then(|| lock(&self.private).departure(&job.pkeys[i]))
                .flatten()
        });
        let m = job.segments[i].tokens.len();
        let st = SegmentStat {
            miss_reason: reason,
            ..job.stat(i, Outcome::Computed, m, 0)
        };
        job.stats.segments.push(st);
        if use_private {
            let state = job.state.as_ref().expect("state after the prefix match");
            let snap = Snapshot {
                state: self.backend.clone_state(state)?,
                logits: if last { Some(job.logits.clone()) } else { None },
            };
            let bytes = B::state_bytes(&snap.state) + 4 * job.logits.len();
            lock(&self.private).insert(job.pkeys[i], Arc::new(snap), bytes, 0, &job.tenant);
        }
        Ok(())
    }

    /// The statistics of a composed run `job.i ..` (its `entries`, in order).
    fn finish_run(&self, job: &mut PicJob<B>, entries: &[Composed<B::Entry>]) {
        for (k, (e, outcome, reason)) in entries.iter().enumerate() {
            let m = job.segments[job.i + k].tokens.len();
            let window = e.body_start().min(m);
            let (computed, reused) = match outcome {
                Outcome::Hit => (window, m - window),
                _ => (m + window, 0),
            };
            let st = SegmentStat {
                miss_reason: *reason,
                seam: window,
                ..job.stat(job.i + k, *outcome, computed, reused)
            };
            job.stats.segments.push(st);
        }
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
    /// reason and which entries to build, that one and the segment's entries for its
    /// other roles ([`Mode::entry_body_starts`]) that are not resident (one
    /// [`PicBackend::build_entries`] call, or one build in pieces, over every role,
    /// in the canonical order); [`Pic::store_roles`] offers them to the pool.
    fn plan_roles(
        &self,
        tokens: &[u32],
        isolation: &str,
        content: &Key,
        mode: Mode,
        body_start: usize,
    ) -> (RolePlan, MissReason) {
        let roles = miss_roles(&mode, body_start, tokens.len());
        let keys: Vec<Key> = roles
            .iter()
            .map(|&b| public_key(content, isolation, b))
            .collect();
        let key = public_key(content, isolation, body_start);
        let pool = lock(&self.public);
        let wanted: Vec<bool> = roles
            .iter()
            .zip(&keys)
            .map(|(b, k)| *b == body_start || !pool.contains(k))
            .collect();
        let reason = public_miss_reason(&pool, &key, &keys);
        (
            RolePlan {
                roles,
                keys,
                key,
                wanted,
                body_start,
            },
            reason,
        )
    }

    /// Offers the entries `built` by a [`RolePlan`] to the public pool, the needed
    /// one last (the most recent under LRU); returns the needed one.
    fn store_roles(
        &self,
        tokens: &[u32],
        isolation: &str,
        plan: RolePlan,
        built: Vec<Option<B::Entry>>,
    ) -> Result<Arc<B::Entry>> {
        let m = tokens.len();
        let mut needed = None;
        for (((b, k), e), w) in plan.roles.iter().zip(plan.keys).zip(built).zip(plan.wanted) {
            match e {
                Some(e) if *b == plan.body_start => needed = Some(Arc::new(e)),
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
        let _: Insert = lock(&self.public).insert(plan.key, e.clone(), bytes, m, isolation);
        Ok(e)
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

/// How long one [`Pic::advance`] call that must make progress waits for a pending
/// scattered entry before it returns (the scheduler then runs its decode step and
/// calls again).
const SOURCE_WAIT: Duration = Duration::from_millis(5);

/// Tokens a piece of a prefill in pieces is a multiple of (the GDN kernel's chunk
/// length, so that a piece boundary is also a chunk boundary), unless it ends the
/// segment.
pub const PREFILL_ALIGN: usize = crate::mixers::gated_deltanet::DEFAULT_CHUNK;

/// Length of the next piece of a span with `rest` tokens to go and `left` tokens of
/// budget: all of it when it fits, else the largest multiple of [`PREFILL_ALIGN`]
/// that fits, else (`first`: nothing ran yet in this call) one aligned piece.
fn piece(rest: usize, left: usize, first: bool) -> Option<usize> {
    if rest <= left {
        return Some(rest);
    }
    let aligned = left / PREFILL_ALIGN * PREFILL_ALIGN;
    if aligned > 0 {
        Some(aligned)
    } else if first {
        Some(rest.min(PREFILL_ALIGN))
    } else {
        None
    }
}

/// Which entries a public-pool miss builds ([`Pic::plan_roles`]).
struct RolePlan {
    /// Body starts built, ascending.
    roles: Vec<usize>,
    /// Their public-pool keys.
    keys: Vec<Key>,
    /// Key of the needed entry.
    key: Key,
    /// Whether each is offered to the pool.
    wanted: Vec<bool>,
    /// Body start of the needed entry.
    body_start: usize,
}

/// A missed entry being built in pieces.
struct Build {
    plan: RolePlan,
    reason: MissReason,
    partial: Box<dyn std::any::Any + Send>,
    /// Tokens of the segment run so far.
    done: usize,
}

/// An entry of a composed run: the entry, how it was found, why not reused.
type Composed<E> = (Arc<E>, Outcome, Option<MissReason>);

/// Where a [`PicJob`] stands.
enum Step<E> {
    /// The private-pool prefix match has not run.
    Prefix,
    /// Computed segment `i` is being prefilled; `at` tokens of it are done.
    Compute { at: usize },
    /// Entries of the run of composed segments `i..end` are found (or built), the
    /// next one (`end`) perhaps being built in pieces.
    Gather {
        end: usize,
        entries: Vec<Composed<E>>,
        build: Option<Build>,
        /// Of `entries`, those composed already (a scattered run composes what is
        /// in while the rest is shipped).
        composed: usize,
        /// The run's snapshot count once decided.
        keep: Option<usize>,
    },
    /// The run `i..end` is being composed; `composed` of its segments are done and
    /// the run's last `keep` get private-pool snapshots.
    Compose {
        end: usize,
        entries: Vec<Composed<E>>,
        composed: usize,
        keep: usize,
    },
    /// Every segment is done.
    Query,
    /// The output is ready (or taken).
    Done,
}

/// A request's prompt processing in progress ([`Pic::begin`], [`Pic::advance`]).
pub struct PicJob<B: PicBackend> {
    segments: Vec<SegmentRef>,
    mode: Mode,
    tenant: String,
    contents: Vec<Key>,
    pkeys: Vec<Key>,
    use_private: bool,
    stats: PicStats,
    /// The running state (after the prefix match, until the output is made).
    state: Option<B::State>,
    /// First segment not yet done.
    i: usize,
    step: Step<B::Entry>,
    /// Logits of the last computed segment's last token.
    logits: Vec<f32>,
    output: Option<PicOutput<B::State>>,
    /// Entries of scattered cold segments ([`Pic::begin_with_source`]).
    source: Option<Arc<dyn EntrySource>>,
    /// The segment whose public-pool lookup missed while its scattered entries
    /// were pending or before its build started (not counted again when the engine
    /// comes back to it).
    probed: Option<usize>,
}

impl<B: PicBackend> PicJob<B> {
    /// Whether the prompt is processed (the output is ready or was taken).
    pub fn is_done(&self) -> bool {
        matches!(self.step, Step::Done)
    }

    /// The output, once done (`None` before, or when taken).
    pub fn take_output(&mut self) -> Option<PicOutput<B::State>> {
        self.output.take()
    }

    /// Prompt tokens of the request.
    pub fn prompt_tokens(&self) -> usize {
        self.segments.iter().map(|s| s.tokens.len()).sum()
    }

    fn compute_here(&self, i: usize) -> bool {
        computed_in_place(&self.mode, i, &self.segments)
    }

    /// End of the run of composed segments that contains segment `i`.
    fn run_end(&self, i: usize) -> usize {
        (i..self.segments.len())
            .find(|&j| self.compute_here(j))
            .unwrap_or(self.segments.len())
    }

    /// The step of segment `self.i`.
    fn next_step(&self) -> Step<B::Entry> {
        if self.i == self.segments.len() {
            Step::Query
        } else if self.compute_here(self.i) {
            Step::Compute { at: 0 }
        } else {
            Step::Gather {
                end: self.i,
                entries: vec![],
                build: None,
                composed: 0,
                keep: None,
            }
        }
    }

    fn stat(&self, i: usize, outcome: Outcome, computed: usize, reused: usize) -> SegmentStat {
        SegmentStat {
            index: i,
            tokens: self.segments[i].tokens.len(),
            outcome,
            computed,
            reused,
            seam: 0,
            content_hash: hex::encode(self.contents[i]),
            miss_reason: None,
        }
    }
}

/// Whether segment `i` of `segments` is prefilled in place in `mode` (the query,
/// every segment of full recompute and prefix cache, a middle segment inside its
/// seam window) rather than composed from a public-pool entry.
fn computed_in_place(mode: &Mode, i: usize, segments: &[SegmentRef]) -> bool {
    i + 1 == segments.len()
        || matches!(mode, Mode::FullRecompute | Mode::PrefixCache)
        || (matches!(mode, Mode::Hypic { .. }) && mode.body_start(i) >= segments[i].tokens.len())
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
        stats.seam_tokens += s.seam;
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
/// A segment registration whose public-pool entries are being built in pieces
/// ([`Pic::prefetch_begin`], [`Pic::prefetch_advance`], [`Pic::prefetch_finish`]): the
/// scheduler runs it within its token budget, beside the decode steps.
pub struct PrefetchJob<E> {
    seg: SegmentRef,
    body_starts: Vec<usize>,
    /// Result rows known at the start (resident, not needed).
    out: Vec<(Prefetch, usize)>,
    /// `(row, body start, key)` of the entries to build.
    missing: Vec<(usize, usize, Key)>,
    /// A backend build in pieces, when the segment did not fit one step.
    partial: Option<Box<dyn std::any::Any + Send>>,
    /// Tokens of the segment run so far by the build in pieces.
    done: usize,
    /// The built entries (in the order of `missing`), or the build's error.
    built: Option<Result<Vec<E>>>,
}

impl<E> PrefetchJob<E> {
    /// Whether every entry is built (or the build failed): [`Pic::prefetch_finish`]
    /// may be called.
    pub fn is_built(&self) -> bool {
        self.built.is_some() || self.missing.is_empty()
    }

    /// Tokens of the segment.
    pub fn len(&self) -> usize {
        self.seg.tokens.len()
    }

    /// Whether the segment is empty (never: [`Pic::prefetch_begin`] refuses it).
    pub fn is_empty(&self) -> bool {
        self.seg.tokens.is_empty()
    }
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
        let mut job = self.prefetch_begin(tokens.to_vec(), isolation, body_starts)?;
        self.prefetch_advance(&mut job, usize::MAX, true)?;
        self.prefetch_finish(job)
    }

    /// Starts a segment registration that builds in pieces of the scheduler's token
    /// budget ([`Pic::prefetch_advance`], then [`Pic::prefetch_finish`]): checks the
    /// segment and which of the body starts' entries are resident; runs nothing.
    /// [`Pic::prefetch_many`] is this job run in one piece.
    ///
    /// Errors: as [`Pic::prefetch`].
    pub fn prefetch_begin(
        &self,
        tokens: Vec<u32>,
        isolation: &str,
        body_starts: &[usize],
    ) -> Result<PrefetchJob<B::Entry>> {
        let seg = SegmentRef {
            tokens,
            isolation: isolation.to_string(),
        };
        self.validate(std::slice::from_ref(&seg))?;
        let mut out = vec![(Prefetch::NotNeeded, 0); body_starts.len()];
        let mut missing: Vec<(usize, usize, Key)> = vec![];
        for (j, &b) in body_starts.iter().enumerate() {
            if b > 0 && b >= seg.tokens.len() {
                continue;
            }
            let key = self.entry_key(&seg.tokens, isolation, b);
            match self.resident_key(&key) {
                Some(bytes) => out[j] = (Prefetch::Present, bytes),
                None if missing.iter().any(|&(_, mb, _)| mb == b) => {}
                None => missing.push((j, b, key)),
            }
        }
        Ok(PrefetchJob {
            seg,
            body_starts: body_starts.to_vec(),
            out,
            missing,
            partial: None,
            done: 0,
            built: None,
        })
    }

    /// Runs up to `budget` tokens of a registration begun by [`Pic::prefetch_begin`]
    /// and returns how many ran (0 once its entries are built). A segment that fits
    /// the budget is built in one pass, as [`Pic::prefetch_many`] builds it; a longer
    /// one through [`PicBackend::build_entries_start`] in pieces that are multiples of
    /// [`PREFILL_ALIGN`] (its entries then equal the one-pass build up to fp32
    /// rounding). With `progress`, at least one piece runs even over the budget.
    ///
    /// Errors: model failures (the job is then finished with that error).
    pub fn prefetch_advance(
        &self,
        job: &mut PrefetchJob<B::Entry>,
        budget: usize,
        progress: bool,
    ) -> Result<usize> {
        if job.is_built() {
            return Ok(0);
        }
        let m = job.seg.tokens.len();
        let starts: Vec<usize> = job.missing.iter().map(|&(_, b, _)| b).collect();
        if job.partial.is_none() && job.done == 0 {
            if m <= budget || (progress && m <= PREFILL_ALIGN) {
                job.built = Some(self.build_entries(&job.seg.tokens, &starts));
                return Ok(m);
            }
            if !progress && budget < PREFILL_ALIGN {
                // Not even one aligned piece fits: start the build when one does.
                return Ok(0);
            }
            match self.backend.build_entries_start(&job.seg.tokens, &starts)? {
                Some(p) => job.partial = Some(p),
                None if progress => {
                    // This backend builds an entry in one call only.
                    job.built = Some(self.build_entries(&job.seg.tokens, &starts));
                    return Ok(m);
                }
                None => return Ok(0),
            }
        }
        let Some(n) = piece(m - job.done, budget, progress) else {
            return Ok(0);
        };
        let partial = job.partial.as_mut().expect("a build in pieces");
        let (from, to) = (job.done, job.done + n);
        if let Err(e) =
            self.backend
                .build_entries_continue(&mut **partial, &job.seg.tokens, from, to)
        {
            job.partial = None;
            job.built = Some(Err(e));
            return Ok(n);
        }
        job.done = to;
        if to == m {
            let partial = job.partial.take().expect("a build in pieces");
            job.built = Some(
                self.backend
                    .build_entries_finish(partial, &job.seg.tokens)
                    .and_then(|v| {
                        v.into_iter()
                            .map(|e| {
                                e.ok_or_else(|| Error::Input("no cache entry was built".into()))
                            })
                            .collect()
                    }),
            );
        }
        Ok(n)
    }

    /// Offers the entries a finished registration built to the public pool and
    /// returns, in the order of its body starts, what happened and each entry's bytes
    /// (as [`Pic::prefetch_many`]).
    ///
    /// Errors: the job is not built yet ([`PrefetchJob::is_built`]); the build's own
    /// error.
    pub fn prefetch_finish(&self, job: PrefetchJob<B::Entry>) -> Result<Vec<(Prefetch, usize)>> {
        let PrefetchJob {
            seg,
            body_starts,
            mut out,
            missing,
            built,
            ..
        } = job;
        if missing.is_empty() {
            return Ok(fill_duplicates(&body_starts, out));
        }
        let built = built.ok_or_else(|| {
            Error::Input("the segment registration has not been built yet".into())
        })??;
        for ((j, _, key), e) in missing.into_iter().zip(built) {
            let bytes = e.bytes();
            let r = lock(&self.public).insert(
                key,
                Arc::new(e),
                bytes,
                seg.tokens.len(),
                &seg.isolation,
            );
            out[j] = match r {
                Insert::Stored { .. } => (Prefetch::Stored, bytes),
                Insert::Present => (Prefetch::Present, bytes),
                Insert::NotAdmitted | Insert::NoRoom => (Prefetch::Refused, 0),
            };
        }
        Ok(fill_duplicates(&body_starts, out))
    }

    /// The entries of `tokens` under `isolation` for each of `body_starts` (a
    /// worker's answer to a scatter task): taken from the public pool when every one
    /// is resident (`true`), else built in one [`PicBackend::build_entries`] call
    /// and offered to the pool (`false`). In the order of `body_starts`.
    ///
    /// Errors: as [`Pic::prefetch`].
    pub fn entries_for(
        &self,
        tokens: &[u32],
        isolation: &str,
        body_starts: &[usize],
    ) -> Result<(Vec<Arc<B::Entry>>, bool)> {
        self.validate(&[SegmentRef {
            tokens: tokens.to_vec(),
            isolation: isolation.to_string(),
        }])?;
        let keys: Vec<Key> = body_starts
            .iter()
            .map(|&b| self.entry_key(tokens, isolation, b))
            .collect();
        let found: Vec<Option<Arc<B::Entry>>> = keys.iter().map(|k| self.get_public(k)).collect();
        if found.iter().all(Option::is_some) {
            return Ok((found.into_iter().flatten().collect(), true));
        }
        let built = self.build_entries(tokens, body_starts)?;
        let mut out = Vec::with_capacity(built.len());
        for (k, e) in keys.into_iter().zip(built) {
            let e = Arc::new(e);
            let bytes = e.bytes();
            let _: Insert = lock(&self.public).insert(k, e.clone(), bytes, tokens.len(), isolation);
            out.push(e);
        }
        Ok((out, false))
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
