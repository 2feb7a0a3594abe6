//! The hybrid decoder (Qwen3-Next / Qwen3.5) on the CPU reference backend, with the
//! span-level state API used by decoding and position-independent caching.
//!
//! Math follows HF transformers `modeling_qwen3_next.py` / `modeling_qwen3_5*.py`
//! (docs/pic-design.md §8, Qwen3-Next and Qwen3.5). Activations are fp32 `[T, hidden]`
//! row-major.
use crate::config::{Family, LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::linear::gdr::{self, GdrDims};
use crate::linear::transition::{Pair, TransitionKind};
use crate::ops::{self, linear, Rope};
use crate::state::{KvCache, LayerState, LinearState, ModelState};
use crate::weights::{Checkpoint, F32Buf};
use rayon::prelude::*;
use std::path::Path;

/// Gated DeltaNet weights, with the projections merged into one matrix.
pub(crate) struct GdnWeights {
    /// `[2·key_dim + 2·value_dim + 2·Hv, hidden]`: rows `q_all | k_all | v_all | z_all | b | a`
    /// (the Qwen3.5 split order; Qwen3-Next's per-key-head grouping is undone at load).
    pub(crate) w_in: Vec<f32>,
    /// Depthwise conv weight `[conv_dim, K]`.
    pub(crate) conv: Vec<f32>,
    /// `−exp(A_log)`, `[Hv]`.
    pub(crate) neg_a: Vec<f32>,
    /// `[Hv]`.
    pub(crate) dt_bias: Vec<f32>,
    /// Gated RMSNorm weight `[dv]` (not offset).
    pub(crate) norm: Vec<f32>,
    /// `[hidden, value_dim]`.
    pub(crate) out: F32Buf,
}

/// Gated attention weights.
pub(crate) struct AttnWeights {
    /// `[H·hd·(1+gate), hidden]`; per head `[q(hd) | gate(hd)]` when gated.
    pub(crate) q: F32Buf,
    /// `[Hkv·hd, hidden]`.
    pub(crate) k: F32Buf,
    /// `[Hkv·hd, hidden]`.
    pub(crate) v: F32Buf,
    /// `[hidden, H·hd]`.
    pub(crate) o: F32Buf,
    /// Zero-centred, `[hd]`.
    pub(crate) q_norm: Vec<f32>,
    /// Zero-centred, `[hd]`.
    pub(crate) k_norm: Vec<f32>,
}

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
    pub(crate) experts: Vec<Mlp>,
    /// Shared expert and its scalar gate `[1, hidden]`.
    pub(crate) shared: Option<(Mlp, F32Buf)>,
}

