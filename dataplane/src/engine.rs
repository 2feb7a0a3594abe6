//! The engine interface of the serving path: what the [`crate::scheduler`] and
//! `hypic serve` need from a PIC engine, so that the CPU [`crate::pic::PicEngine`]
//! and the GPU `cuda::pic::GpuPicEngine` (feature `cuda`) are interchangeable. Both
//! are the one generic engine [`Pic`] over a [`PicBackend`], which implements these
//! traits once.
//!
//! * [`EnginePools`] (object safe): the model config, which backend serves, and the
//!   pool operations of segment registration, residency, eviction, invalidation,
//!   metrics and spill. The server keeps an `Arc<dyn EnginePools>`.
//! * [`Engine`]: adds the request path, [`Engine::run`] (PIC assembly of a prompt,
//!   returning the last-token logits and the running state) and
//!   [`Engine::decode_batch`] (one decode step for several running sequences), over
//!   the engine's own sequence state type ([`Engine::State`]: a host `ModelState` on
//!   the CPU, a device `GpuState` on the GPU). The scheduler's worker is generic
//!   over it.
//!
//! [`Engine::decode_batch`] returns logits to the host (fp32): the scheduler samples
//! with the CPU [`crate::sampling::Sampler`] and computes log-probabilities from them.
//! [`Engine::decode_sample`] lets a backend draw the tokens of rows without logit
//! processors itself (the GPU does, on the device, with the same draw as the
//! [`crate::sampling::Sampler`]), so only token ids cross to the host; by default it
//! is the host path.
use crate::config::ModelConfig;
use crate::error::Result;
use crate::parallel::wire::ModelFingerprint;
use crate::parallel::EntrySource;
use crate::pic::engine::PicJob;
use crate::pic::engine::Snapshot;
use crate::pic::pool::{CachePolicy, PoolObserver, PoolStats};
use crate::pic::spill::Spill;
use crate::pic::{EntryReport, Mode, Pic, PicBackend, PicStats, Prefetch, SegmentRef};
use crate::sampling::DrawParams;
use serde::Serialize;
use std::sync::Arc;

/// Which backend an engine runs on (for logs, `/health` and `/metrics`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BackendInfo {
    /// `cpu` or `cuda`.
    pub device: String,
    /// Weight and activation type: `f32` or `bf16`.
    pub dtype: String,
    /// One-line description: `cpu`, or `cuda:0 NVIDIA H200 (sm_90a) bf16`.
    pub describe: String,
}

impl BackendInfo {
    /// The CPU reference backend (always fp32).
    pub fn cpu() -> Self {
        BackendInfo {
            device: "cpu".into(),
            dtype: "f32".into(),
            describe: "cpu".into(),
        }
    }
}

/// Result of [`Engine::run`].
#[derive(Clone, Debug)]
pub struct EngineOutput<S> {
    /// Logits of the prompt's last token, `[vocab]` (host, fp32).
    pub logits: Vec<f32>,
    /// Running state after the prompt, ready for [`Engine::decode_batch`].
    pub state: S,
    /// PIC statistics.
    pub stats: PicStats,
}

/// One row's result of [`Engine::decode_sample`].
#[derive(Clone, Debug, PartialEq)]
pub enum Decoded {
    /// The row's logits, `[vocab]` (host, fp32): the caller samples (host path).
    Logits(Vec<f32>),
    /// The token the backend drew with the row's [`DrawParams`].
    Token(u32),
}

/// Checks the argument lengths of a [`Engine::decode_sample`] call.
///
/// Errors: [`crate::Error::Input`] when `draws` and `tokens` differ in length.
pub fn check_draws(tokens: &[u32], draws: &[Option<DrawParams>]) -> Result<()> {
    if draws.len() != tokens.len() {
        return Err(crate::Error::Input(format!(
            "{} draw parameter rows for {} decode tokens",
            draws.len(),
            tokens.len()
        )));
    }
    Ok(())
}

