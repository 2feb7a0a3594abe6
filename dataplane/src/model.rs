//! The hybrid decoder on the CPU reference backend, with the span-level state API
//! used by decoding and position-independent caching.
//!
//! The model family ([`crate::models`]) fixes the shape, the per-layer token mixer
//! ([`MixerKind`]) and the tensor names; each layer dispatches on its mixer
//! (Gated DeltaNet in [`crate::mixers::gated_deltanet`], gated attention in
//! [`crate::mixers::attention`], Lightning in [`crate::mixers::lightning`], Kimi Delta
//! Attention in [`crate::mixers::kda`], latent attention in [`crate::mixers::mla`]),
//! followed by a dense SwiGLU MLP or a MoE block. Math follows HF transformers
//! `modeling_qwen3_next.py` / `modeling_qwen3_5*.py` (docs/pic-design.md §8,
//! Qwen3-Next and Qwen3.5). Activations are fp32 `[T, hidden]` row-major.
use crate::config::{MixerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::linear::transition::Pair;
use crate::mixers::attention as attn;
pub use crate::mixers::attention::attention;
pub(crate) use crate::mixers::attention::AttnWeights;
pub(crate) use crate::mixers::gated_deltanet::layer::GdnWeights;
pub use crate::mixers::gated_deltanet::layer::GDR_CHUNK;
use crate::mixers::gated_deltanet::layer::{self as gdn};
pub(crate) use crate::mixers::kda::layer::KdaWeights;
use crate::mixers::kda::layer::{self as kda};
pub(crate) use crate::mixers::lightning::layer::LightningWeights;
use crate::mixers::lightning::layer::{self as lt};
use crate::mixers::mla;
pub(crate) use crate::mixers::mla::MlaWeights;
use crate::ops::{self, linear, Rope};
use crate::state::{KvCache, LayerState, LinearState, ModelState};
use crate::weights::{Checkpoint, F32Buf};
use rayon::prelude::*;
use std::path::Path;

/// SwiGLU MLP: `down(silu(gate(x)) · up(x))`.
pub(crate) struct Mlp {
    /// `[2I, hidden]`, gate rows then up rows.
    pub(crate) gate_up: F32Buf,
    /// `[hidden, I]`.
    pub(crate) down: F32Buf,
    pub(crate) inter: usize,
}

pub(crate) struct Moe {
    /// Router `[E, hidden]`.
    pub(crate) router: F32Buf,
    /// Selection bias `[E]` of a biased router (`RouterConfig::selection_bias`).
    pub(crate) bias: Option<Vec<f32>>,
    pub(crate) experts: Vec<Mlp>,
    /// Shared expert and its scalar gate `[1, hidden]`.
    pub(crate) shared: Option<(Mlp, F32Buf)>,
    /// Shared expert added without a gate (`TensorNames::shared_expert_gate` = `None`).
    pub(crate) shared_plain: Option<Mlp>,
}

/// The weights of one layer's token mixer (one variant per [`MixerKind`]).
pub(crate) enum Mixer {
    GatedDeltaNet(GdnWeights),
    Attention(AttnWeights),
    Lightning(LightningWeights),
    Kda(KdaWeights),
    Mla(MlaWeights),
}

pub(crate) enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

pub(crate) struct Layer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    pub(crate) mixer: Mixer,
    pub(crate) ffn: Ffn,
}

/// Which logits a prefill returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (e.g. a cache-building prefill).
    None,
    /// Only the last token's: `[1, vocab]`.
    Last,
    /// Every token's: `[T, vocab]`.
    All,
}

/// What [`Model::prefill`] returns beside the updated state.
#[derive(Clone, Debug, Default)]
pub struct PrefillOutput {
    /// Logits, `[rows, vocab]` where rows is 0, 1 or T per [`Logits`].
    pub logits: Vec<f32>,
    /// Per layer: for full-attention layers the span's `(K, V)` (`[T, Hkv, hd]`
    /// each, K rotated to the span's positions); `None` for linear layers.
    pub span_kv: Vec<Option<(Vec<f32>, Vec<f32>)>>,
}

/// A loaded hybrid model on the CPU backend.
pub struct Model {
    /// Configuration.
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    pub(crate) embed: F32Buf,
    pub(crate) final_norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to the embedding.
    pub(crate) lm_head: Option<F32Buf>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) rope: Rope,
}

