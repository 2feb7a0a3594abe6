//! The CPU reference backend of the PIC engine ([`CpuBackend`], served as
//! [`super::PicEngine`]): host fp32 model, entries and states.
use std::any::Any;
use std::sync::Arc;

use super::backend::PicBackend;
use super::engine::{EntryLayer, Pic, SegmentEntry};
use crate::config::{MixerKind, ModelConfig};
use crate::engine::BackendInfo;
use crate::error::{Error, Result};
use crate::linear::transition::Pair;
use crate::mixers::lightning::rotate_state;
use crate::model::{Logits, Model};
use crate::state::{LayerState, ModelState};

/// The CPU model as a PIC backend.
pub struct CpuBackend {
    model: Arc<Model>,
}

impl Pic<CpuBackend> {
    /// Engine over `model` (identified by `model_id` in cache keys) with LRU pools of
    /// the given byte capacities.
    pub fn new(
        model: Arc<Model>,
        model_id: &str,
        public_bytes: usize,
        private_bytes: usize,
    ) -> Self {
        Pic::with_backend(CpuBackend { model }, model_id, public_bytes, private_bytes)
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.backend.model
    }
}

impl CpuBackend {
    /// Places a cached segment after the running `state` at position
    /// `b = state.next_position`: recomputes the seam window `tokens[..body_start]`
    /// through the whole stack, then composes the body into every layer
    /// ([`CpuBackend::compose_layer`]).
    fn compose(
        &self,
        tokens: &[u32],
        e: &SegmentEntry,
        state: &mut ModelState,
        naive: bool,
        rope_fix: bool,
    ) -> Result<()> {
        let b = state.next_position;
        if e.body_start > 0 {
            self.model
                .prefill(&tokens[..e.body_start], state, Logits::None)?;
        }
        for (i, (ls, el)) in state.layers.iter_mut().zip(&e.layers).enumerate() {
            self.compose_layer(i, ls, el, e, b, naive, rope_fix)?;
        }
        state.next_position = b + e.len as i64;
        Ok(())
    }