pub(crate) enum Mixer {
    Linear(GdnWeights),
    Full(AttnWeights),
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
        let p = c.weight_prefix.clone();
        let h = c.hidden_size;
        let total = c.num_layers + 2;
        progress(0, total);
        let embed = ckpt.get_buf(&format!("{p}embed_tokens.weight"), &[c.vocab_size, h])?;
        let final_norm = ckpt.get(&format!("{p}norm.weight"), &[h])?;
        let lm_head = if c.tie_word_embeddings && !ckpt.contains("lm_head.weight") {
            None
        } else {
            Some(ckpt.get_buf("lm_head.weight", &[c.vocab_size, h])?)
        };
        progress(1, total);
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let lp = format!("{p}layers.{i}.");
            let mixer = match c.layer_kinds[i] {
                LayerKind::Linear => {
                    Mixer::Linear(load_gdn(c, ckpt, &format!("{lp}linear_attn."))?)
                }
                LayerKind::Full => Mixer::Full(load_attn(c, ckpt, &format!("{lp}self_attn."))?),
            };
            let ffn = if c.layer_is_moe[i] {
                Ffn::Moe(load_moe(c, ckpt, &format!("{lp}mlp."))?)
            } else {
                Ffn::Dense(load_mlp(
                    ckpt,
                    &format!("{lp}mlp."),
                    h,
                    c.intermediate_size,
                )?)
            };
            layers.push(Layer {
                input_norm: ckpt.get(&format!("{lp}input_layernorm.weight"), &[h])?,
                post_norm: ckpt.get(&format!("{lp}post_attention_layernorm.weight"), &[h])?,
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
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Linear => LayerState::Linear(LinearState {
                    conv: vec![0.0; c.conv_dim() * (c.conv_kernel - 1)],
                    recurrent: vec![0.0; c.linear_v_heads * c.linear_k_dim * c.linear_v_dim],
                }),
                LayerKind::Full => LayerState::Full(KvCache::default()),
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
        for (i, (l, k)) in state.layers.iter().zip(&c.layer_kinds).enumerate() {
            let ok = match (l, k) {
                (LayerState::Linear(s), LayerKind::Linear) => {
                    s.conv.len() == c.conv_dim() * (c.conv_kernel - 1)
                        && s.recurrent.len() == c.linear_v_heads * c.linear_k_dim * c.linear_v_dim
                }
                (LayerState::Full(kv), LayerKind::Full) => {
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
                Mixer::Linear(w) => {
                    let n_in = self.gdn_in_width();
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
                            let inp = self.gdn_inputs(w, &proj[j * n_in..(j + 1) * n_in], 1, s);
                            let core = run_gdr(&self.gdr_dims(1), &inp, 0, 1, &mut s.recurrent);
                            row.copy_from_slice(&self.gdn_gated_norm(w, core, &inp.z));
                        });
                    linear(&pre, b, vd, &w.out, h)
                }
                Mixer::Full(w) => {
                    let (qg, k, v) = self.attn_proj(w, &r, b);
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
                            let (o, _, _) = self.attn_mix(
                                w,
                                qg[j * qw..(j + 1) * qw].to_vec(),
                                k[j * kw..(j + 1) * kw].to_vec(),
                                v[j * kw..(j + 1) * kw].to_vec(),
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
            (Mixer::Linear(w), LayerState::Linear(s)) => {
                let (o, pairs) = self.gdn_forward(w, &r, t, s, froms);
                out.pairs = pairs;
                o
            }
            (Mixer::Full(w), LayerState::Full(kv)) => {
                let (o, k, v) = self.attn_forward(w, &r, positions, kv);
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

    /// Width of the merged GDN input projection: `conv_dim + value_dim + 2·Hv`.
    fn gdn_in_width(&self) -> usize {
        let c = &self.config;
        c.conv_dim() + c.value_dim() + 2 * c.linear_v_heads
    }

    /// From the GDN input projection `proj` (`[T, gdn_in_width]`) computes conv and
    /// gates for a span: `(q [T,Hk,dk] normalised and scaled, k [T,Hk,dk] normalised,
    /// v [T,Hv,dv], g [T,Hv], beta [T,Hv], z [T,Hv,dv])`, advancing the conv tail in `s`.
    fn gdn_inputs(&self, w: &GdnWeights, proj: &[f32], t: usize, s: &mut LinearState) -> GdnInputs {
        let c = &self.config;
        let (kd, vd, hv) = (c.key_dim(), c.value_dim(), c.linear_v_heads);
        let cd = c.conv_dim();
        let n_in = self.gdn_in_width();
        // Causal depthwise conv over q|k|v with the cached tail, then SiLU.
        let kw = c.conv_kernel;
        let tail = kw - 1;
        let input = |tau: isize, ch: usize| -> f32 {
            if tau >= 0 {
                proj[tau as usize * n_in + ch]
            } else {
                s.conv[ch * tail + (tail as isize + tau) as usize]
            }
        };
        let mut mixed = vec![0f32; t * cd];
        mixed.par_chunks_mut(cd).enumerate().for_each(|(ti, row)| {
            for (ch, out) in row.iter_mut().enumerate() {
                let wr = &w.conv[ch * kw..(ch + 1) * kw];
                let mut acc = 0f32;
                for (j, wj) in wr.iter().enumerate() {
                    acc += wj * input(ti as isize - tail as isize + j as isize, ch);
                }
                *out = ops::silu(acc);
            }
        });
        let mut new_tail = vec![0f32; cd * tail];
        for ch in 0..cd {
            for j in 0..tail {
                new_tail[ch * tail + j] = input(t as isize - tail as isize + j as isize, ch);
            }
        }
        s.conv = new_tail;
        let mut q = Vec::with_capacity(t * kd);
        let mut k = Vec::with_capacity(t * kd);
        let mut v = Vec::with_capacity(t * vd);
        let mut z = Vec::with_capacity(t * vd);
        let mut g = Vec::with_capacity(t * hv);
        let mut beta = Vec::with_capacity(t * hv);
        for ti in 0..t {
            let m = &mixed[ti * cd..(ti + 1) * cd];
            q.extend_from_slice(&m[..kd]);
            k.extend_from_slice(&m[kd..2 * kd]);
            v.extend_from_slice(&m[2 * kd..]);
            let p = &proj[ti * n_in..(ti + 1) * n_in];
            z.extend_from_slice(&p[cd..cd + vd]);
            for h in 0..hv {
                beta.push(ops::sigmoid(p[cd + vd + h]));
                g.push(w.neg_a[h] * ops::softplus(p[cd + vd + hv + h] + w.dt_bias[h]));
            }
        }
        let dk = c.linear_k_dim;
        ops::l2_normalize(&mut q, dk, 1e-6);
        ops::l2_normalize(&mut k, dk, 1e-6);
        let scale = (dk as f32).powf(-0.5);
        q.iter_mut().for_each(|x| *x *= scale);
        GdnInputs {
            q,
            k,
            v,
            g,
            beta,
            z,
        }
    }

    fn gdr_dims(&self, t: usize) -> GdrDims {
        let c = &self.config;
        GdrDims {
            t,
            hk: c.linear_k_heads,
            hv: c.linear_v_heads,
            dk: c.linear_k_dim,
            dv: c.linear_v_dim,
        }
    }

    fn gdn_forward(
        &self,
        w: &GdnWeights,
        r: &[f32],
        t: usize,
        s: &mut LinearState,
        froms: &[usize],
    ) -> (Vec<f32>, Vec<Pair>) {
        let proj = linear(r, t, self.config.hidden_size, &w.w_in, self.gdn_in_width());
        let s0 = (froms.len() > 1).then(|| s.recurrent.clone());
        let inp = self.gdn_inputs(w, &proj, t, s);
        let mut pairs = Vec::with_capacity(froms.len());
        let core = match froms.split_first() {
            None => run_gdr(&self.gdr_dims(t), &inp, 0, t, &mut s.recurrent),
            Some((&first, rest)) => {
                let (core, pair) = self.gdr_with_body_pair(&inp, first, t, &mut s.recurrent);
                pairs.push(pair);
                for &from in rest {
                    let mut st = s0.clone().unwrap_or_default();
                    pairs.push(self.gdr_with_body_pair(&inp, from, t, &mut st).1);
                }
                core
            }
        };
        let c = &self.config;
        let normed = self.gdn_gated_norm(w, core, &inp.z);
        (
            linear(&normed, t, c.value_dim(), &w.out, c.hidden_size),
            pairs,
        )
    }

    /// The gated delta rule over tokens `0..t` from `state` (advanced to the end):
    /// returns the core output `[t, Hv, dv]` and the body pair of `from..t`,
    /// `T_body` from the chunked kernel in the same pass and
    /// `S_body|0 = S_t − T_body · S_from` (docs/pic-design.md §2.4).
    fn gdr_with_body_pair(
        &self,
        inp: &GdnInputs,
        from: usize,
        t: usize,
        state: &mut [f32],
    ) -> (Vec<f32>, Pair) {
        let from = from.min(t);
        let c = &self.config;
        let (hv, dk, dv) = (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim);
        let mut core = run_gdr(&self.gdr_dims(from), inp, 0, from, state);
        let body = t - from;
        if body == 0 {
            return (core, Pair::identity(TransitionKind::Dense, hv, dk, dv));
        }
        let s_w = state.to_vec();
        let d = self.gdr_dims(body);
        let sl = inp.slice(&d, from, t);
        let (o, tc) =
            gdr::chunked_with_transition(&d, sl.0, sl.1, sl.2, sl.3, sl.4, state, GDR_CHUNK);
        core.extend_from_slice(&o);
        let t_only = Pair::from_parts(
            TransitionKind::Dense,
            hv,
            dk,
            dv,
            tc.clone(),
            vec![0.0; hv * dk * dv],
        )
        .expect("shapes from the model config");
        let mut ts_w = s_w;
        t_only
            .apply(&mut ts_w)
            .expect("state shape from the model config");
        let b: Vec<f32> = state.iter().zip(&ts_w).map(|(a, b)| a - b).collect();
        let pair = Pair::from_parts(TransitionKind::Dense, hv, dk, dv, tc, b)
            .expect("shapes from the model config");
        (core, pair)
    }

    /// Gated RMSNorm `w · rmsnorm(core) · silu(z)` per value head (before `out_proj`).
    fn gdn_gated_norm(&self, w: &GdnWeights, mut core: Vec<f32>, z: &[f32]) -> Vec<f32> {
        ops::rms_norm(&mut core, &w.norm, self.config.rms_norm_eps);
        core.iter_mut()
            .zip(z)
            .for_each(|(o, zi)| *o *= ops::silu(*zi));
        core
    }

    /// Gated attention for a span; appends the span's K/V to `kv`.
    /// Returns (output `[T, hidden]`, span K, span V).
    fn attn_forward(
        &self,
        w: &AttnWeights,
        r: &[f32],
        positions: &[i64],
        kv: &mut KvCache,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let t = positions.len();
        let (qg, k, v) = self.attn_proj(w, r, t);
        let (o, k, v) = self.attn_mix(w, qg, k, v, positions, kv);
        (
            linear(&o, t, c.num_heads * c.head_dim, &w.o, c.hidden_size),
            k,
            v,
        )
    }

    /// q|gate, k, v projections of `r` (`[T, hidden]`).
    fn attn_proj(&self, w: &AttnWeights, r: &[f32], t: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let qw = nh * hd * if c.attn_output_gate { 2 } else { 1 };
        (
            linear(r, t, c.hidden_size, &w.q, qw),
            linear(r, t, c.hidden_size, &w.k, nkv * hd),
            linear(r, t, c.hidden_size, &w.v, nkv * hd),
        )
    }

    /// From projections: q/k norm, RoPE, KV append, causal attention, output gate.
    /// Returns (gated attention output `[T, H·hd]` before `o_proj`, span K, span V).
    fn attn_mix(
        &self,
        w: &AttnWeights,
        qg: Vec<f32>,
        mut k: Vec<f32>,
        v: Vec<f32>,
        positions: &[i64],
        kv: &mut KvCache,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let t = positions.len();
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let gated = c.attn_output_gate;
        let mut q = vec![0f32; t * nh * hd];
        let mut gate = vec![0f32; if gated { t * nh * hd } else { 0 }];
        for ti in 0..t {
            for h in 0..nh {
                let src = if gated {
                    (ti * nh + h) * 2 * hd
                } else {
                    (ti * nh + h) * hd
                };
                q[(ti * nh + h) * hd..(ti * nh + h + 1) * hd].copy_from_slice(&qg[src..src + hd]);
                if gated {
                    gate[(ti * nh + h) * hd..(ti * nh + h + 1) * hd]
                        .copy_from_slice(&qg[src + hd..src + 2 * hd]);
                }
            }
        }
        ops::rms_norm_zero_centred(&mut q, &w.q_norm, c.rms_norm_eps);
        ops::rms_norm_zero_centred(&mut k, &w.k_norm, c.rms_norm_eps);
        for ti in 0..t {
            self.rope
                .apply(&mut q[ti * nh * hd..(ti + 1) * nh * hd], hd, positions[ti]);
            self.rope.apply(
                &mut k[ti * nkv * hd..(ti + 1) * nkv * hd],
                hd,
                positions[ti],
            );
        }
        kv.k.extend_from_slice(&k);
        kv.v.extend_from_slice(&v);
        kv.positions.extend_from_slice(positions);
        let mut o = attention(&q, positions, kv, nh, nkv, hd);
        if gated {
            o.iter_mut()
                .zip(&gate)
                .for_each(|(a, g)| *a *= ops::sigmoid(*g));
        }
        (o, k, v)
    }

    fn moe_forward(&self, m: &Moe, r: &[f32], t: usize) -> Vec<f32> {
        let c = &self.config;
        let h = c.hidden_size;
        let e = c.num_experts;
        let logits = linear(r, t, h, &m.router, e);
        // Route: softmax, top-k, optional renormalisation.
        let mut per_expert: Vec<Vec<(usize, f32)>> = vec![vec![]; e];
        for ti in 0..t {
            let mut p = logits[ti * e..(ti + 1) * e].to_vec();
            ops::softmax(&mut p);
            let mut idx: Vec<usize> = (0..e).collect();
            idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let top = &idx[..c.experts_per_tok];
            let sum: f32 = top.iter().map(|&j| p[j]).sum();
            for &j in top {
                let wgt = if c.norm_topk_prob { p[j] / sum } else { p[j] };
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
        out
    }
}

struct GdnInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    z: Vec<f32>,
}

type GdrSlices<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32], &'a [f32]);

impl GdnInputs {
    /// Tokens `a..b` of (q, k, v, g, beta); `d` holds the full-span head dims.
    fn slice(&self, d: &GdrDims, a: usize, b: usize) -> GdrSlices<'_> {
        let (kw, vw) = (d.hk * d.dk, d.hv * d.dv);
        (
            &self.q[a * kw..b * kw],
            &self.k[a * kw..b * kw],
            &self.v[a * vw..b * vw],
            &self.g[a * d.hv..b * d.hv],
            &self.beta[a * d.hv..b * d.hv],
        )
    }
}

/// Chunk size of the WY prefill kernel (FLA's default).
pub const GDR_CHUNK: usize = 64;

/// Spans shorter than this run the token-by-token recurrence (decode, seams).
pub(crate) const CHUNKED_MIN_TOKENS: usize = 16;

/// Runs the gated delta rule over tokens `a..b` of `inp` from `state` (in place).
fn run_gdr(d: &GdrDims, inp: &GdnInputs, a: usize, b: usize, state: &mut [f32]) -> Vec<f32> {
    let n = b - a;
    if n == 0 {
        return vec![];
    }
    let d = GdrDims { t: n, ..*d };
    let (q, k, v, g, beta) = inp.slice(&d, a, b);
    if n < CHUNKED_MIN_TOKENS {
        gdr::recurrent(&d, q, k, v, g, beta, state)
    } else {
        gdr::chunked(&d, q, k, v, g, beta, state, GDR_CHUNK)
    }
}

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

/// Causal GQA attention of queries `q` (`[T, H, hd]`, at `positions`) over every
/// cached key with position ≤ the query's position. Scale `hd^-0.5`, fp32 softmax.
/// Returns `[T, H, hd]`.
pub fn attention(
    q: &[f32],
    positions: &[i64],
    kv: &KvCache,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Vec<f32> {
    let t = positions.len();
    let n = kv.len();
    let rep = nh / nkv;
    let scale = (hd as f32).powf(-0.5);
    let mut out = vec![0f32; t * nh * hd];
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (ti, h) = (idx / nh, idx % nh);
        let kh = h / rep;
        let qv = &q[idx * hd..(idx + 1) * hd];
        let p = positions[ti];
        let mut scores = Vec::with_capacity(n);
        let mut m = f32::NEG_INFINITY;
        for j in 0..n {
            if kv.positions[j] <= p {
                let kvec = &kv.k[(j * nkv + kh) * hd..(j * nkv + kh + 1) * hd];
                let s = ops::dot(qv, kvec) * scale;
                m = m.max(s);
                scores.push((j, s));
            }
        }
        let mut denom = 0f32;
        for (_, s) in scores.iter_mut() {
            *s = (*s - m).exp();
            denom += *s;
        }
        for (j, s) in scores {
            let vv = &kv.v[(j * nkv + kh) * hd..(j * nkv + kh + 1) * hd];
            let wgt = s / denom;
            o.iter_mut().zip(vv).for_each(|(a, b)| *a += wgt * b);
        }
    });
    out
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

fn load_mlp(ckpt: &Checkpoint, p: &str, h: usize, inter: usize) -> Result<Mlp> {
    let mut gate_up = ckpt.get(&format!("{p}gate_proj.weight"), &[inter, h])?;
    gate_up.extend(ckpt.get(&format!("{p}up_proj.weight"), &[inter, h])?);
    let down = ckpt.get_buf(&format!("{p}down_proj.weight"), &[h, inter])?;
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
            .map(|j| load_mlp(ckpt, &format!("{p}experts.{j}."), h, i))
            .collect::<Result<Vec<_>>>()?
    };
    let shared = if c.shared_expert_intermediate_size > 0 {
        let m = load_mlp(
            ckpt,
            &format!("{p}shared_expert."),
            h,
            c.shared_expert_intermediate_size,
        )?;
        let g = ckpt.get_buf(&format!("{p}shared_expert_gate.weight"), &[1, h])?;
        Some((m, g))
    } else {
        None
    };
    Ok(Moe {
        router,
        experts,
        shared,
    })
}

fn load_attn(c: &ModelConfig, ckpt: &Checkpoint, p: &str) -> Result<AttnWeights> {
    let (h, nh, nkv, hd) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim);
    let qw = nh * hd * if c.attn_output_gate { 2 } else { 1 };
    Ok(AttnWeights {
        q: ckpt.get_buf(&format!("{p}q_proj.weight"), &[qw, h])?,
        k: ckpt.get_buf(&format!("{p}k_proj.weight"), &[nkv * hd, h])?,
        v: ckpt.get_buf(&format!("{p}v_proj.weight"), &[nkv * hd, h])?,
        o: ckpt.get_buf(&format!("{p}o_proj.weight"), &[h, nh * hd])?,
        q_norm: ckpt.get(&format!("{p}q_norm.weight"), &[hd])?,
        k_norm: ckpt.get(&format!("{p}k_norm.weight"), &[hd])?,
    })
}

fn load_gdn(c: &ModelConfig, ckpt: &Checkpoint, p: &str) -> Result<GdnWeights> {
    let h = c.hidden_size;
    let (hk, hv, dk, dv) = (
        c.linear_k_heads,
        c.linear_v_heads,
        c.linear_k_dim,
        c.linear_v_dim,
    );
    let (kd, vd) = (c.key_dim(), c.value_dim());
    let rep = hv / hk;
    let fused = format!("{p}in_proj_qkvz.weight");
    let mut w_in = Vec::with_capacity((2 * kd + 2 * vd + 2 * hv) * h);
    if c.family == Family::Qwen3Next || ckpt.contains(&fused) {
        // Per key-head group g: [q(dk) | k(dk) | v(rep·dv) | z(rep·dv)] rows, and
        // in_proj_ba per group: [b(rep) | a(rep)] (HF `fix_query_key_value_ordering`).
        let qkvz = ckpt.get(&fused, &[2 * kd + 2 * vd, h])?;
        let ba = ckpt.get(&format!("{p}in_proj_ba.weight"), &[2 * hv, h])?;
        let group = 2 * dk + 2 * rep * dv;
        let rows = |buf: &mut Vec<f32>, off: usize, n: usize| {
            for g in 0..hk {
                let start = (g * group + off) * h;
                buf.extend_from_slice(&qkvz[start..start + n * h]);
            }
        };
        rows(&mut w_in, 0, dk);
        rows(&mut w_in, dk, dk);
        rows(&mut w_in, 2 * dk, rep * dv);
        rows(&mut w_in, 2 * dk + rep * dv, rep * dv);
        for off in [0, rep] {
            for g in 0..hk {
                let start = (g * 2 * rep + off) * h;
                w_in.extend_from_slice(&ba[start..start + rep * h]);
            }
        }
    } else {
        w_in.extend(ckpt.get(&format!("{p}in_proj_qkv.weight"), &[2 * kd + vd, h])?);
        w_in.extend(ckpt.get(&format!("{p}in_proj_z.weight"), &[vd, h])?);
        w_in.extend(ckpt.get(&format!("{p}in_proj_b.weight"), &[hv, h])?);
        w_in.extend(ckpt.get(&format!("{p}in_proj_a.weight"), &[hv, h])?);
    }
    Ok(GdnWeights {
        w_in,
        conv: ckpt.get(
            &format!("{p}conv1d.weight"),
            &[c.conv_dim(), 1, c.conv_kernel],
        )?,
        neg_a: ckpt.neg_a(&format!("{p}A_log"), hv)?,
        dt_bias: ckpt.get(&format!("{p}dt_bias"), &[hv])?,
        norm: ckpt.get(&format!("{p}norm.weight"), &[dv])?,
        out: ckpt.get_buf(&format!("{p}out_proj.weight"), &[h, vd])?,
    })
}