/// Pool-side operations of a PIC engine (object safe; see the module docs).
pub trait EnginePools: Send + Sync {
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// Which backend serves.
    fn backend(&self) -> BackendInfo;
    /// Bytes of one K or V element in the engine's KV caches (4 for fp32).
    fn kv_elem_bytes(&self) -> usize {
        4
    }
    /// KV bytes one token costs across all full-attention layers (K and V, plus
    /// its position).
    fn kv_bytes_per_token(&self) -> usize {
        let c = self.config();
        let full = c.num_attention_layers();
        full * 2 * c.num_kv_heads * c.head_dim * self.kv_elem_bytes() + full * 8
    }
    /// Builds the public-pool entries of `tokens` under `isolation` for each body
    /// start unless resident (see [`Pic::prefetch_many`]).
    fn prefetch_many(
        &self,
        tokens: &[u32],
        isolation: &str,
        body_starts: &[usize],
    ) -> Result<Vec<(Prefetch, usize)>>;
    /// Bytes of the resident public-pool entry, if any (not counted as a lookup).
    fn resident_bytes(&self, tokens: &[u32], isolation: &str, body_start: usize) -> Option<usize>;
    /// Removes the public-pool entries of `tokens` under `isolation` for each body
    /// start; returns how many were present.
    fn evict_segment(&self, tokens: &[u32], isolation: &str, body_starts: &[usize]) -> usize;
    /// As [`EnginePools::evict_segment`], but leaves no departure record, so a
    /// later miss on these entries reports `never_seen` (whether or not they were
    /// present); returns how many were present.
    fn forget_segment(&self, tokens: &[u32], isolation: &str, body_starts: &[usize]) -> usize;
    /// Drops every entry and snapshot owned by `isolation`; returns how many.
    fn invalidate_owner(&self, isolation: &str) -> usize;
    /// `(entries, bytes, stats)` of the public pool.
    fn public_usage(&self) -> (usize, usize, PoolStats);
    /// `(entries, bytes, stats)` of the private pool.
    fn private_usage(&self) -> (usize, usize, PoolStats);
    /// `(entries, bytes, capacity)` of the public and private spill tiers.
    fn spill_usage(&self) -> [(usize, usize, usize); 2];
    /// Clears both pools.
    fn clear(&self);
    /// Replaces the public pool's admission/eviction policy.
    fn set_public_policy(&self, p: Box<dyn CachePolicy>);
    /// Gives both pools host spill tiers of the given byte capacities (0: none).
    fn enable_spill(&self, public_bytes: usize, private_bytes: usize);
    /// SHA-256 (hex) of the model id and a segment's tokens.
    fn content_hash(&self, tokens: &[u32]) -> String;
    /// Residency and remembered history of one public-pool entry (see
    /// [`Pic::entry_report`]); not a lookup.
    fn entry_report(&self, tokens: &[u32], isolation: &str, body_start: usize) -> EntryReport;
    /// The cold segments of a request and the body starts each one's miss builds
    /// (see [`Pic::cold_segments`]): what a scatter sends to workers.
    fn cold_segments(
        &self,
        segments: &[SegmentRef],
        mode: Mode,
        tenant: &str,
    ) -> Vec<(usize, Vec<usize>)>;
    /// The model's identity as shipped entries carry it (see
    /// [`Pic::model_fingerprint`]).
    fn model_fingerprint(&self) -> ModelFingerprint;
    /// Sets the observer of the public pool's changes (see
    /// [`Pic::set_residency_observer`]); engines without pools ignore it.
    fn set_residency_observer(&self, _o: Option<Arc<dyn PoolObserver>>) {}
    /// The public-pool key of `tokens` under `isolation` for `body_start` (see
    /// [`Pic::public_entry_key`]); `None` for engines without a public pool.
    fn public_entry_key(
        &self,
        _tokens: &[u32],
        _isolation: &str,
        _body_start: usize,
    ) -> Option<[u8; 32]> {
        None
    }
    /// What the public pool's primary tier is, for reports: `gpu` on the CUDA
    /// backend, `host` on the CPU.
    fn primary_tier_name(&self) -> &'static str {
        if self.backend().device == "cuda" {
            "gpu"
        } else {
            "host"
        }
    }
}