    /// Composes the body of `e` (a segment placed at position `b`, its body from
    /// `b + e.body_start`) into layer `i`'s state `ls`, whose seam window has run:
    /// a linear layer's state becomes `T_body S + S_body|0` (or `S + S_body|0` when
    /// `naive`; a Lightning body is first moved to `b` by `R(b)` on its key axis
    /// unless `rope_fix` is off) and takes the cached conv tail; an attention layer
    /// appends the body's K (re-rotated by `R(b)` for RoPE attention unless
    /// `rope_fix` is off) and V at positions `b + body_start ..`.
    ///
    /// Errors: [`Error::Input`] when the entry's layer does not match the layer's
    /// state or mixer (a pair of another transition kind is named).
    #[allow(clippy::too_many_arguments)]
    fn compose_layer(
        &self,
        i: usize,
        ls: &mut LayerState,
        el: &EntryLayer,
        e: &SegmentEntry,
        b: i64,
        naive: bool,
        rope_fix: bool,
    ) -> Result<()> {
        let model = &self.model;
        let c = &model.config;
        let (nkv, hd) = (c.num_kv_heads, c.head_dim);
        let body = e.len - e.body_start;
        match (ls, el, c.mixers[i]) {
            (LayerState::Linear(s), EntryLayer::Linear { pair, conv_tail }, m) if m.is_linear() => {
                // The pair must be of the form the layer's mixer builds.
                if m.transition_kind() != Some(pair.kind()) {
                    return Err(Error::Input(format!(
                        "layer {i}: cached {:?} transition, the {} mixer builds {:?}",
                        pair.kind(),
                        m.name(),
                        m.transition_kind()
                    )));
                }
                // Lightning keys carry RoPE: a body cached with its keys at
                // positions from 0 moves to `b` by R(b) on the state's key axis
                // (docs/pic-design.md, the state re-rotation).
                let rotated;
                let pair = if m == MixerKind::Lightning && rope_fix && b != 0 {
                    let (hv, dk, dv) = pair.dims();
                    let mut body = pair.b().to_vec();
                    rotate_state(model.rope(), &mut body, hv, dk, dv, b);
                    rotated = Pair::from_parts(pair.kind(), hv, dk, dv, pair.t().to_vec(), body)
                        .map_err(|e| Error::Input(format!("layer {i}: {e}")))?;
                    &rotated
                } else {
                    pair
                };
                let r = if naive {
                    pair.apply_naive(&mut s.recurrent)
                } else {
                    pair.apply(&mut s.recurrent)
                };
                r.map_err(|e| Error::Input(format!("layer {i}: {e}")))?;
                s.conv.clone_from(conv_tail);
            }
            (
                LayerState::Full(kv),
                EntryLayer::Full { k, v },
                m @ (MixerKind::Attention | MixerKind::Mla),
            ) => {
                let mut k = k.clone();
                // MLA (NoPE) rows carry no position: nothing to re-rotate.
                if rope_fix && b != 0 && m == MixerKind::Attention {
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
        Ok(())
    }

    /// Checks that each entry of `run` belongs to its tokens and to this model:
    /// `e.len == tokens.len()`, `e.body_start <= e.len`, one layer per model layer.
    /// Returns each segment's start position `b_k` and the position after the run.
    ///
    /// Errors: [`Error::Input`] naming the first segment that does not match.
    fn run_starts(
        &self,
        run: &[(&[u32], &SegmentEntry)],
        state: &ModelState,
    ) -> Result<(Vec<i64>, i64)> {
        let nl = self.model.config.num_layers;
        let mut starts = Vec::with_capacity(run.len());
        let mut b = state.next_position;
        for (k, &(tokens, e)) in run.iter().enumerate() {
            if e.len != tokens.len() || e.body_start > e.len || e.layers.len() != nl {
                return Err(Error::Input(format!(
                    "segment {k} of the run: cache entry ({} tokens, body from {}, {} \
                     layers) does not match the segment ({} tokens) or the model ({nl} \
                     layers)",
                    e.len,
                    e.body_start,
                    e.layers.len(),
                    tokens.len(),
                )));
            }
            starts.push(b);
            b += e.len as i64;
        }
        Ok((starts, b))
    }

    /// The reference composition of a run ([`PicBackend::compose_run`]): one segment
    /// after the other, each seam window through the whole model
    /// ([`Model::prefill`]), then its body composed into every layer. Snapshots are
    /// whole-state clones after segment `k` for the last `keep` segments.
    ///
    /// Errors: as [`PicBackend::compose_run`].
    fn compose_run_sequential(
        &self,
        run: &[(&[u32], &SegmentEntry)],
        state: &mut ModelState,
        naive: bool,
        rope_fix: bool,
        keep: usize,
    ) -> Result<Vec<(usize, ModelState)>> {
        self.run_starts(run, state)?;
        let first_kept = run.len() - keep.min(run.len());
        let mut snaps = Vec::with_capacity(run.len() - first_kept);
        for (k, (tokens, e)) in run.iter().enumerate() {
            self.compose(tokens, e, state, naive, rope_fix)?;
            if k >= first_kept {
                snaps.push((k, state.clone()));
            }
        }
        Ok(snaps)
    }

    /// Layer-major composition of a run ([`PicBackend::compose_run`]): the seam
    /// windows of all segments go through [`Model::forward_spans`] together, whose
    /// hook composes segment `k`'s body into layer `l` right after span `k`'s mixer
    /// ([`CpuBackend::compose_layer`]), so span `k + 1` sees it at that layer; norms,
    /// FFN / MoE and the mixers' projections run once over all seam rows. It
    /// handles every [`MixerKind`] the sequential path
    /// ([`CpuBackend::compose_run_sequential`]) handles, with the same math per row;
    /// only the batched matrix-product shapes differ, so the two agree to fp32
    /// rounding. Snapshots: per layer, a clone taken right after segment `k`'s body
    /// is composed there, for the last `keep` segments.
    ///
    /// Errors: as [`PicBackend::compose_run`].
    fn compose_run_layer_major(
        &self,
        run: &[(&[u32], &SegmentEntry)],
        state: &mut ModelState,
        naive: bool,
        rope_fix: bool,
        keep: usize,
    ) -> Result<Vec<(usize, ModelState)>> {
        let (starts, end) = self.run_starts(run, state)?;
        let nl = self.model.config.num_layers;
        let spans: Vec<(&[u32], i64)> = run
            .iter()
            .zip(&starts)
            .map(|(&(tokens, e), &b)| (&tokens[..e.body_start], b))
            .collect();
        let first_kept = run.len() - keep.min(run.len());
        let mut snap_layers: Vec<Vec<LayerState>> = (first_kept..run.len())
            .map(|_| Vec::with_capacity(nl))
            .collect();
        self.model.forward_spans(&spans, state, |l, k, ls| {
            let e = run[k].1;
            self.compose_layer(l, ls, &e.layers[l], e, starts[k], naive, rope_fix)?;
            if k >= first_kept {
                snap_layers[k - first_kept].push(ls.clone());
            }
            Ok(())
        })?;
        state.next_position = end;
        Ok(snap_layers
            .into_iter()
            .enumerate()
            .map(|(j, layers)| {
                let k = first_kept + j;
                let snap = ModelState {
                    layers,
                    next_position: starts[k] + run[k].1.len as i64,
                };
                (k, snap)
            })
            .collect())
    }
}

/// A CPU entry build in progress ([`PicBackend::build_entries_start`]): the segment's
/// running state from position 0, per layer and body start the pair of the body
/// tokens run so far, and per attention layer the KV so far.
struct CpuBuild {
    state: ModelState,
    /// Tokens run so far.
    done: usize,
    /// Body starts, clamped to the segment length.
    froms: Vec<usize>,
    /// `pairs[layer][j]`: pair of the tokens `froms[j]..done` (`None` until the
    /// body has begun).
    pairs: Vec<Vec<Option<Pair>>>,
    /// `kv[layer]`: `(K, V)` of tokens `0..done`, `[done, Hkv, hd]` each.
    kv: Vec<(Vec<f32>, Vec<f32>)>,
}

impl PicBackend for CpuBackend {
    type State = ModelState;
    type Entry = SegmentEntry;

    fn config(&self) -> &ModelConfig {
        &self.model.config
    }
    fn info(&self) -> BackendInfo {
        BackendInfo::cpu()
    }
    fn new_state(&self) -> Result<ModelState> {
        Ok(self.model.new_state())
    }
    fn clone_state(&self, state: &ModelState) -> Result<ModelState> {
        Ok(state.clone())
    }
    fn state_bytes(state: &ModelState) -> usize {
        state.bytes()
    }
    fn recurrent_bytes(state: &ModelState) -> usize {
        state
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Linear(s) => 4 * (s.conv.len() + s.recurrent.len()),
                LayerState::Full(_) => 0,
            })
            .sum()
    }

    fn prefill(&self, tokens: &[u32], state: &mut ModelState, last: bool) -> Result<Vec<f32>> {
        let logits = if last { Logits::Last } else { Logits::None };
        Ok(self.model.prefill(tokens, state, logits)?.logits)
    }

    fn batches_prefills(&self) -> bool {
        true
    }

    /// One batched forward ([`Model::prefill_many`]).
    fn prefill_many(&self, items: &mut [(&[u32], &mut ModelState, bool)]) -> Result<Vec<Vec<f32>>> {
        self.model.prefill_many(items)
    }

    /// One prefill for every body start (the projections, MLPs and attention run
    /// once; each extra body start adds one gated-delta-rule pass per linear layer).
    /// The first body start's pass drives the residual stream, so every entry is
    /// built (whatever `wanted` says) and callers pass the body starts in a fixed
    /// order.
    fn build_entries(
        &self,
        tokens: &[u32],
        body_starts: &[usize],
        _wanted: &[bool],
    ) -> Result<Vec<Option<SegmentEntry>>> {
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
            .map(|(from, layers)| {
                Some(SegmentEntry {
                    body_start: from,
                    len: tokens.len(),
                    layers,
                })
            })
            .collect())
    }

