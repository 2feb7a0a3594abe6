//! The backend interface of the PIC engine: what [`super::engine::Pic`] needs from a
//! model on one device to assemble requests. The request logic (prefix match, public
//! hits and misses, seams, the query, statistics, prefetch, eviction) is written once
//! over this trait; the CPU reference ([`super::cpu::CpuBackend`]) and the CUDA
//! backend (`cuda::pic::GpuBackend`, feature `cuda`) implement it.
//!
//! Errors of a backend are [`crate::Error`]: [`crate::Error::Input`] for data that
//! does not fit the model, [`crate::Error::Device`] for a device failure.
use std::any::Any;
use std::sync::MutexGuard;

use crate::config::ModelConfig;
use crate::engine::BackendInfo;
use crate::error::Result;
use crate::pic::spill::Spill;

/// A public-pool entry of a backend: one segment prefilled alone, its body from
/// [`CacheEntry::body_start`].
pub trait CacheEntry {
    /// First body token (the seam width used to build it; 0 = the whole segment).
    fn body_start(&self) -> usize;
    /// Payload bytes as the pool accounts them (host bytes on the CPU, device bytes
    /// on the GPU).
    fn bytes(&self) -> usize;
}

/// One model on one device, as the PIC engine drives it (see the module docs).
pub trait PicBackend: Send + Sync + 'static {
    /// Running state of one sequence (all layers).
    type State: Send + Sync + 'static;
    /// Public-pool entry of one segment.
    type Entry: CacheEntry + Spill + Send + Sync + 'static;

    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// Which backend serves.
    fn info(&self) -> BackendInfo;
    /// Bytes of one K or V element in the backend's KV caches.
    fn kv_elem_bytes(&self) -> usize {
        4
    }

    /// A digest of (a sample of) the model's weights, part of the model fingerprint
    /// that shipped entries carry ([`crate::parallel::wire::ModelFingerprint`]); 0
    /// (the default) when the backend gives none, the configuration alone then
    /// identifying the model.
    fn weights_digest(&self) -> u128 {
        0
    }

    /// A fresh (zero) running state at position 0.
    fn new_state(&self) -> Result<Self::State>;
    /// An independent copy of `state` (a pool snapshot, or a state restored from one).
    fn clone_state(&self, state: &Self::State) -> Result<Self::State>;
    /// Bytes held by a running state, as the private pool accounts them.
    fn state_bytes(state: &Self::State) -> usize;
    /// Bytes of the recurrent part of a state (conv tails and linear-layer states;
    /// no KV): the smallest a snapshot of it can be.
    fn recurrent_bytes(state: &Self::State) -> usize;

    /// Prefills `tokens` from `state` (advanced in place) at positions
    /// `state.next_position ..`; returns the last token's logits `[vocab]` (host,
    /// fp32) when `last`, else an empty vector.
    fn prefill(&self, tokens: &[u32], state: &mut Self::State, last: bool) -> Result<Vec<f32>>;

    /// Prefills several sequences at once: `items[i] = (tokens, state, last)`, each as
    /// [`PicBackend::prefill`] would (tokens at the state's `next_position ..`, the
    /// state advanced, the last token's logits when `last`, else empty). A backend
    /// that can runs them as one batched forward (projections and FFN over all rows,
    /// each span's recurrence and attention on its own state); the default runs them
    /// one after the other.
    ///
    /// Errors: as [`PicBackend::prefill`]; after an error the states may be partly
    /// advanced.
    fn prefill_many(
        &self,
        items: &mut [(&[u32], &mut Self::State, bool)],
    ) -> Result<Vec<Vec<f32>>> {
        items
            .iter_mut()
            .map(|(tokens, state, last)| self.prefill(tokens, state, *last))
            .collect()
    }

    /// Whether [`PicBackend::prefill_many`] runs its items as one batched forward
    /// (the default runs them one after the other: false).
    fn batches_prefills(&self) -> bool {
        false
    }

    /// Builds the public-pool entries of `tokens` (prefilled alone, positions from 0)
    /// for the body starts `body_starts` (each clamped to the segment length), in
    /// that order. `wanted[j]` says whether entry `j` is needed; a needed one is
    /// always returned, an unneeded one may be (`None` otherwise). A backend that
    /// captures several body starts in one prefill builds them all, so that an entry
    /// does not depend on which of them were needed.
    fn build_entries(
        &self,
        tokens: &[u32],
        body_starts: &[usize],
        wanted: &[bool],
    ) -> Result<Vec<Option<Self::Entry>>>;

    /// Starts building the public-pool entries of `tokens` for `body_starts` (as
    /// [`PicBackend::build_entries`], every entry built) in pieces of tokens, so that
    /// a long cold segment does not take one long step: the engine then calls
    /// [`PicBackend::build_entries_continue`] over consecutive token ranges covering
    /// `0..tokens.len()` and [`PicBackend::build_entries_finish`] once. The entries
    /// equal those of the one-shot build up to fp32 rounding (the linear layers'
    /// pairs of the pieces are composed, `(T₂T₁, T₂S₁ + S₂)`, instead of one pass).
    ///
    /// `Ok(None)` (the default): this backend builds an entry in one call only; the
    /// engine then uses [`PicBackend::build_entries`] as one step.
    fn build_entries_start(
        &self,
        tokens: &[u32],
        body_starts: &[usize],
    ) -> Result<Option<Box<dyn Any + Send>>> {
        let _ = (tokens, body_starts);
        Ok(None)
    }

    /// Runs `tokens[from..to]` of a build begun by [`PicBackend::build_entries_start`]
    /// (ranges in order, without gaps).
    ///
    /// Errors: [`crate::Error::Input`] for a build of another backend or a range out
    /// of order; model failures.
    fn build_entries_continue(
        &self,
        build: &mut (dyn Any + Send),
        tokens: &[u32],
        from: usize,
        to: usize,
    ) -> Result<()> {
        let _ = (build, tokens, from, to);
        Err(crate::Error::Input(
            "this backend builds cache entries in one step".into(),
        ))
    }

    /// The entries (in the order of the body starts) of a build whose ranges covered
    /// the whole segment.
    ///
    /// Errors: [`crate::Error::Input`] for an unfinished build or one of another
    /// backend.
    fn build_entries_finish(
        &self,
        build: Box<dyn Any + Send>,
        tokens: &[u32],
    ) -> Result<Vec<Option<Self::Entry>>> {
        let _ = (build, tokens);
        Err(crate::Error::Input(
            "this backend builds cache entries in one step".into(),
        ))
    }

    /// Places cached segments one after the other after the running `state`
    /// (segment `k` at `b_k = state.next_position + Σ_{j<k} len_j`): each segment's
    /// seam window `tokens[..body_start]` runs through the model at its new
    /// positions, then its body is composed (`S ← T_body S + S_body|0`, or
    /// `S ← S + S_body|0` when `naive`) and its KV appended, re-rotated by `R(b_k)`
    /// unless `rope_fix` is off. `run[k] = (tokens of segment k, its entry)`.
    ///
    /// Returns `(k, state after segment k)` for the last `keep` segments of the run
    /// (the private pool's snapshots).
    fn compose_run(
        &self,
        run: &[(&[u32], &Self::Entry)],
        state: &mut Self::State,
        naive: bool,
        rope_fix: bool,
        keep: usize,
    ) -> Result<Vec<(usize, Self::State)>>;

    /// Appends `tokens[b]` to `states[b]` for every `b`; returns `[B][vocab]` logits.
    fn decode_batch(
        &self,
        tokens: &[u32],
        states: &mut [&mut Self::State],
    ) -> Result<Vec<Vec<f32>>>;

    /// [`PicBackend::decode_batch`] with the next token of each `Some` row of `draws`
    /// drawn by the backend (see [`crate::engine::Engine::decode_sample`]); the
    /// default returns logits for every row (the host path). `draws.len()` equals
    /// `tokens.len()` (checked by the caller).
    fn decode_sample(
        &self,
        tokens: &[u32],
        states: &mut [&mut Self::State],
        draws: &[Option<crate::sampling::DrawParams>],
    ) -> Result<Vec<crate::engine::Decoded>> {
        let _ = draws;
        Ok(self
            .decode_batch(tokens, states)?
            .into_iter()
            .map(crate::engine::Decoded::Logits)
            .collect())
    }

    /// Runs a pool lookup `f` (which may decode a spilled blob) with whatever the
    /// backend needs bound for decoding (the GPU binds its device).
    fn decoding<R>(&self, f: impl FnOnce() -> R) -> R {
        f()
    }

    /// A guard serialising the device work that arrives through the serving
    /// interface from several threads (`None`: no serialisation needed).
    fn exclusive(&self) -> Option<MutexGuard<'_, ()>> {
        None
    }
}