impl Model {
    /// Loads `dir` (config.json + safetensors), reporting progress per layer through
    /// `progress(done, total)`.
    ///
    /// Errors: as [`ModelConfig::from_dir`] and [`Checkpoint`]; every weight is
    /// shape-checked against the config.
    pub fn load(dir: &Path, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &ckpt, progress)
    }

    /// Builds the model from an opened checkpoint.
    pub fn from_checkpoint(
        config: ModelConfig,
        ckpt: &Checkpoint,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let c = &config;
        let n = &c.names;
        let h = c.hidden_size;
        let total = c.num_layers + 2;
        progress(0, total);
        let embed = ckpt.get_buf(&n.embed_tokens(), &[c.vocab_size, h])?;
        let final_norm = c.norm_weight(ckpt.get(&n.norm(), &[h])?);
        let lm_head = if c.tie_word_embeddings && !ckpt.contains(n.lm_head) {
            None
        } else {
            Some(ckpt.get_buf(n.lm_head, &[c.vocab_size, h])?)
        };
        progress(1, total);
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let kind = c.mixers[i];
            let mp = n.mixer(i, kind);
            let mixer = match kind {
                MixerKind::GatedDeltaNet => Mixer::GatedDeltaNet(gdn::load(c, ckpt, &mp)?),
                MixerKind::Attention => Mixer::Attention(attn::load(c, ckpt, &mp)?),
                MixerKind::Lightning => Mixer::Lightning(lt::load(c, ckpt, &mp, i)?),
                MixerKind::Kda => Mixer::Kda(kda::load(c, ckpt, &mp)?),
                MixerKind::Mla => Mixer::Mla(mla::load(c, ckpt, &mp)?),
            };
            let ffn = if c.layer_is_moe[i] {
                Ffn::Moe(load_moe(c, ckpt, &n.mlp(i))?)
            } else {
                let mut p = n.mlp(i);
                if let Some(alt) = n.dense_ffn_alt {
                    if !ckpt.contains(&format!("{p}gate_proj.weight")) {
                        p = format!("{}{alt}", n.layer(i));
                    }
                }
                Ffn::Dense(load_mlp(ckpt, &p, h, c.intermediate_size, DENSE_PROJ)?)
            };
            layers.push(Layer {
                input_norm: c.norm_weight(ckpt.get(&n.input_layernorm(i), &[h])?),
                post_norm: c.norm_weight(ckpt.get(&n.post_layernorm(i), &[h])?),
                mixer,
                ffn,
            });
            progress(i + 2, total);
        }
        progress(total, total);
        let rope = Rope::new(c.rotary_dim, c.rope_theta);
        Ok(Model {
            config,
            embed,
            final_norm,
            lm_head,
            layers,
            rope,
        })
    }

    /// Fresh state for a new sequence: zero conv tails and recurrent states, empty KV,
    /// next position 0.
    pub fn new_state(&self) -> ModelState {
        let c = &self.config;
        let layers = c
            .mixers
            .iter()
            .map(|k| match k {
                MixerKind::GatedDeltaNet | MixerKind::Kda => LayerState::Linear(LinearState {
                    conv: vec![0.0; c.conv_dim() * (c.conv_kernel - 1)],
                    recurrent: vec![0.0; c.linear_v_heads * c.linear_k_dim * c.linear_v_dim],
                }),
                MixerKind::Attention | MixerKind::Mla => LayerState::Full(KvCache::default()),
                MixerKind::Lightning => LayerState::Linear(LinearState {
                    conv: vec![],
                    recurrent: vec![0.0; c.linear_v_heads * c.linear_k_dim * c.linear_v_dim],
                }),
            })
            .collect();
        ModelState {
            layers,
            next_position: 0,
        }
    }

    /// Checks that `state` has the shapes this model needs.
    pub fn check_state(&self, state: &ModelState) -> Result<()> {
        let c = &self.config;
        if state.layers.len() != c.num_layers {
            return Err(Error::Input(format!(
                "state has {} layers, model has {}",
                state.layers.len(),
                c.num_layers
            )));
        }
        for (i, (l, k)) in state.layers.iter().zip(&c.mixers).enumerate() {
            let ok = match (l, k) {
                (LayerState::Linear(s), MixerKind::GatedDeltaNet | MixerKind::Kda) => {
                    s.conv.len() == c.conv_dim() * (c.conv_kernel - 1)
                        && s.recurrent.len() == c.linear_v_heads * c.linear_k_dim * c.linear_v_dim
                }
                (LayerState::Linear(s), MixerKind::Lightning) => {
                    s.conv.is_empty()
                        && s.recurrent.len() == c.linear_v_heads * c.linear_k_dim * c.linear_v_dim
                }
                (LayerState::Full(kv), MixerKind::Attention | MixerKind::Mla) => {
                    let w = kv.positions.len() * c.num_kv_heads * c.head_dim;
                    kv.k.len() == w && kv.v.len() == w
                }
                _ => false,
            };
            if !ok {
                return Err(Error::Input(format!(
                    "state of layer {i} does not match the model's shapes"
                )));
            }
        }
        Ok(())
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::Input(
                "empty prompt: at least one token is needed".into(),
            ));
        }
        if let Some(t) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(Error::Input(format!(
                "token id {t} is outside the vocabulary ({})",
                self.config.vocab_size
            )));
        }
        Ok(())
    }

    /// The model's rotary tables (for re-rotating cached keys).
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Embeds tokens: `[T, hidden]`.
    pub fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.config.hidden_size;
        let mut x = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            x.extend_from_slice(&self.embed[t as usize * h..(t as usize + 1) * h]);
        }
        x
    }

    /// Prefills `tokens` from `state` (which it advances in place) at positions
    /// `state.next_position ..`. Returns the requested logits and the span's KV.
    ///
    /// Errors: empty span, token outside the vocabulary, state shapes not matching.
    pub fn prefill(
        &self,
        tokens: &[u32],
        state: &mut ModelState,
        logits: Logits,
    ) -> Result<PrefillOutput> {
        self.check_tokens(tokens)?;
        self.check_state(state)?;
        let t = tokens.len();
        let positions: Vec<i64> = (0..t as i64).map(|i| state.next_position + i).collect();
        let mut x = self.embed(tokens);
        let mut span_kv = Vec::with_capacity(self.layers.len());
        for (i, layer_state) in state.layers.iter_mut().enumerate() {
            span_kv.push(self.layer_forward(i, &mut x, &positions, layer_state)?);
        }
        state.next_position += t as i64;
        let logits = match logits {
            Logits::None => vec![],
            Logits::Last => self.logits(&x[(t - 1) * self.config.hidden_size..]),
            Logits::All => self.logits(&x),
        };
        Ok(PrefillOutput { logits, span_kv })
    }

    /// One-token decode from `state`: returns the next-token logits `[vocab]`.
    pub fn decode(&self, token: u32, state: &mut ModelState) -> Result<Vec<f32>> {
        Ok(self.prefill(&[token], state, Logits::Last)?.logits)
    }

    /// One decode step for a batch of sequences: `tokens[b]` is appended to
    /// `states[b]`. Projections, MLPs and the LM head run as one `[B, ·]` matrix
    /// product; conv, recurrence and attention run per sequence on its own state.
    /// Returns `[B][vocab]` logits. Same math as [`Model::decode`] per sequence.
    ///
    /// Errors: as [`Model::prefill`] for any sequence (no state is changed then).
    pub fn decode_batch(
        &self,
        tokens: &[u32],
        states: &mut [&mut ModelState],
    ) -> Result<Vec<Vec<f32>>> {
        if tokens.len() != states.len() {
            return Err(Error::Input(format!(
                "{} tokens for {} states",
                tokens.len(),
                states.len()
            )));
        }
        if tokens.is_empty() {
            return Ok(vec![]);
        }
        self.check_tokens(tokens)?;
        for s in states.iter() {
            self.check_state(s)?;
        }
        let c = &self.config;
        let (b, h) = (tokens.len(), c.hidden_size);
        let mut x = self.embed(tokens);
        for (i, layer) in self.layers.iter().enumerate() {
            let mut r = x.clone();
            ops::rms_norm_zero_centred(&mut r, &layer.input_norm, c.rms_norm_eps);
            let mixed = match &layer.mixer {
                Mixer::GatedDeltaNet(w) => {
                    let n_in = gdn::in_width(c);
                    let proj = linear(&r, b, h, &w.w_in, n_in);
                    let vd = c.value_dim();
                    let mut pre = vec![0f32; b * vd];
                    pre.par_chunks_mut(vd)
                        .zip(states.par_iter_mut())
                        .enumerate()
                        .for_each(|(j, (row, st))| {
                            let LayerState::Linear(s) = &mut st.layers[i] else {
                                unreachable!("checked")
                            };
                            let p = &proj[j * n_in..(j + 1) * n_in];
                            row.copy_from_slice(&gdn::decode_token(c, w, p, s));
                        });
                    linear(&pre, b, vd, &w.out, h)
                }
                Mixer::Attention(w) => {
                    let (qg, k, v) = attn::project(c, w, &r, b);
                    let (qw, kw) = (qg.len() / b, k.len() / b);
                    let ow = c.num_heads * c.head_dim;
                    let mut pre = vec![0f32; b * ow];
                    pre.par_chunks_mut(ow)
                        .zip(states.par_iter_mut())
                        .enumerate()
                        .for_each(|(j, (row, st))| {
                            let pos = [st.next_position];
                            let LayerState::Full(kv) = &mut st.layers[i] else {
                                unreachable!("checked")
                            };
                            let (o, _, _) = attn::mix(
                                c,
                                &self.rope,
                                w,
                                (
                                    qg[j * qw..(j + 1) * qw].to_vec(),
                                    k[j * kw..(j + 1) * kw].to_vec(),
                                    v[j * kw..(j + 1) * kw].to_vec(),
                                ),
                                &pos,
                                kv,
                            );
                            row.copy_from_slice(&o);
                        });
                    linear(&pre, b, ow, &w.o, h)
                }
                Mixer::Lightning(w) => {
                    let (qkv, gate) = lt::project(c, w, &r, b);
                    let wd = lt::width(c);
                    let mut pre = vec![0f32; b * wd];
                    pre.par_chunks_mut(wd)
                        .zip(states.par_iter_mut())
                        .enumerate()
                        .for_each(|(j, (row, st))| {
                            let pos = [st.next_position];
                            let LayerState::Linear(s) = &mut st.layers[i] else {
                                unreachable!("checked")
                            };
                            let (o, _) = lt::mix(
                                c,
                                &self.rope,
                                w,
                                (
                                    qkv[j * 3 * wd..(j + 1) * 3 * wd].to_vec(),
                                    gate[j * wd..(j + 1) * wd].to_vec(),
                                ),
                                &pos,
                                s,
                                &[],
                            );
                            row.copy_from_slice(&o);
                        });
                    linear(&pre, b, wd, &w.dense, h)
                }
                Mixer::Kda(w) => {
                    let n_in = kda::in_width(c);
                    let proj = kda::project(c, w, &r, b);
                    let wd = kda::width(c);
                    let mut pre = vec![0f32; b * wd];
                    pre.par_chunks_mut(wd)
                        .zip(states.par_iter_mut())
                        .enumerate()
                        .for_each(|(j, (row, st))| {
                            let LayerState::Linear(s) = &mut st.layers[i] else {
                                unreachable!("checked")
                            };
                            let p = &proj[j * n_in..(j + 1) * n_in];
                            row.copy_from_slice(&kda::mix(c, w, p, 1, s, &[]).0);
                        });
                    linear(&pre, b, wd, &w.o_proj, h)
                }
                Mixer::Mla(w) => {
                    let (q, kva) = mla::project(c, w, &r, b);
                    let (qw, kw) = (q.len() / b, kva.len() / b);
                    let ow = c.num_heads * c.mla.v_head_dim;
                    let mut pre = vec![0f32; b * ow];
                    pre.par_chunks_mut(ow)
                        .zip(states.par_iter_mut())
                        .enumerate()
                        .for_each(|(j, (row, st))| {
                            let pos = [st.next_position];
                            let LayerState::Full(kv) = &mut st.layers[i] else {
                                unreachable!("checked")
                            };
                            let (o, _, _) = mla::mix(
                                c,
                                w,
                                (
                                    q[j * qw..(j + 1) * qw].to_vec(),
                                    kva[j * kw..(j + 1) * kw].to_vec(),
                                ),
                                &pos,
                                kv,
                            );
                            row.copy_from_slice(&o);
                        });
                    linear(&pre, b, ow, &w.o, h)
                }
            };
            x.iter_mut().zip(&mixed).for_each(|(a, m)| *a += m);
            let mut r = x.clone();
            ops::rms_norm_zero_centred(&mut r, &layer.post_norm, c.rms_norm_eps);
            let f = match &layer.ffn {
                Ffn::Dense(m) => mlp_forward(m, &r, b, h),
                Ffn::Moe(m) => self.moe_forward(m, &r, b),
            };
            x.iter_mut().zip(&f).for_each(|(a, m)| *a += m);
        }
        for s in states.iter_mut() {
            s.next_position += 1;
        }
        let logits = self.logits(&x);
        Ok(logits
            .chunks_exact(c.vocab_size)
            .map(|l| l.to_vec())
            .collect())
    }

    /// Applies `round` in place to every weight matrix: the embedding, the LM head, the
    /// mixers' projections (GDN `in_proj` / `out_proj`, attention `q/k/v/o`, Lightning
    /// `query_key_value` / `g_proj` / `dense`, KDA `in_proj` / `f_b` / `g_b` / `o_proj`,
    /// MLA `q_proj` / `kv_a` / `kv_b` / `o_proj`), dense MLPs, MoE routers, experts,
    /// shared experts and shared-expert gates. Norm weights, conv weights, `A_log`,
    /// `dt_bias`, Lightning log decays and router selection biases are left as they
    /// are.
    ///
    /// These are exactly the tensors the CUDA model stores in its element type (the
    /// rest stay fp32 there), so with `round` = rounding to bf16 this model has the
    /// weights a bf16 `GpuModel` computes with: comparing the two leaves only the
    /// rounding of activations and intermediates.
    pub fn round_projections(&mut self, round: impl Fn(f32) -> f32) {
        let r = |w: &mut [f32]| w.iter_mut().for_each(|x| *x = round(*x));
        r(&mut self.embed);
        if let Some(w) = self.lm_head.as_mut() {
            r(w);
        }
        let mlp = |m: &mut Mlp| {
            r(&mut m.gate_up);
            r(&mut m.down);
        };
        for l in &mut self.layers {
            match &mut l.mixer {
                Mixer::GatedDeltaNet(w) => {
                    r(&mut w.w_in);
                    r(&mut w.out);
                }
                Mixer::Attention(w) => {
                    for m in [&mut w.q, &mut w.k, &mut w.v, &mut w.o] {
                        r(m);
                    }
                }
                Mixer::Lightning(w) => {
                    for m in [&mut w.qkv, &mut w.g_proj, &mut w.dense] {
                        r(m);
                    }
                }
                Mixer::Kda(w) => {
                    for m in [&mut w.w_in, &mut w.f_b, &mut w.g_b, &mut w.o_proj] {
                        r(m);
                    }
                }
                Mixer::Mla(w) => {
                    for m in [&mut w.q, &mut w.kv_a, &mut w.o] {
                        r(m);
                    }
                    r(&mut w.w_uk);
                    r(&mut w.w_uv);
                }
            }
            match &mut l.ffn {
                Ffn::Dense(m) => mlp(m),
                Ffn::Moe(m) => {
                    r(&mut m.router);
                    m.experts.iter_mut().for_each(mlp);
                    if let Some((s, gate)) = m.shared.as_mut() {
                        mlp(s);
                        r(gate);
                    }
                    if let Some(s) = m.shared_plain.as_mut() {
                        mlp(s);
                    }
                }
            }
        }
    }

    /// Final norm and LM head over rows of `x` (`[rows, hidden]`) → `[rows, vocab]`.
    pub fn logits(&self, x: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let rows = x.len() / c.hidden_size;
        let mut hn = x.to_vec();
        ops::rms_norm_zero_centred(&mut hn, &self.final_norm, c.rms_norm_eps);
        let w = self.lm_head.as_ref().unwrap_or(&self.embed);
        linear(&hn, rows, c.hidden_size, w, c.vocab_size)
    }

    /// Runs decoder layer `i` on the residual stream `x` (`[T, hidden]`, updated in
    /// place) for tokens at `positions`, advancing `state` (this layer's state).
    /// Returns the span's `(K, V)` for a full-attention layer.
    pub fn layer_forward(
        &self,
        i: usize,
        x: &mut [f32],
        positions: &[i64],
        state: &mut LayerState,
    ) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        Ok(self.layer_forward_capture(i, x, positions, state, None)?.kv)
    }

    /// [`Model::layer_forward`] that, for a linear layer and `capture_from = Some(w)`,
    /// also returns the cached-transition pair `(T_body, S_body|0)` of the span's
    /// tokens `w..T` (docs/pic-design.md §2.4, §3): `T_body` from the chunked kernel in
    /// the same pass, `S_body|0 = S_T − T_body · S_w`.
    pub fn layer_forward_capture(
        &self,
        i: usize,
        x: &mut [f32],
        positions: &[i64],
        state: &mut LayerState,
        capture_from: Option<usize>,
    ) -> Result<LayerOutput> {
        let froms: Vec<usize> = capture_from.into_iter().collect();
        let mut out = self.layer_forward_capture_many(i, x, positions, state, &froms)?;
        Ok(LayerOutput {
            kv: out.kv.take(),
            pair: out.pairs.pop(),
        })
    }

    /// [`Model::layer_forward_capture`] for several body starts at once: one pass
    /// through the layer's projections and MLP and, for a linear layer, one
    /// cached-transition pair per entry of `froms` (same order), each for the body
    /// `froms[j]..T`. The state advances exactly as with a single capture. Each extra
    /// pair costs one more gated-delta-rule pass (no GEMMs), so the entries of several
    /// seam widths cost little more than one.
    pub fn layer_forward_capture_many(
        &self,
        i: usize,
        x: &mut [f32],
        positions: &[i64],
        state: &mut LayerState,
        froms: &[usize],
    ) -> Result<LayerOutputs> {
        let c = &self.config;
        let layer = &self.layers[i];
        let t = positions.len();
        if x.len() != t * c.hidden_size {
            return Err(Error::Input(format!(
                "layer {i}: activations do not match {t} positions"
            )));
        }
        let mut r = x.to_vec();
        ops::rms_norm_zero_centred(&mut r, &layer.input_norm, c.rms_norm_eps);
        let mut out = LayerOutputs::default();
        let mixed = match (&layer.mixer, state) {
            (Mixer::GatedDeltaNet(w), LayerState::Linear(s)) => {
                let (o, pairs) = gdn::forward(c, w, &r, t, s, froms);
                out.pairs = pairs;
                o
            }
            (Mixer::Attention(w), LayerState::Full(kv)) => {
                let (o, k, v) = attn::forward(c, &self.rope, w, &r, positions, kv);
                out.kv = Some((k, v));
                o
            }
            (Mixer::Lightning(w), LayerState::Linear(s)) => {
                let (o, pairs) = lt::forward(c, &self.rope, w, &r, positions, s, froms);
                out.pairs = pairs;
                o
            }
            (Mixer::Kda(w), LayerState::Linear(s)) => {
                let (o, pairs) = kda::forward(c, w, &r, t, s, froms);
                out.pairs = pairs;
                o
            }
            (Mixer::Mla(w), LayerState::Full(kv)) => {
                let (o, k, v) = mla::forward(c, w, &r, positions, kv);
                out.kv = Some((k, v));
                o
            }
            _ => {
                return Err(Error::Input(format!(
                    "state of layer {i} has the wrong kind"
                )))
            }
        };
        x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
        let mut r = x.to_vec();
        ops::rms_norm_zero_centred(&mut r, &layer.post_norm, c.rms_norm_eps);
        let f = match &layer.ffn {
            Ffn::Dense(m) => mlp_forward(m, &r, t, c.hidden_size),
            Ffn::Moe(m) => self.moe_forward(m, &r, t),
        };
        x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
        Ok(out)
    }

    /// Layer-major forward of spans that follow each other in one sequence, each
    /// followed by a per-layer hook. `spans[i] = (tokens, first position)`; the
    /// residual stream of all spans' rows is one `[Σ T_i, hidden]` matrix. For every
    /// layer `l`, span `i`'s mixer runs from the layer state `state.layers[l]` at
    /// positions `spans[i].1 ..`, then `after_mixer(l, i, layer state)` runs (the PIC
    /// engine composes segment `i`'s cached body there, so span `i + 1` sees it).
    /// The norms, the FFN / MoE block and the mixer's input and output projections
    /// run once over the rows of all spans together; only the stateful middle (conv,
    /// recurrence, KV append and attention) runs per span, on its rows.
    ///
    /// Every [`MixerKind`] is handled. The same math per row as running the spans one
    /// after the other through [`Model::prefill`] with the hooks in between; only the
    /// batched matrix-product shapes differ (a 1-row product takes the gemv path of
    /// [`ops::linear`], a longer one gemm), so results agree to fp32 rounding. Empty
    /// spans run no mixer (their hooks still run). `state.next_position` is left to
    /// the caller. No logits.
    ///
    /// Errors: a token outside the vocabulary, a state that does not match the model
    /// ([`Error::Input`], before any state changes); errors of the hook (the state is
    /// then partly advanced).
    pub fn forward_spans(
        &self,
        spans: &[(&[u32], i64)],
        state: &mut ModelState,
        mut after_mixer: impl FnMut(usize, usize, &mut LayerState) -> Result<()>,
    ) -> Result<()> {
        let spans: Vec<(&[u32], i64, usize)> = spans.iter().map(|&(t, p)| (t, p, 0)).collect();
        self.forward_spans_multi(&spans, &mut [state], |l, i, ls| after_mixer(l, i, ls))?;
        Ok(())
    }

    /// [`Model::forward_spans`] over several sequences at once: `spans[i] = (tokens,
    /// first position, sequence)` runs from `states[sequence]`, so spans of different
    /// requests share one batched pass (norms, FFN / MoE and the mixers' projections
    /// over all rows; each span's stateful middle on its own sequence's layer state,
    /// in span order). Returns the final residual stream `[Σ T_i, hidden]` (before the
    /// final norm), rows in span order. `next_position` of every state is left to the
    /// caller.
    ///
    /// Errors: a sequence index past `states`, a token outside the vocabulary, a state
    /// that does not match the model ([`Error::Input`], before any state changes);
    /// errors of the hook (states then partly advanced).
    pub fn forward_spans_multi(
        &self,
        spans: &[(&[u32], i64, usize)],
        states: &mut [&mut ModelState],
        mut after_mixer: impl FnMut(usize, usize, &mut LayerState) -> Result<()>,
    ) -> Result<Vec<f32>> {
        for st in states.iter() {
            self.check_state(st)?;
        }
        for &(tokens, _, seq) in spans {
            if seq >= states.len() {
                return Err(Error::Input(format!(
                    "span of sequence {seq}, but {} states",
                    states.len()
                )));
            }
            if !tokens.is_empty() {
                self.check_tokens(tokens)?;
            }
        }
        let c = &self.config;
        let h = c.hidden_size;
        let rows: usize = spans.iter().map(|s| s.0.len()).sum();
        if rows == 0 {
            for l in 0..self.layers.len() {
                for (i, s) in spans.iter().enumerate() {
                    after_mixer(l, i, &mut states[s.2].layers[l])?;
                }
            }
            return Ok(vec![]);
        }
        let tokens: Vec<u32> = spans.iter().flat_map(|s| s.0.iter().copied()).collect();
        let positions: Vec<i64> = spans
            .iter()
            .flat_map(|&(t, p0, _)| (0..t.len() as i64).map(move |j| p0 + j))
            .collect();
        // (first row, rows, sequence) of each span.
        let parts: Vec<(usize, usize, usize)> = spans
            .iter()
            .scan(0usize, |o, s| {
                let a = *o;
                *o += s.0.len();
                Some((a, s.0.len(), s.2))
            })
            .collect();
        let mut x = self.embed(&tokens);
        for (l, layer) in self.layers.iter().enumerate() {
            let mut r = x.clone();
            ops::rms_norm_zero_centred(&mut r, &layer.input_norm, c.rms_norm_eps);
            // Per span: the stateful middle on its rows (`core(first row, rows, layer
            // state)` → `[rows, n_mid]`) into `mid`, then the hook.
            let mut spans_mid = |n_mid: usize, core: &mut SpanCore<'_>| -> Result<Vec<f32>> {
                let mut mid = vec![0f32; rows * n_mid];
                for (i, &(a, t, seq)) in parts.iter().enumerate() {
                    let ls = &mut states[seq].layers[l];
                    if t > 0 {
                        let m = core(a, t, ls)?;
                        mid[a * n_mid..(a + t) * n_mid].copy_from_slice(&m);
                    }
                    after_mixer(l, i, ls)?;
                }
                Ok(mid)
            };
            let wrong = || Error::Input(format!("state of layer {l} has the wrong kind"));
            let mixed = match &layer.mixer {
                Mixer::GatedDeltaNet(w) => {
                    let n_in = gdn::in_width(c);
                    let proj = linear(&r, rows, h, &w.w_in, n_in);
                    let vd = c.value_dim();
                    let mid = spans_mid(vd, &mut |a, t, ls| match ls {
                        LayerState::Linear(s) => {
                            Ok(gdn::mix(c, w, &proj[a * n_in..(a + t) * n_in], t, s, &[]).0)
                        }
                        LayerState::Full(_) => Err(wrong()),
                    })?;
                    linear(&mid, rows, vd, &w.out, h)
                }
                Mixer::Attention(w) => {
                    let (qg, k, v) = attn::project(c, w, &r, rows);
                    let (qw, kw) = (qg.len() / rows, k.len() / rows);
                    let ow = c.num_heads * c.head_dim;
                    let mid = spans_mid(ow, &mut |a, t, ls| match ls {
                        LayerState::Full(kv) => {
                            let qkv = (
                                qg[a * qw..(a + t) * qw].to_vec(),
                                k[a * kw..(a + t) * kw].to_vec(),
                                v[a * kw..(a + t) * kw].to_vec(),
                            );
                            let pos = &positions[a..a + t];
                            Ok(attn::mix(c, &self.rope, w, qkv, pos, kv).0)
                        }
                        LayerState::Linear(_) => Err(wrong()),
                    })?;
                    linear(&mid, rows, ow, &w.o, h)
                }
                Mixer::Lightning(w) => {
                    let (qkv, gate) = lt::project(c, w, &r, rows);
                    let wd = lt::width(c);
                    let mid = spans_mid(wd, &mut |a, t, ls| match ls {
                        LayerState::Linear(s) => {
                            let p = (
                                qkv[a * 3 * wd..(a + t) * 3 * wd].to_vec(),
                                gate[a * wd..(a + t) * wd].to_vec(),
                            );
                            let pos = &positions[a..a + t];
                            Ok(lt::mix(c, &self.rope, w, p, pos, s, &[]).0)
                        }
                        LayerState::Full(_) => Err(wrong()),
                    })?;
                    linear(&mid, rows, wd, &w.dense, h)
                }
                Mixer::Kda(w) => {
                    let n_in = kda::in_width(c);
                    let proj = kda::project(c, w, &r, rows);
                    let wd = kda::width(c);
                    let mid = spans_mid(wd, &mut |a, t, ls| match ls {
                        LayerState::Linear(s) => {
                            Ok(kda::mix(c, w, &proj[a * n_in..(a + t) * n_in], t, s, &[]).0)
                        }
                        LayerState::Full(_) => Err(wrong()),
                    })?;
                    linear(&mid, rows, wd, &w.o_proj, h)
                }
                Mixer::Mla(w) => {
                    let (q, kva) = mla::project(c, w, &r, rows);
                    let (qw, kw) = (q.len() / rows, kva.len() / rows);
                    let ow = c.num_heads * c.mla.v_head_dim;
                    let mid = spans_mid(ow, &mut |a, t, ls| match ls {
                        LayerState::Full(kv) => {
                            let p = (
                                q[a * qw..(a + t) * qw].to_vec(),
                                kva[a * kw..(a + t) * kw].to_vec(),
                            );
                            Ok(mla::mix(c, w, p, &positions[a..a + t], kv).0)
                        }
                        LayerState::Linear(_) => Err(wrong()),
                    })?;
                    linear(&mid, rows, ow, &w.o, h)
                }
            };
            x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
            let mut r = x.clone();
            ops::rms_norm_zero_centred(&mut r, &layer.post_norm, c.rms_norm_eps);
            let f = match &layer.ffn {
                Ffn::Dense(m) => mlp_forward(m, &r, rows, h),
                Ffn::Moe(m) => self.moe_forward(m, &r, rows),
            };
            x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
        }
        Ok(x)
    }

    /// Prefills several sequences' spans in one batched pass
    /// ([`Model::forward_spans_multi`]): `items[i] = (tokens, state, want logits)`, each
    /// span at its state's `next_position ..`, which advances by the span's length.
    /// Returns per item the last token's logits `[vocab]` when asked, else empty. The
    /// same math per row as [`Model::prefill`] of each item alone (to fp32 rounding of
    /// the batched products).
    ///
    /// Errors: an empty span, a token outside the vocabulary, a state that does not
    /// match ([`Error::Input`], before any state changes).
    pub fn prefill_many(
        &self,
        items: &mut [(&[u32], &mut ModelState, bool)],
    ) -> Result<Vec<Vec<f32>>> {
        if let Some(i) = items.iter().position(|it| it.0.is_empty()) {
            return Err(Error::Input(format!(
                "span {i} of a batched prefill is empty"
            )));
        }
        let spans: Vec<(&[u32], i64, usize)> = items
            .iter()
            .enumerate()
            .map(|(i, it)| (it.0, it.1.next_position, i))
            .collect();
        let x = {
            let mut states: Vec<&mut ModelState> = items.iter_mut().map(|it| &mut *it.1).collect();
            self.forward_spans_multi(&spans, &mut states, |_, _, _| Ok(()))?
        };
        let h = self.config.hidden_size;
        let mut row = 0usize;
        let mut out = Vec::with_capacity(items.len());
        for it in items.iter_mut() {
            let t = it.0.len();
            row += t;
            it.1.next_position += t as i64;
            out.push(if it.2 {
                self.logits(&x[(row - 1) * h..row * h])
            } else {
                vec![]
            });
        }
        Ok(out)
    }

    fn moe_forward(&self, m: &Moe, r: &[f32], t: usize) -> Vec<f32> {
        let c = &self.config;
        let h = c.hidden_size;
        let e = c.num_experts;
        let logits = linear(r, t, h, &m.router, e);
        // Route each token (`router::RouterConfig::route`).
        let mut per_expert: Vec<Vec<(usize, f32)>> = vec![vec![]; e];
        for ti in 0..t {
            let row = &logits[ti * e..(ti + 1) * e];
            for (j, wgt) in
                c.router
                    .route(row, m.bias.as_deref(), c.experts_per_tok, c.norm_topk_prob)
            {
                per_expert[j].push((ti, wgt));
            }
        }
        let partial: Vec<Vec<(usize, Vec<f32>)>> = per_expert
            .par_iter()
            .enumerate()
            .filter(|(_, rows)| !rows.is_empty())
            .map(|(j, rows)| {
                let mut xe = Vec::with_capacity(rows.len() * h);
                for &(ti, _) in rows {
                    xe.extend_from_slice(&r[ti * h..(ti + 1) * h]);
                }
                let y = mlp_forward(&m.experts[j], &xe, rows.len(), h);
                rows.iter()
                    .enumerate()
                    .map(|(n, &(ti, wgt))| {
                        (ti, y[n * h..(n + 1) * h].iter().map(|v| v * wgt).collect())
                    })
                    .collect()
            })
            .collect();
        let mut out = vec![0f32; t * h];
        for rows in partial {
            for (ti, y) in rows {
                out[ti * h..(ti + 1) * h]
                    .iter_mut()
                    .zip(&y)
                    .for_each(|(a, b)| *a += b);
            }
        }
        if let Some((shared, gate_w)) = &m.shared {
            let y = mlp_forward(shared, r, t, h);
            let g = linear(r, t, h, gate_w, 1);
            for ti in 0..t {
                let s = ops::sigmoid(g[ti]);
                out[ti * h..(ti + 1) * h]
                    .iter_mut()
                    .zip(&y[ti * h..(ti + 1) * h])
                    .for_each(|(a, b)| *a += s * b);
            }
        }
        if let Some(shared) = &m.shared_plain {
            let y = mlp_forward(shared, r, t, h);
            out.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        }
        out
    }
}
/// The stateful middle of a mixer on one span inside [`Model::forward_spans_multi`]:
/// `(first row, rows, layer state)` → the span's output before the mixer's output
/// projection, `[rows, n_mid]`.
type SpanCore<'a> = dyn FnMut(usize, usize, &mut LayerState) -> Result<Vec<f32>> + 'a;