    /// Runs the pieces through the same layer-by-layer capture as the one-shot
    /// build (from the state the earlier pieces left), composing each linear layer's
    /// pairs across pieces and concatenating the attention layers' KV.
    fn build_entries_start(
        &self,
        tokens: &[u32],
        body_starts: &[usize],
    ) -> Result<Option<Box<dyn Any + Send>>> {
        let n = self.model.config.num_layers;
        let froms: Vec<usize> = body_starts.iter().map(|&b| b.min(tokens.len())).collect();
        Ok(Some(Box::new(CpuBuild {
            state: self.model.new_state(),
            done: 0,
            pairs: vec![vec![None; froms.len()]; n],
            froms,
            kv: vec![(vec![], vec![]); n],
        })))
    }

    fn build_entries_continue(
        &self,
        build: &mut (dyn Any + Send),
        tokens: &[u32],
        from: usize,
        to: usize,
    ) -> Result<()> {
        let b = build
            .downcast_mut::<CpuBuild>()
            .ok_or_else(|| Error::Input("not a CPU entry build".into()))?;
        if from != b.done || to <= from || to > tokens.len() {
            return Err(Error::Input(format!(
                "entry build: range {from}..{to} after {} of {} tokens",
                b.done,
                tokens.len()
            )));
        }
        let model = &self.model;
        let positions: Vec<i64> = (from as i64..to as i64).collect();
        let mut x = model.embed(&tokens[from..to]);
        // Body starts whose body has begun by the end of this piece, and where
        // inside the piece it begins.
        let active: Vec<(usize, usize)> = b
            .froms
            .iter()
            .enumerate()
            .filter(|(_, &f)| f < to)
            .map(|(j, &f)| (j, f.saturating_sub(from)))
            .collect();
        let local: Vec<usize> = active.iter().map(|&(_, f)| f).collect();
        for (i, ls) in b.state.layers.iter_mut().enumerate() {
            let out = model.layer_forward_capture_many(i, &mut x, &positions, ls, &local)?;
            match ls {
                LayerState::Linear(_) => {
                    if out.pairs.len() != active.len() {
                        return Err(Error::Input(format!(
                            "layer {i}: capture returned no cache data"
                        )));
                    }
                    for (&(j, _), p) in active.iter().zip(out.pairs) {
                        let slot = &mut b.pairs[i][j];
                        *slot = Some(match slot.take() {
                            None => p,
                            Some(earlier) => p
                                .compose(&earlier)
                                .map_err(|e| Error::Input(format!("layer {i}: {e}")))?,
                        });
                    }
                }
                LayerState::Full(_) => {
                    let (k, v) = out.kv.ok_or_else(|| {
                        Error::Input(format!("layer {i}: capture returned no cache data"))
                    })?;
                    b.kv[i].0.extend_from_slice(&k);
                    b.kv[i].1.extend_from_slice(&v);
                }
            }
        }
        b.done = to;
        Ok(())
    }

