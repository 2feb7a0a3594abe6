//! Kimi-Linear's two token mixers in the GPU model ([`GpuModel`]): Kimi Delta
//! Attention (the CPU `mixers::kda::layer`) and latent attention without RoPE (the CPU
//! `mixers::mla`), each split like the other mixers of `model.rs` into an input
//! projection, a stateful middle (`*_core`, what `forward_spans` and `decode_hidden`
//! run per sequence) and an output projection.
//!
//! KDA: one merged in-projection `[T, 3·H·d + 2·d + H]` (rows `q | k | v | f_a | g_a
//! | b`), the depthwise causal conv + SiLU over `q|k|v` with the cached tail
//! (`ops::conv1d_*`), `kda_prep_*` (L2-normalised q, k, q scaled by `d^-½`, v, the
//! low-rank gate inputs, `β = sigmoid(b)`), `f_b_proj` and `g_b_proj` GEMMs, the
//! forget gate `g = −exp(A_log)·softplus(f_b(f_a) + dt_bias)` (`kda_gate_*`), the
//! recurrence ([`super::kda::chunked`] for spans of ≥
//! [`super::kda::CHUNKED_MIN_TOKENS`], [`super::kda::chunked_tc`] instead for bf16 with
//! `dk = dv = 128` unless `HYPIC_CUDA_KDA_TC=0`, else [`super::kda::recurrent`]), the
//! sigmoid-gated RMSNorm (`kda_gated_norm_*`) and `o_proj`. The PIC cache build takes
//! the body pair from the chunked kernel's `T_C` in the same pass.
//!
//! MLA: one merged in-projection `[T, H·(nope + rope) + r + rope]` (rows `q_proj |
//! kv_a_proj_with_mqa`), the latent rows `[c | k_rot]` (`mla_rows_*`: RMSNorm of the
//! latent, `r + rope` wide, stored as K and as V in the layer's [`GpuKv`] with one KV
//! head), the absorbed queries (`mla_absorb_q_*`, pre-scaled so that the attention's
//! `row^-½` becomes `qk_head_dim^-½`), causal attention over the cached rows
//! (`attn_generic_*`, any row width ≤ 1024), the value expansion (`mla_expand_*`) and
//! `o_proj`.
use cudarc::cublas::{CudaBlas, Gemm};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::compile::{KDA, MLA};
use super::model::{attn_generic, GpuKv, GpuModel, L2_EPS};
use super::transition::DensePair;
use super::{
    blas, cfg1, check_len, dim_i32, gdr, kda, ops, shape_err, CudaSlice, Elem, Result, Scratch,
};
use crate::config::ModelConfig;
use crate::mixers::gated_deltanet::GdrDims;

/// KDA weights on the device.
pub(crate) struct KdaW<T> {
    /// `[3·H·d + 2·d + H, hidden]`: rows `q | k | v` (`H·d` each), `f_a` (`d`), `g_a`
    /// (`d`), `b` (`H`).
    pub(crate) w_in: CudaSlice<T>,
    /// `f_b_proj` `[H·d, d]`.
    pub(crate) f_b: CudaSlice<T>,
    /// `g_b_proj` `[H·d, d]`.
    pub(crate) g_b: CudaSlice<T>,
    /// Depthwise conv weights `[3·H·d, K]` fp32 (channels `q | k | v`).
    pub(crate) conv: CudaSlice<f32>,
    /// `−exp(A_log)`, `[H]` fp32.
    pub(crate) neg_a: CudaSlice<f32>,
    /// `[H·d]` fp32.
    pub(crate) dt_bias: CudaSlice<f32>,
    /// Gated RMSNorm weight `[d]` fp32 (plain).
    pub(crate) o_norm: CudaSlice<f32>,
    /// `[hidden, H·d]`.
    pub(crate) o_proj: CudaSlice<T>,
}

/// MLA weights on the device.
pub(crate) struct MlaW<T> {
    /// `[H·(nope + rope) + r + rope, hidden]`: rows of `q_proj` (per head `q_nope |
    /// q_rot`), then `kv_a_proj_with_mqa`.
    pub(crate) w_in: CudaSlice<T>,
    /// `kv_a_layernorm` weight `[r]` fp32 (plain).
    pub(crate) kv_norm: CudaSlice<f32>,
    /// Key expansion `[H, nope, r]`.
    pub(crate) w_uk: CudaSlice<T>,
    /// Value expansion `[H, v, r]`.
    pub(crate) w_uv: CudaSlice<T>,
    /// `o_proj` `[hidden, H·v]`.
    pub(crate) o: CudaSlice<T>,
}

