//! The reference recurrence of Gated DeltaNet, token by token (as FLA keeps
//! `fla/ops/gated_delta_rule/naive.py` beside `chunk.py`): the executable definition
//! that the chunked CPU path ([`super::chunk`]) and the GPU kernels are tested
//! against. Used as-is for short spans (decode, seam windows).
//!
//! Per value head `h` with key head `h / (Hv/Hk)` (GVA), state `S ∈ R^{dk×dv}`:
//!
//! ```text
//! S ← exp(g_t) · S
//! u  = β_t · (v_t − Sᵀ k_t)
//! S ← S + k_t ⊗ u
//! o_t = Sᵀ q_t
//! ```
//!
//! Source: HF transformers `torch_recurrent_gated_delta_rule`
//! (modeling_qwen3_next.py) and FLA `fla/ops/gated_delta_rule/naive.py`.
use super::GdrDims;

/// Reference token-by-token recurrence.
///
/// * `q`, `k`: `[T, Hk, dk]` (normalised, q scaled); `v`: `[T, Hv, dv]`;
/// * `g`: `[T, Hv]` log decay (≤ 0); `beta`: `[T, Hv]` in (0, 1);
/// * `state`: `[Hv, dk, dv]` fp32, updated in place (initial → final state).
///
/// Returns the output `o`: `[T, Hv, dv]`. Panics if a slice length does not match
/// `d` (an internal invariant, checked by callers that take user input).
pub fn recurrent(
    d: &GdrDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
) -> Vec<f32> {
    d.check(q, k, v, g, beta, state);
    let GdrDims { t, hk, hv, dk, dv } = *d;
    let rep = hv / hk;
    let mut out = vec![0f32; t * hv * dv];
    let mut kv_mem = vec![0f32; dv];
    for h in 0..hv {
        let kh = h / rep;
        let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
        for ti in 0..t {
            let qt = &q[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk];
            let kt = &k[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk];
            let vt = &v[(ti * hv + h) * dv..(ti * hv + h + 1) * dv];
            let decay = g[ti * hv + h].exp();
            let b = beta[ti * hv + h];
            s.iter_mut().for_each(|x| *x *= decay);
            kv_mem.iter_mut().for_each(|x| *x = 0.0);
            for i in 0..dk {
                let ki = kt[i];
                let row = &s[i * dv..(i + 1) * dv];
                for j in 0..dv {
                    kv_mem[j] += row[j] * ki;
                }
            }
            for j in 0..dv {
                kv_mem[j] = b * (vt[j] - kv_mem[j]);
            }
            for i in 0..dk {
                let ki = kt[i];
                let row = &mut s[i * dv..(i + 1) * dv];
                for j in 0..dv {
                    row[j] += ki * kv_mem[j];
                }
            }
            let o = &mut out[(ti * hv + h) * dv..(ti * hv + h + 1) * dv];
            for i in 0..dk {
                let qi = qt[i];
                let row = &s[i * dv..(i + 1) * dv];
                for j in 0..dv {
                    o[j] += row[j] * qi;
                }
            }
        }
    }
    out
}