    fn build_entries_finish(
        &self,
        build: Box<dyn Any + Send>,
        tokens: &[u32],
    ) -> Result<Vec<Option<SegmentEntry>>> {
        let b = build
            .downcast::<CpuBuild>()
            .map_err(|_| Error::Input("not a CPU entry build".into()))?;
        if b.done != tokens.len() {
            return Err(Error::Input(format!(
                "entry build finished after {} of {} tokens",
                b.done,
                tokens.len()
            )));
        }
        let c = &self.model.config;
        let row = c.num_kv_heads * c.head_dim;
        let CpuBuild {
            state,
            froms,
            mut pairs,
            kv,
            ..
        } = *b;
        let mut out = Vec::with_capacity(froms.len());
        for (j, &from) in froms.iter().enumerate() {
            let mut layers = Vec::with_capacity(c.num_layers);
            for (i, ls) in state.layers.iter().enumerate() {
                layers.push(match ls {
                    LayerState::Linear(s) => {
                        // A body start at the segment's end has an empty body: the
                        // engine never asks for one in pieces.
                        let pair = pairs[i][j].take().ok_or_else(|| {
                            Error::Input(format!(
                                "entry build: empty body from {from} of {} tokens",
                                tokens.len()
                            ))
                        })?;
                        EntryLayer::Linear {
                            pair,
                            conv_tail: s.conv.clone(),
                        }
                    }
                    LayerState::Full(_) => EntryLayer::Full {
                        k: kv[i].0[from * row..].to_vec(),
                        v: kv[i].1[from * row..].to_vec(),
                    },
                });
            }
            out.push(Some(SegmentEntry {
                body_start: from,
                len: tokens.len(),
                layers,
            }));
        }
        Ok(out)
    }

