//! Token-by-token Lightning attention recurrence: the executable definition of the
//! mixer (as FLA keeps `naive.py` beside `chunk.py`), the reference of
//! [`super::chunk`].
//!
//! Per head `h` with log decay `g_h = −slope_h ≤ 0` (constant over time):
//!
//! ```text
//! S_t = exp(g_h)·S_{t−1} + k_t v_tᵀ      (S ∈ R^{dk×dv})
//! o_t = scale · S_tᵀ q_t
//! ```
//!
//! Same as mlx-lm `recurrent_gla` and FLA `fused_recurrent_simple_gla` with a
//! per-head `g_gamma`. Layouts: `q`, `k` `[T, H, dk]`, `v` `[T, H, dv]`, state
//! `[H, dk, dv]` K-major, output `[T, H, dv]`; all fp32.
use super::LightningDims;

/// Runs the recurrence over `T` tokens from `state` (initial → final, in place).
/// `log_decay`: `[H]`. Returns the outputs `[T, H, dv]`.
///
/// Panics (a programming error, never input-driven: the layer sizes every slice
/// from the config) when a slice length does not match `d`.
pub fn recurrent(
    d: &LightningDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    log_decay: &[f32],
    scale: f32,
    state: &mut [f32],
) -> Vec<f32> {
    let LightningDims { t, h, dk, dv } = *d;
    d.check(q, k, v, log_decay, state);
    let mut out = vec![0f32; t * h * dv];
    for hi in 0..h {
        let decay = log_decay[hi].exp();
        let s = &mut state[hi * dk * dv..(hi + 1) * dk * dv];
        for ti in 0..t {
            let kt = &k[(ti * h + hi) * dk..(ti * h + hi + 1) * dk];
            let vt = &v[(ti * h + hi) * dv..(ti * h + hi + 1) * dv];
            let qt = &q[(ti * h + hi) * dk..(ti * h + hi + 1) * dk];
            for (i, &ki) in kt.iter().enumerate() {
                let row = &mut s[i * dv..(i + 1) * dv];
                for (sv, &vj) in row.iter_mut().zip(vt) {
                    *sv = *sv * decay + ki * vj;
                }
            }
            let o = &mut out[(ti * h + hi) * dv..(ti * h + hi + 1) * dv];
            for (i, &qi) in qt.iter().enumerate() {
                let qs = qi * scale;
                let row = &s[i * dv..(i + 1) * dv];
                for (ov, &sv) in o.iter_mut().zip(row) {
                    *ov += qs * sv;
                }
            }
        }
    }
    out
}