/// Output of [`Model::layer_forward_capture_many`] beside the updated residual stream.
#[derive(Clone, Debug, Default)]
pub struct LayerOutputs {
    /// Full-attention layers: the span's `(K, V)`, `[T, Hkv, hd]` each.
    pub kv: Option<(Vec<f32>, Vec<f32>)>,
    /// Linear layers: one body pair per requested body start, in request order
    /// (`T_body [Hv,dk,dk]`, `S_body|0 [Hv,dk,dv]`); empty for attention layers.
    pub pairs: Vec<Pair>,
}

/// Output of one decoder layer beside the updated residual stream.
#[derive(Clone, Debug, Default)]
pub struct LayerOutput {
    /// Full-attention layers: the span's `(K, V)`, `[T, Hkv, hd]` each.
    pub kv: Option<(Vec<f32>, Vec<f32>)>,
    /// Linear layers with capture: the body pair `(T_body [Hv,dk,dk], S_body|0 [Hv,dk,dv])`.
    pub pair: Option<Pair>,
}

fn mlp_forward(m: &Mlp, x: &[f32], t: usize, h: usize) -> Vec<f32> {
    let i = m.inter;
    let gu = linear(x, t, h, &m.gate_up, 2 * i);
    let mut act = vec![0f32; t * i];
    for ti in 0..t {
        let row = &gu[ti * 2 * i..(ti + 1) * 2 * i];
        for j in 0..i {
            act[ti * i + j] = ops::silu(row[j]) * row[i + j];
        }
    }
    linear(&act, t, i, &m.down, h)
}