/// A PIC engine the scheduler can drive (see the module docs).
pub trait Engine: EnginePools {
    /// Running state of one sequence.
    type State: 'static;
    /// Serves one prompt: prefix/PIC reuse per `mode`, then the query segment
    /// (see [`Pic::run`]).
    ///
    /// Errors: [`crate::Error::Input`] for an invalid request, [`crate::Error::Device`]
    /// for a device failure.
    fn run(
        &self,
        segments: &[SegmentRef],
        mode: Mode,
        tenant: &str,
    ) -> Result<EngineOutput<Self::State>>;
    /// A prompt being processed in steps ([`Engine::begin`]).
    type Prefill: 'static;
    /// Starts processing a prompt in steps of bounded model work (the scheduler's
    /// token-budget loop): checks the request, runs nothing yet.
    ///
    /// Errors: [`crate::Error::Input`] for an invalid request.
    fn begin(&self, segments: &[SegmentRef], mode: Mode, tenant: &str) -> Result<Self::Prefill>;
    /// [`Engine::begin`] with the entries of scattered cold segments supplied by
    /// `source` (see [`Pic::begin_with_source`]); the default ignores the source.
    ///
    /// Errors: as [`Engine::begin`].
    fn begin_with(
        &self,
        segments: &[SegmentRef],
        mode: Mode,
        tenant: &str,
        source: Option<Arc<dyn EntrySource>>,
    ) -> Result<Self::Prefill> {
        let _ = source;
        self.begin(segments, mode, tenant)
    }
    /// Advances `prefill` by at most `budget` tokens of model work (with
    /// `progress`, at least one piece even over it; see [`Pic::advance`]); returns
    /// the tokens run. A budget of 0 without `progress` runs no tokens through the
    /// model: only the prefix match, pool lookups and work without tokens (placing
    /// cached entries without seam windows, storing shipped entries). Once the
    /// prompt is done, [`Engine::finish`] gives its output.
    ///
    /// Errors: as [`Engine::run`]; the prefill is unusable after one.
    fn advance(&self, prefill: &mut Self::Prefill, budget: usize, progress: bool) -> Result<usize>;
    /// The output of a done prefill (`None`: not done yet, or already taken).
    fn finish(&self, prefill: &mut Self::Prefill) -> Option<EngineOutput<Self::State>>;
    /// [`Engine::advance`] that stops before prefilling a segment computed in place,
    /// so that [`Engine::computed_piece`] can size that piece for a batch; the default
    /// is `advance` itself (an engine that does not batch).
    ///
    /// Errors: as [`Engine::advance`].
    fn advance_to_computed(
        &self,
        prefill: &mut Self::Prefill,
        budget: usize,
        progress: bool,
    ) -> Result<usize> {
        self.advance(prefill, budget, progress)
    }
    /// Tokens of the next piece of `prefill` when that piece is a plain prefill of a
    /// segment computed in place (the query, a segment of full recompute) that
    /// [`Engine::advance_computed_many`] can batch with other requests' pieces, within
    /// `budget` (`progress`: at least one piece); `None` otherwise (the default: the
    /// engine does not batch).
    fn computed_piece(
        &self,
        prefill: &Self::Prefill,
        budget: usize,
        progress: bool,
    ) -> Option<usize> {
        let _ = (prefill, budget, progress);
        None
    }
    /// Whether `prefill` stands at a segment computed in place (where
    /// [`Engine::advance_to_computed`] stops); false by default.
    fn at_computed(&self, prefill: &Self::Prefill) -> bool {
        let _ = prefill;
        false
    }
    /// A key shared by requests whose prompts start alike (same tenant, mode and
    /// first segment), whose prefix snapshots one may take from the other while that
    /// start is not cached yet; `None` when the request keeps none (the default) or
    /// the start is already cached.
    fn prefix_group(&self, prefill: &Self::Prefill) -> Option<[u8; 32]> {
        let _ = prefill;
        None
    }
    /// Whether the request has yet to look up its prompt prefix (its first
    /// [`Engine::advance`], even with a budget of 0, does that).
    fn before_prefix(&self, prefill: &Self::Prefill) -> bool {
        let _ = prefill;
        false
    }
    /// Runs the pieces [`Engine::computed_piece`] sized (`pieces[j]` tokens of
    /// `prefills[j]`) as one batched forward; returns the tokens run.
    ///
    /// Errors: as [`Engine::advance`], for the whole batch (every prefill in it is then
    /// unusable). The default refuses (no engine without
    /// [`Engine::computed_piece`] is asked).
    fn advance_computed_many(
        &self,
        prefills: &mut [&mut Self::Prefill],
        pieces: &[usize],
    ) -> Result<usize> {
        let _ = (prefills, pieces);
        Err(crate::Error::Input(
            "this engine does not batch prefills".into(),
        ))
    }
    /// A segment registration built in pieces of the scheduler's token budget.
    type Registration: Send + 'static;
    /// Starts registering `tokens` under `isolation` for `body_starts` (see
    /// [`Pic::prefetch_begin`]): checks it and which entries are resident; runs
    /// nothing.
    ///
    /// Errors: as [`EnginePools::prefetch_many`].
    fn register_begin(
        &self,
        tokens: Vec<u32>,
        isolation: &str,
        body_starts: &[usize],
    ) -> Result<Self::Registration>;
    /// Runs at most `budget` tokens of a registration (with `progress`, one piece
    /// even over it; see [`Pic::prefetch_advance`]); returns the tokens run.
    ///
    /// Errors: model failures.
    fn register_advance(
        &self,
        job: &mut Self::Registration,
        budget: usize,
        progress: bool,
    ) -> Result<usize>;
    /// Whether a registration's entries are built ([`Engine::register_finish`] may
    /// be called).
    fn register_built(job: &Self::Registration) -> bool;
    /// Offers the built entries to the public pool; what happened per body start,
    /// as [`EnginePools::prefetch_many`] reports it.
    ///
    /// Errors: an unbuilt registration, the build's error.
    fn register_finish(&self, job: Self::Registration) -> Result<Vec<(Prefetch, usize)>>;
    /// Appends `tokens[b]` to `states[b]` for every `b`; returns `[B][vocab]` logits.
    fn decode_batch(
        &self,
        tokens: &[u32],
        states: &mut [&mut Self::State],
    ) -> Result<Vec<Vec<f32>>>;
    /// One decode step as [`Engine::decode_batch`], with the next token of row `b`
    /// drawn by the engine when `draws[b]` is `Some` (the draw of
    /// [`crate::sampling::draw`], e.g. on the device, so no logits cross to the
    /// host); a `None` row (logit processors, a constraint, log-probabilities
    /// requested, scoring) gets its logits. An engine may return logits for a `Some`
    /// row too (the default does for every row: the host path); the caller then
    /// samples them itself.
    ///
    /// Errors: as [`Engine::decode_batch`]; [`crate::Error::Input`] when
    /// `draws.len() != tokens.len()`.
    fn decode_sample(
        &self,
        tokens: &[u32],
        states: &mut [&mut Self::State],
        draws: &[Option<DrawParams>],
    ) -> Result<Vec<Decoded>> {
        check_draws(tokens, draws)?;
        Ok(self
            .decode_batch(tokens, states)?
            .into_iter()
            .map(Decoded::Logits)
            .collect())
    }
    /// An independent copy of a running state: a fork of the sequence (the
    /// scheduler scores a teacher-forced continuation on it, see
    /// [`crate::scheduler::GenRequest::score`]).
    ///
    /// Errors: [`crate::Error::Device`] when the copy cannot be allocated.
    fn clone_state(&self, state: &Self::State) -> Result<Self::State>;
    /// Memory held by a running state, bytes.
    fn state_bytes(state: &Self::State) -> usize;
}