/// Width `H·d` of KDA's q, k, v and core output.
pub(crate) fn kda_width(c: &ModelConfig) -> usize {
    c.linear_v_heads * c.linear_v_dim
}

/// Width of KDA's merged in-projection: `3·H·d + 2·d + H`.
pub(crate) fn kda_in_width(c: &ModelConfig) -> usize {
    3 * kda_width(c) + 2 * c.linear_k_dim + c.linear_v_heads
}

/// Width of MLA's merged in-projection: `H·(nope + rope) + r + rope`.
pub(crate) fn mla_in_width(c: &ModelConfig) -> usize {
    c.num_heads * c.mla.qk_head_dim() + c.mla.row()
}

/// Width of MLA's output before `o_proj`: `H·v`.
pub(crate) fn mla_mid_width(c: &ModelConfig) -> usize {
    c.num_heads * c.mla.v_head_dim
}

impl<T: Elem> GpuModel<T>
where
    CudaBlas: Gemm<T>,
{
    /// KDA mixer over `r` (`[t, h]`, normed), advancing the conv tail and the
    /// recurrent state; with `capture` the body pair of tokens `from..t`. Returns the
    /// mixer output `[t, h]`.
    pub(crate) fn kda(
        &self,
        w: &KdaW<T>,
        r: &CudaSlice<T>,
        t: usize,
        conv: &mut CudaSlice<f32>,
        rec: &mut CudaSlice<f32>,
        capture: Option<(usize, &mut Option<DensePair>)>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (h, n_in, wd) = (c.hidden_size, kda_in_width(c), kda_width(c));
        let zero = T::from_f32(0.0);
        let mut proj: Scratch<T> = g.scratch(t * n_in)?;
        blas::linear(g, r, t, h, &w.w_in, n_in, &mut proj, zero)?;
        let core = self.kda_core(w, &proj, t, conv, rec, capture)?;
        let mut out: Scratch<T> = g.scratch(t * h)?;
        blas::linear(g, &core, t, wd, &w.o_proj, h, &mut out, zero)?;
        Ok(out)
    }

    /// KDA between its projections: from `proj` (`[t, kda_in_width]`) to the gated,
    /// normed core output `[t, H·d]` (before `o_proj`), advancing the conv tail
    /// (`[3·H·d, K−1]`) and the recurrent state (`[H, d, d]`).
    pub(crate) fn kda_core(
        &self,
        w: &KdaW<T>,
        proj: &CudaSlice<T>,
        t: usize,
        conv_tail: &mut CudaSlice<f32>,
        rec: &mut CudaSlice<f32>,
        capture: Option<(usize, &mut Option<DensePair>)>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (nh, d) = (c.linear_v_heads, c.linear_k_dim);
        let (wd, n_in) = (kda_width(c), kda_in_width(c));
        let cd = 3 * wd;
        let kk = c.conv_kernel;
        let zero = T::from_f32(0.0);
        check_len("KDA projection [t, n_in]", proj, t * n_in)?;
        let mut mixed: Scratch<T> = g.scratch(t * cd)?;
        if t == 1 {
            ops::conv1d_update(g, proj, &w.conv, conv_tail, &mut mixed, cd, kk, true)?;
        } else {
            ops::conv1d_prefill(
                g, proj, n_in, &w.conv, conv_tail, &mut mixed, t, cd, kk, true,
            )?;
        }
        let mut q: Scratch<T> = g.scratch(t * wd)?;
        let mut k: Scratch<T> = g.scratch(t * wd)?;
        let mut v: Scratch<T> = g.scratch(t * wd)?;
        let mut fa: Scratch<T> = g.scratch(t * d)?;
        let mut ga: Scratch<T> = g.scratch(t * d)?;
        let mut beta: Scratch<f32> = g.scratch(t * nh)?;
        {
            let f = g.function(&KDA, &format!("kda_prep_{}", T::SUFFIX), 0)?;
            let (nhi, di, ni) = (dim_i32("H", nh)?, dim_i32("d", d)?, dim_i32("n_in", n_in)?);
            let scale = (d as f32).powf(-0.5);
            let eps = L2_EPS;
            let cfg = LaunchConfig {
                grid_dim: (dim_i32("t", t)? as u32, (2 * nh + 1) as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = g.stream().launch_builder(&f);
            b.arg(&mixed)
                .arg(proj)
                .arg(&mut q)
                .arg(&mut k)
                .arg(&mut v)
                .arg(&mut fa)
                .arg(&mut ga)
                .arg(&mut beta)
                .arg(&nhi)
                .arg(&di)
                .arg(&ni)
                .arg(&scale)
                .arg(&eps);
            // SAFETY: matches `kda_prep_*`; mixed: [t, 3·wd]; proj: [t, n_in] (checked)
            // with n_in = 3·wd + 2·d + nh; q, k, v: [t, wd]; fa, ga: [t, d]; beta: [t, nh].
            unsafe { b.launch(cfg) }?;
        }
        let mut fb: Scratch<T> = g.scratch(t * wd)?;
        blas::linear(g, &fa, t, d, &w.f_b, wd, &mut fb, zero)?;
        let mut gg: Scratch<f32> = g.scratch(t * wd)?;
        {
            let f = g.function(&KDA, &format!("kda_gate_{}", T::SUFFIX), 0)?;
            let n = (t * wd) as i64;
            let (wdi, di) = (dim_i32("H·d", wd)?, dim_i32("d", d)?);
            let mut b = g.stream().launch_builder(&f);
            b.arg(&fb)
                .arg(&w.neg_a)
                .arg(&w.dt_bias)
                .arg(&mut gg)
                .arg(&n)
                .arg(&wdi)
                .arg(&di);
            // SAFETY: matches `kda_gate_*`; fb, gg: [t, wd]; neg_a: [nh]; dt_bias: [wd].
            unsafe { b.launch(cfg1(t * wd)) }?;
        }
        let mut gate: Scratch<T> = g.scratch(t * wd)?;
        blas::linear(g, &ga, t, d, &w.g_b, wd, &mut gate, zero)?;
        let dims = GdrDims {
            t,
            hk: c.linear_k_heads,
            hv: nh,
            dk: d,
            dv: c.linear_v_dim,
        };
        let mut core: Scratch<T> = g.scratch(t * wd)?;
        match capture {
            None => self.kda_span(&dims, &q, &k, &v, &gg, &beta, rec, &mut core)?,
            Some((from, out)) => {
                *out = Some(self.kda_capture(&dims, from, &q, &k, &v, &gg, &beta, rec, &mut core)?);
            }
        }
        let mut normed: Scratch<T> = g.scratch(t * wd)?;
        {
            check_len("o_norm", &w.o_norm, d)?;
            let f = g.function(&KDA, &format!("kda_gated_norm_{}", T::SUFFIX), 0)?;
            let (di, eps) = (dim_i32("d", d)?, c.rms_norm_eps);
            let cfg = LaunchConfig {
                grid_dim: (dim_i32("t·H", t * nh)? as u32, 1, 1),
                block_dim: (if d <= 512 { 128 } else { 256 }, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = g.stream().launch_builder(&f);
            b.arg(&core)
                .arg(&gate)
                .arg(&w.o_norm)
                .arg(&mut normed)
                .arg(&di)
                .arg(&eps);
            // SAFETY: matches `kda_gated_norm_*`; core, gate, normed: [t·nh, d]; o_norm: [d].
            unsafe { b.launch(cfg) }?;
        }
        Ok(normed)
    }

    /// The KDA recurrence over a whole span from `rec` (advanced in place): chunked
    /// for spans of ≥ [`kda::CHUNKED_MIN_TOKENS`] tokens — on tensor cores
    /// ([`kda::chunked_tc`]) for bf16 with `dk = dv = 128` unless
    /// `HYPIC_CUDA_KDA_TC=0` ([`kda::tc_enabled`]), else the SIMT [`kda::chunked`] —
    /// and token by token below.
    #[allow(clippy::too_many_arguments)]
    fn kda_span(
        &self,
        d: &GdrDims,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        gg: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        rec: &mut CudaSlice<f32>,
        core: &mut CudaSlice<T>,
    ) -> Result<()> {
        let g = &*self.gpu;
        if d.t >= kda::CHUNKED_MIN_TOKENS && kda::tc_applies::<T>(d) && kda::tc_enabled() {
            kda::chunked_tc(g, d, q, k, v, gg, beta, rec, core)
        } else if d.t >= kda::CHUNKED_MIN_TOKENS {
            kda::chunked(g, d, q, k, v, gg, beta, rec, core, None, kda::CHUNK)
        } else {
            kda::recurrent(g, d, q, k, v, gg, beta, rec, core)
        }
    }

    /// [`GpuModel::kda_span`] split at `from` (clamped to `d.t`): the seam `0..from`
    /// from `rec`, then the body `from..` by the chunked kernel with its transition;
    /// returns the body pair `(T_body, S_end − T_body·S_from)` as the CPU
    /// `mixers::kda::layer` does.
    #[allow(clippy::too_many_arguments)]
    fn kda_capture(
        &self,
        d: &GdrDims,
        from: usize,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        gg: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        rec: &mut CudaSlice<f32>,
        core: &mut CudaSlice<T>,
    ) -> Result<DensePair> {
        let g = &*self.gpu;
        let s = g.stream();
        let (t, hk, hv, dk, dv) = (d.t, d.hk, d.hv, d.dk, d.dv);
        let from = from.min(t);
        let (qk, vv, gw) = (hk * dk, hv * dv, hv * dk);
        let part = |a: usize, b: usize| -> Result<_> {
            Ok((
                s.clone_dtod(&q.slice(a * qk..b * qk))?,
                s.clone_dtod(&k.slice(a * qk..b * qk))?,
                s.clone_dtod(&v.slice(a * vv..b * vv))?,
                s.clone_dtod(&gg.slice(a * gw..b * gw))?,
                s.clone_dtod(&beta.slice(a * hv..b * hv))?,
            ))
        };
        if from > 0 {
            let (q0, k0, v0, g0, b0) = part(0, from)?;
            let mut o0: CudaSlice<T> = g.zeros(from * vv)?;
            let d0 = GdrDims { t: from, ..*d };
            self.kda_span(&d0, &q0, &k0, &v0, &g0, &b0, rec, &mut o0)?;
            s.memcpy_dtod(&o0.slice(..from * vv), &mut core.slice_mut(..from * vv))?;
        }
        let s_from = s.clone_dtod(rec)?;
        let mut tr: CudaSlice<f32> = g.zeros(hv * dk * dk)?;
        gdr::set_identity(g, &mut tr, hv, dk)?;
        if from < t {
            let (q1, k1, v1, g1, b1) = part(from, t)?;
            let mut o1: CudaSlice<T> = g.zeros((t - from) * vv)?;
            let d1 = GdrDims { t: t - from, ..*d };
            kda::chunked(
                g,
                &d1,
                &q1,
                &k1,
                &v1,
                &g1,
                &b1,
                rec,
                &mut o1,
                Some(&mut tr),
                kda::CHUNK,
            )?;
            s.memcpy_dtod(
                &o1.slice(..(t - from) * vv),
                &mut core.slice_mut(from * vv..t * vv),
            )?;
        }
        // B = S_end − T·S_from.
        let n = hv * dk * dv;
        let mut b: CudaSlice<f32> = g.zeros(n)?;
        super::transition::batched_matmul(g, hv, dk, dv, dk, &tr, &s_from, &mut b, 0.0)?;
        super::pic::axpby(g, &mut b, rec, -1.0, 1.0, n)?;
        Ok(DensePair {
            hv,
            dk,
            dv,
            t: tr,
            b,
        })
    }

    /// MLA mixer over `r` (`[t, h]`, normed) at positions `pos` (`[t]`), appending the
    /// span's latent rows to `kv`. Returns the mixer output `[t, h]`.
    pub(crate) fn mla(
        &self,
        w: &MlaW<T>,
        r: &CudaSlice<T>,
        t: usize,
        pos: &CudaSlice<i64>,
        kv: &mut GpuKv<T>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let (h, n_in, mid) = (c.hidden_size, mla_in_width(c), mla_mid_width(c));
        let zero = T::from_f32(0.0);
        let mut proj: Scratch<T> = g.scratch(t * n_in)?;
        blas::linear(g, r, t, h, &w.w_in, n_in, &mut proj, zero)?;
        let o = self.mla_core(w, &proj, t, pos, kv)?;
        let mut out: Scratch<T> = g.scratch(t * h)?;
        blas::linear(g, &o, t, mid, &w.o, h, &mut out, zero)?;
        Ok(out)
    }

    /// MLA between its projections: from `proj` (`[t, mla_in_width]`) to the expanded
    /// attention output `[t, H·v]` (before `o_proj`), appending the span's latent rows
    /// (positions `pos`, `[t]`) to `kv` (row width `r + rope`, one KV head).
    pub(crate) fn mla_core(
        &self,
        w: &MlaW<T>,
        proj: &CudaSlice<T>,
        t: usize,
        pos: &CudaSlice<i64>,
        kv: &mut GpuKv<T>,
    ) -> Result<Scratch<T>> {
        let c = &self.config;
        let g = &*self.gpu;
        let m = c.mla;
        let nh = c.num_heads;
        let (r, rope, nope, vd) = (
            m.kv_lora_rank,
            m.qk_rope_head_dim,
            m.qk_nope_head_dim,
            m.v_head_dim,
        );
        let (row, qkd, n_in) = (m.row(), m.qk_head_dim(), mla_in_width(c));
        check_len("MLA projection [t, n_in]", proj, t * n_in)?;
        check_len("positions", pos, t)?;
        if kv.row != row {
            return Err(shape_err(format!(
                "MLA KV row width {} but the model needs {row}",
                kv.row
            )));
        }
        let mut rows: Scratch<T> = g.scratch(t * row)?;
        {
            check_len("kv_a_layernorm", &w.kv_norm, r)?;
            let f = g.function(&MLA, &format!("mla_rows_{}", T::SUFFIX), 0)?;
            let (ni, off, ri, rowi) = (
                dim_i32("n_in", n_in)?,
                dim_i32("H·qk_head_dim", nh * qkd)?,
                dim_i32("kv_lora_rank", r)?,
                dim_i32("row", row)?,
            );
            let eps = c.rms_norm_eps;
            let cfg = LaunchConfig {
                grid_dim: (dim_i32("t", t)? as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = g.stream().launch_builder(&f);
            b.arg(proj)
                .arg(&ni)
                .arg(&off)
                .arg(&w.kv_norm)
                .arg(&mut rows)
                .arg(&ri)
                .arg(&rowi)
                .arg(&eps);
            // SAFETY: matches `mla_rows_*`; proj: [t, n_in] with the kv_a columns at
            // off..off + row (n_in = off + row); rows: [t, row]; kv_norm: [r].
            unsafe { b.launch(cfg) }?;
        }
        kv.append(g, &rows, &rows, pos, t)?;
        let mut qa: Scratch<T> = g.scratch(t * nh * row)?;
        {
            let f = g.function(&MLA, &format!("mla_absorb_q_{}", T::SUFFIX), 0)?;
            let fix = ((row as f32) / (qkd as f32)).sqrt();
            let (ni, ti, nhi, nopei, ropei, ri) = (
                dim_i32("n_in", n_in)?,
                dim_i32("t", t)?,
                dim_i32("heads", nh)?,
                dim_i32("qk_nope_head_dim", nope)?,
                dim_i32("qk_rope_head_dim", rope)?,
                dim_i32("kv_lora_rank", r)?,
            );
            let mut b = g.stream().launch_builder(&f);
            b.arg(proj)
                .arg(&ni)
                .arg(&w.w_uk)
                .arg(&mut qa)
                .arg(&ti)
                .arg(&nhi)
                .arg(&nopei)
                .arg(&ropei)
                .arg(&ri)
                .arg(&fix);
            // SAFETY: matches `mla_absorb_q_*`; proj: [t, n_in] with q in its first
            // nh·qkd columns; w_uk: [nh, nope, r]; qa: [t, nh, row].
            unsafe { b.launch(cfg1(t * nh * row)) }?;
        }
        let mut lat: Scratch<T> = g.scratch(t * nh * row)?;
        attn_generic(
            g,
            &qa,
            pos,
            kv.k(),
            kv.v(),
            kv.pos(),
            &mut lat,
            t,
            kv.len(),
            nh,
            1,
            row,
        )?;
        let mut o: Scratch<T> = g.scratch(t * nh * vd)?;
        {
            let f = g.function(&MLA, &format!("mla_expand_{}", T::SUFFIX), 0)?;
            let (ti, nhi, vdi, ri, rowi) = (
                dim_i32("t", t)?,
                dim_i32("heads", nh)?,
                dim_i32("v_head_dim", vd)?,
                dim_i32("kv_lora_rank", r)?,
                dim_i32("row", row)?,
            );
            let mut b = g.stream().launch_builder(&f);
            b.arg(&lat)
                .arg(&w.w_uv)
                .arg(&mut o)
                .arg(&ti)
                .arg(&nhi)
                .arg(&vdi)
                .arg(&ri)
                .arg(&rowi);
            // SAFETY: matches `mla_expand_*`; lat: [t, nh, row]; w_uv: [nh, vd, r];
            // o: [t, nh, vd].
            unsafe { b.launch(cfg1(t * nh * vd)) }?;
        }
        Ok(o)
    }
}