/// Names of a dense MLP's gate, up and down projections under its prefix.
const DENSE_PROJ: [&str; 3] = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"];

fn load_mlp(
    ckpt: &Checkpoint,
    p: &str,
    h: usize,
    inter: usize,
    [gate, up, down]: [&str; 3],
) -> Result<Mlp> {
    let mut gate_up = ckpt.get(&format!("{p}{gate}"), &[inter, h])?;
    gate_up.extend(ckpt.get(&format!("{p}{up}"), &[inter, h])?);
    let down = ckpt.get_buf(&format!("{p}{down}"), &[h, inter])?;
    Ok(Mlp {
        gate_up: gate_up.into(),
        down,
        inter,
    })
}

fn load_moe(c: &ModelConfig, ckpt: &Checkpoint, p: &str) -> Result<Moe> {
    let (h, e, i) = (c.hidden_size, c.num_experts, c.moe_intermediate_size);
    let router = ckpt.get_buf(&format!("{p}gate.weight"), &[e, h])?;
    let fused = format!("{p}experts.gate_up_proj");
    let experts = if ckpt.contains(&fused) {
        // Fused 3-D experts: gate_up_proj [E, 2I, H] (gate rows then up), down_proj [E, H, I].
        // Each expert's block of the fused tensors (in place for an f32 checkpoint).
        let gu = ckpt.get_buf(&fused, &[e, 2 * i, h])?;
        let dn = ckpt.get_buf(&format!("{p}experts.down_proj"), &[e, h, i])?;
        (0..e)
            .map(|j| Mlp {
                gate_up: gu.range(j * 2 * i * h, (j + 1) * 2 * i * h),
                down: dn.range(j * h * i, (j + 1) * h * i),
                inter: i,
            })
            .collect()
    } else {
        (0..e)
            .map(|j| load_mlp(ckpt, &format!("{p}experts.{j}."), h, i, c.names.expert_proj))
            .collect::<Result<Vec<_>>>()?
    };
    let (mut shared, mut shared_plain) = (None, None);
    if c.shared_expert_intermediate_size > 0 {
        let m = load_mlp(
            ckpt,
            &format!("{p}{}", c.names.shared_expert),
            h,
            c.shared_expert_intermediate_size,
            DENSE_PROJ,
        )?;
        match c.names.shared_expert_gate {
            Some(gate) => shared = Some((m, ckpt.get_buf(&format!("{p}{gate}"), &[1, h])?)),
            None => shared_plain = Some(m),
        }
    }
    let bias = match c.router.selection_bias {
        Some(b) => Some(ckpt.get(&format!("{p}{b}"), &[e])?),
        None => None,
    };
    Ok(Moe {
        router,
        bias,
        experts,
        shared,
        shared_plain,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Model {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden")
            .join(name);
        Model::load(&dir, &mut |_, _| {}).unwrap()
    }

    /// The fp32 parameters `round_projections` leaves alone, in a fixed order.
    fn small_params(m: &Model) -> Vec<Vec<f32>> {
        let mut v = vec![m.final_norm.clone()];
        for l in &m.layers {
            v.push(l.input_norm.clone());
            v.push(l.post_norm.clone());
            match &l.mixer {
                Mixer::GatedDeltaNet(w) => {
                    v.extend([&w.conv, &w.neg_a, &w.dt_bias, &w.norm].map(|x| x.clone()))
                }
                Mixer::Attention(w) => v.extend([w.q_norm.clone(), w.k_norm.clone()]),
                Mixer::Lightning(w) => {
                    v.extend([&w.q_norm, &w.k_norm, &w.g_norm, &w.log_decay].map(|x| x.clone()))
                }
                Mixer::Kda(w) => {
                    v.extend([&w.conv, &w.neg_a, &w.dt_bias, &w.o_norm].map(|x| x.clone()))
                }
                Mixer::Mla(w) => v.push(w.kv_norm.clone()),
            }
            if let Ffn::Moe(m) = &l.ffn {
                v.extend(m.bias.clone());
            }
        }
        v
    }

    /// `round_projections` rounds the weight matrices (every value then a bf16 value,
    /// some changed on these fp32 fixtures) and leaves norms, conv weights, `A`,
    /// `dt_bias`, log decays and router biases bit for bit.
    #[test]
    fn round_projections_rounds_matrices_only() {
        let bf = |x: f32| half::bf16::from_f32(x).to_f32();
        for name in ["qwen3_5", "qwen3_next", "bailing_moe_linear", "kimi_linear"] {
            let m = fixture(name);
            let mut r = fixture(name);
            r.round_projections(bf);
            assert_eq!(small_params(&r), small_params(&m), "{name}");
            let exact = |w: &[f32]| w.iter().all(|&x| bf(x) == x);
            assert!(
                exact(&r.embed) && r.lm_head.as_deref().is_none_or(exact),
                "{name}"
            );
            assert!(
                !exact(&m.embed),
                "{name}: the fixture's embedding is already bf16"
            );
            for l in &r.layers {
                let mats: Vec<&[f32]> = match &l.mixer {
                    Mixer::GatedDeltaNet(w) => vec![&w.w_in, &w.out],
                    Mixer::Attention(w) => vec![&w.q, &w.k, &w.v, &w.o],
                    Mixer::Lightning(w) => vec![&w.qkv, &w.g_proj, &w.dense],
                    Mixer::Kda(w) => vec![&w.w_in, &w.f_b, &w.g_b, &w.o_proj],
                    Mixer::Mla(w) => vec![&w.q, &w.kv_a, &w.w_uk, &w.w_uv, &w.o],
                };
                assert!(mats.into_iter().all(exact), "{name} mixer");
                let mlp_ok = |x: &Mlp| exact(&x.gate_up) && exact(&x.down);
                match &l.ffn {
                    Ffn::Dense(x) => assert!(mlp_ok(x), "{name} MLP"),
                    Ffn::Moe(x) => {
                        assert!(exact(&x.router) && x.experts.iter().all(mlp_ok), "{name}");
                        assert!(x.shared.as_ref().is_none_or(|(s, g)| mlp_ok(s) && exact(g)));
                        assert!(x.shared_plain.as_ref().is_none_or(mlp_ok), "{name}");
                    }
                }
            }
            // Rounding twice changes nothing.
            let once = r
                .prefill(&[1, 2, 3], &mut r.new_state(), Logits::All)
                .unwrap();
            r.round_projections(bf);
            let twice = r
                .prefill(&[1, 2, 3], &mut r.new_state(), Logits::All)
                .unwrap();
            assert_eq!(once.logits, twice.logits, "{name}");
        }
    }
}