/// Every PIC engine serves: the pool operations, through the generic engine.
/// Device work (prefetch, run, decode) holds the backend's
/// [`PicBackend::exclusive`] guard.
impl<B: PicBackend> EnginePools for Pic<B>
where
    Snapshot<B::State>: Spill,
{
    fn config(&self) -> &ModelConfig {
        self.pic_backend().config()
    }
    fn backend(&self) -> BackendInfo {
        Pic::pic_backend(self).info()
    }
    fn kv_elem_bytes(&self) -> usize {
        Pic::pic_backend(self).kv_elem_bytes()
    }
    fn prefetch_many(
        &self,
        tokens: &[u32],
        isolation: &str,
        body_starts: &[usize],
    ) -> Result<Vec<(Prefetch, usize)>> {
        let _serial = Pic::pic_backend(self).exclusive();
        Pic::prefetch_many(self, tokens, isolation, body_starts)
    }
    fn resident_bytes(&self, tokens: &[u32], isolation: &str, body_start: usize) -> Option<usize> {
        Pic::resident_bytes(self, tokens, isolation, body_start)
    }
    fn evict_segment(&self, tokens: &[u32], isolation: &str, body_starts: &[usize]) -> usize {
        Pic::evict_segment(self, tokens, isolation, body_starts)
    }
    fn forget_segment(&self, tokens: &[u32], isolation: &str, body_starts: &[usize]) -> usize {
        Pic::forget_segment(self, tokens, isolation, body_starts)
    }
    fn invalidate_owner(&self, isolation: &str) -> usize {
        Pic::invalidate_owner(self, isolation)
    }
    fn public_usage(&self) -> (usize, usize, PoolStats) {
        Pic::public_usage(self)
    }
    fn private_usage(&self) -> (usize, usize, PoolStats) {
        Pic::private_usage(self)
    }
    fn spill_usage(&self) -> [(usize, usize, usize); 2] {
        Pic::spill_usage(self)
    }
    fn clear(&self) {
        Pic::clear(self)
    }
    fn set_public_policy(&self, p: Box<dyn CachePolicy>) {
        Pic::set_public_policy(self, p)
    }
    fn enable_spill(&self, public_bytes: usize, private_bytes: usize) {
        Pic::enable_spill(self, public_bytes, private_bytes)
    }
    fn content_hash(&self, tokens: &[u32]) -> String {
        Pic::content_hash(self, tokens)
    }
    fn entry_report(&self, tokens: &[u32], isolation: &str, body_start: usize) -> EntryReport {
        Pic::entry_report(self, tokens, isolation, body_start)
    }
    fn cold_segments(
        &self,
        segments: &[SegmentRef],
        mode: Mode,
        tenant: &str,
    ) -> Vec<(usize, Vec<usize>)> {
        Pic::cold_segments(self, segments, mode, tenant)
    }
    fn model_fingerprint(&self) -> ModelFingerprint {
        Pic::model_fingerprint(self)
    }
    fn set_residency_observer(&self, o: Option<Arc<dyn PoolObserver>>) {
        Pic::set_residency_observer(self, o)
    }
    fn public_entry_key(
        &self,
        tokens: &[u32],
        isolation: &str,
        body_start: usize,
    ) -> Option<[u8; 32]> {
        Some(Pic::public_entry_key(self, tokens, isolation, body_start))
    }
}