    /// Layer-major when at least two segments of the run have a seam window
    /// (`CpuBackend::compose_run_layer_major`: their rows share the projections
    /// and the FFN); otherwise there is nothing to batch and the run goes one
    /// segment after the other (`CpuBackend::compose_run_sequential`, the
    /// reference).
    fn compose_run(
        &self,
        run: &[(&[u32], &SegmentEntry)],
        state: &mut ModelState,
        naive: bool,
        rope_fix: bool,
        keep: usize,
    ) -> Result<Vec<(usize, ModelState)>> {
        let seams = run.iter().filter(|(_, e)| e.body_start > 0).count();
        if seams >= 2 {
            self.compose_run_layer_major(run, state, naive, rope_fix, keep)
        } else {
            self.compose_run_sequential(run, state, naive, rope_fix, keep)
        }
    }

    /// XXH3-128 of the first 64 Ki values of the embedding and of the final norm
    /// (cheap at start-up for any model size, and different for two checkpoints of
    /// one shape).
    fn weights_digest(&self) -> u128 {
        let m = &self.model;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let n = m.embed.len().min(1 << 16);
        for x in m.embed[..n].iter().chain(&m.final_norm) {
            h.update(&x.to_le_bytes());
        }
        h.digest128()
    }

    fn decode_batch(
        &self,
        tokens: &[u32],
        states: &mut [&mut ModelState],
    ) -> Result<Vec<Vec<f32>>> {
        self.model.decode_batch(tokens, states)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::transition::TransitionKind;

    fn backend() -> CpuBackend {
        backend_of("qwen3_5")
    }

    fn backend_of(name: &str) -> CpuBackend {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden")
            .join(name);
        CpuBackend {
            model: Arc::new(Model::load(&dir, &mut |_, _| {}).unwrap()),
        }
    }

    /// Largest `|a − b|` over two equally long slices, relative to
    /// `max(1, max |b|)`.
    fn rel_max(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        d / scale
    }

    /// Largest [`rel_max`] over the layers of two states (recurrent state and conv
    /// tail, or K and V); positions, lengths and kinds must be equal.
    fn state_diff(a: &ModelState, b: &ModelState) -> f32 {
        assert_eq!(a.next_position, b.next_position);
        assert_eq!(a.layers.len(), b.layers.len());
        let mut d = 0f32;
        for (x, y) in a.layers.iter().zip(&b.layers) {
            match (x, y) {
                (LayerState::Linear(x), LayerState::Linear(y)) => {
                    d = d.max(rel_max(&x.recurrent, &y.recurrent));
                    d = d.max(rel_max(&x.conv, &y.conv));
                }
                (LayerState::Full(x), LayerState::Full(y)) => {
                    assert_eq!(x.positions, y.positions);
                    d = d.max(rel_max(&x.k, &y.k));
                    d = d.max(rel_max(&x.v, &y.v));
                }
                _ => panic!("layer kinds differ"),
            }
        }
        d
    }

    /// Layer-major composition of a run equals the one-segment-after-the-other
    /// reference to fp32 rounding: the state after the run, the snapshots of the
    /// last segments and the logits of a query after it, for every golden model
    /// (dense and MoE; Gated DeltaNet, gated attention, Lightning, KDA and MLA
    /// mixers), naive addition on and off, RoPE re-rotation on and off, runs with
    /// and without seam windows (1, 8 and 20 seam tokens, none), from an empty state
    /// and after a prefix.
    #[test]
    fn layer_major_compose_equals_the_sequential_reference() {
        const TOL: f32 = 1e-5;
        let models = [
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_moe",
            "bailing_moe_linear",
            "kimi_linear",
        ];
        // Runs as (segment length, body start).
        let runs: [&[(usize, usize)]; 4] = [
            &[(30, 8), (25, 0), (40, 1), (70, 20)],
            &[(30, 0), (25, 0)],
            &[(25, 0), (40, 8)],
            &[(18, 3), (33, 8), (9, 2)],
        ];
        for name in models {
            let mut worst = (0f32, 0f32);
            let b = backend_of(name);
            let m = &b.model;
            let vocab = m.config.vocab_size.min(300) as u32;
            let mut seed = 7u32;
            let mut tokens = |n: usize| -> Vec<u32> {
                (0..n)
                    .map(|_| {
                        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                        (seed >> 8) % vocab
                    })
                    .collect()
            };
            let prefix = tokens(12);
            let query = tokens(6);
            for (ri, run) in runs.iter().enumerate() {
                let segs: Vec<(Vec<u32>, SegmentEntry)> = run
                    .iter()
                    .map(|&(len, from)| {
                        let t = tokens(len);
                        let e = b.build_entries(&t, &[from], &[true]).unwrap()[0]
                            .clone()
                            .unwrap();
                        (t, e)
                    })
                    .collect();
                let refs: Vec<(&[u32], &SegmentEntry)> =
                    segs.iter().map(|(t, e)| (&t[..], e)).collect();
                for (start, naive, rope_fix) in [
                    (false, false, true),
                    (true, false, true),
                    (true, false, false),
                    (true, true, true),
                    (true, true, false),
                ] {
                    let mut s0 = m.new_state();
                    if start {
                        m.prefill(&prefix, &mut s0, Logits::None).unwrap();
                    }
                    let (mut seq, mut lm) = (s0.clone(), s0);
                    let keep = 2;
                    let snaps_seq = b
                        .compose_run_sequential(&refs, &mut seq, naive, rope_fix, keep)
                        .unwrap();
                    let snaps_lm = b
                        .compose_run_layer_major(&refs, &mut lm, naive, rope_fix, keep)
                        .unwrap();
                    let at = format!(
                        "{name}, run {ri}, prefix {start}, naive {naive}, rope_fix {rope_fix}"
                    );
                    let mut ds = state_diff(&lm, &seq);
                    assert_eq!(snaps_lm.len(), snaps_seq.len(), "{at}");
                    for ((kl, sl), (ks, ss)) in snaps_lm.iter().zip(&snaps_seq) {
                        assert_eq!(kl, ks, "{at}");
                        ds = ds.max(state_diff(sl, ss));
                    }
                    let ll = m.prefill(&query, &mut lm, Logits::All).unwrap().logits;
                    let ls = m.prefill(&query, &mut seq, Logits::All).unwrap().logits;
                    let dl = rel_max(&ll, &ls);
                    assert!(ds <= TOL && dl <= TOL, "{at}: state {ds:e}, logits {dl:e}");
                    worst = (worst.0.max(ds), worst.1.max(dl));
                }
            }
            eprintln!(
                "{name}: layer-major vs sequential, largest difference relative to \
                 max(1, max |x|): state {:e}, logits {:e}",
                worst.0, worst.1
            );
        }
    }

    /// A cached pair whose storage form is not the one the layer's mixer builds is
    /// refused by name; the entry as built composes.
    #[test]
    fn compose_checks_the_pair_kind_against_the_mixer() {
        let b = backend();
        let tokens: Vec<u32> = (0..12u32).map(|i| (i * 7 + 3) % 300).collect();
        let entry = b.build_entries(&tokens, &[2], &[true]).unwrap()[0]
            .clone()
            .unwrap();
        let mut state = b.new_state().unwrap();
        b.compose(&tokens, &entry, &mut state, false, true).unwrap();
        assert_eq!(state.next_position, tokens.len() as i64);
        let c = &b.model.config;
        let (i, m) = c
            .mixers
            .iter()
            .enumerate()
            .find(|(_, m)| m.is_linear())
            .unwrap();
        assert_eq!(m.transition_kind(), Some(TransitionKind::Dense));
        let mut bad = entry.clone();
        bad.layers[i] = EntryLayer::Linear {
            pair: Pair::identity(
                TransitionKind::Scalar,
                c.linear_v_heads,
                c.linear_k_dim,
                c.linear_v_dim,
            ),
            conv_tail: match &entry.layers[i] {
                EntryLayer::Linear { conv_tail, .. } => conv_tail.clone(),
                EntryLayer::Full { .. } => unreachable!("a linear layer"),
            },
        };
        let mut state = b.new_state().unwrap();
        let e = b
            .compose(&tokens, &bad, &mut state, false, true)
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("layer {i}")) && msg.contains("Scalar"),
            "{msg}"
        );
        assert!(msg.contains("gated_deltanet"), "{msg}");
    }
}