/// The scheduler's interface: prefill through [`Pic::run`], decode through the
/// backend; invalid requests are [`crate::Error::Input`] (checked before any device
/// work).
impl<B: PicBackend> Engine for Pic<B>
where
    Snapshot<B::State>: Spill,
{
    type State = B::State;
    fn run(
        &self,
        segments: &[SegmentRef],
        mode: Mode,
        tenant: &str,
    ) -> Result<EngineOutput<B::State>> {
        self.validate(segments)?;
        let _serial = Pic::pic_backend(self).exclusive();
        let out = Pic::run(self, segments, mode, tenant)?;
        Ok(EngineOutput {
            logits: out.logits,
            state: out.state,
            stats: out.stats,
        })
    }
    type Prefill = PicJob<B>;
    fn begin(&self, segments: &[SegmentRef], mode: Mode, tenant: &str) -> Result<PicJob<B>> {
        Pic::begin(self, segments.to_vec(), mode, tenant)
    }
    fn begin_with(
        &self,
        segments: &[SegmentRef],
        mode: Mode,
        tenant: &str,
        source: Option<Arc<dyn EntrySource>>,
    ) -> Result<PicJob<B>> {
        Pic::begin_with_source(self, segments.to_vec(), mode, tenant, source)
    }
    fn advance(&self, prefill: &mut PicJob<B>, budget: usize, progress: bool) -> Result<usize> {
        let _serial = Pic::pic_backend(self).exclusive();
        Pic::advance(self, prefill, budget, progress)
    }
    fn finish(&self, prefill: &mut PicJob<B>) -> Option<EngineOutput<B::State>> {
        prefill.take_output().map(|out| EngineOutput {
            logits: out.logits,
            state: out.state,
            stats: out.stats,
        })
    }
    fn computed_piece(&self, prefill: &PicJob<B>, budget: usize, progress: bool) -> Option<usize> {
        Pic::computed_piece(self, prefill, budget, progress)
    }
    fn advance_to_computed(
        &self,
        prefill: &mut PicJob<B>,
        budget: usize,
        progress: bool,
    ) -> Result<usize> {
        let _serial = Pic::pic_backend(self).exclusive();
        Pic::advance_to_computed(self, prefill, budget, progress)
    }
    fn at_computed(&self, prefill: &PicJob<B>) -> bool {
        Pic::at_computed(self, prefill)
    }
    fn prefix_group(&self, prefill: &PicJob<B>) -> Option<[u8; 32]> {
        Pic::prefix_group(self, prefill)
    }
    fn before_prefix(&self, prefill: &PicJob<B>) -> bool {
        Pic::before_prefix(self, prefill)
    }
    fn advance_computed_many(
        &self,
        prefills: &mut [&mut PicJob<B>],
        pieces: &[usize],
    ) -> Result<usize> {
        let _serial = Pic::pic_backend(self).exclusive();
        Pic::advance_computed_many(self, prefills, pieces)?;
        Ok(pieces.iter().sum())
    }
    type Registration = crate::pic::PrefetchJob<B::Entry>;
    fn register_begin(
        &self,
        tokens: Vec<u32>,
        isolation: &str,
        body_starts: &[usize],
    ) -> Result<Self::Registration> {
        Pic::prefetch_begin(self, tokens, isolation, body_starts)
    }
    fn register_advance(
        &self,
        job: &mut Self::Registration,
        budget: usize,
        progress: bool,
    ) -> Result<usize> {
        let _serial = Pic::pic_backend(self).exclusive();
        Pic::prefetch_advance(self, job, budget, progress)
    }
    fn register_built(job: &Self::Registration) -> bool {
        job.is_built()
    }
    fn register_finish(&self, job: Self::Registration) -> Result<Vec<(Prefetch, usize)>> {
        // The pool insert may evict, and an evicted device entry spills (a download).
        let _serial = Pic::pic_backend(self).exclusive();
        Pic::prefetch_finish(self, job)
    }
    fn decode_batch(&self, tokens: &[u32], states: &mut [&mut B::State]) -> Result<Vec<Vec<f32>>> {
        let _serial = Pic::pic_backend(self).exclusive();
        Pic::pic_backend(self).decode_batch(tokens, states)
    }
    fn decode_sample(
        &self,
        tokens: &[u32],
        states: &mut [&mut B::State],
        draws: &[Option<DrawParams>],
    ) -> Result<Vec<Decoded>> {
        check_draws(tokens, draws)?;
        let _serial = Pic::pic_backend(self).exclusive();
        Pic::pic_backend(self).decode_sample(tokens, states, draws)
    }
    fn clone_state(&self, state: &B::State) -> Result<B::State> {
        let _serial = Pic::pic_backend(self).exclusive();
        Pic::pic_backend(self).clone_state(state)
    }
    fn state_bytes(state: &B::State) -> usize {
        B::state_bytes(state)
    }
}
