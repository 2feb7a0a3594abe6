//! The KDA recurrence token by token: the executable definition that [`super::chunk`]
//! and the PIC pairs are tested against.
use super::{check_dims, GdrDims};
use crate::mixers::gated_deltanet::for_each_head;

/// Runs KDA over `d.t` tokens from `state` (`[Hv, dk, dv]`, advanced in place).
///
/// Inputs (time-major, fp32): `q, k [T, Hk, dk]` (L2-normalised; q scaled by
/// `dk^-0.5`), `v [T, Hv, dv]`, log decays `g [T, Hv, dk]` (≤ 0), `beta [T, Hv]`.
/// Value head `h` reads key head `h / (Hv/Hk)`. Returns `o [T, Hv, dv]`.
///
/// Panics if a slice does not match `d`.
pub fn recurrent(
    d: &GdrDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
) -> Vec<f32> {
    check_dims(d, q, k, v, g, beta, state);
    let GdrDims { t, hk, hv, dk, dv } = *d;
    for_each_head(d, state, None, |h, s, _, o| {
        let kh = h / (hv / hk);
        let mut kv = vec![0f32; dv];
        for ti in 0..t {
            let qt = &q[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk];
            let kt = &k[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk];
            let vt = &v[(ti * hv + h) * dv..(ti * hv + h + 1) * dv];
            let gt = &g[(ti * hv + h) * dk..(ti * hv + h + 1) * dk];
            let b = beta[ti * hv + h];
            // S ← diag(exp g) S, then kv = Sᵀk.
            kv.iter_mut().for_each(|y| *y = 0.0);
            for a in 0..dk {
                let e = gt[a].exp();
                let row = &mut s[a * dv..(a + 1) * dv];
                row.iter_mut().for_each(|y| *y *= e);
                for (y, &z) in kv.iter_mut().zip(row.iter()) {
                    *y += kt[a] * z;
                }
            }
            // S += k (β (v − Sᵀk))ᵀ.
            for (y, &vv) in kv.iter_mut().zip(vt) {
                *y = b * (vv - *y);
            }
            for a in 0..dk {
                let ka = kt[a];
                for (y, &u) in s[a * dv..(a + 1) * dv].iter_mut().zip(&kv) {
                    *y += ka * u;
                }
            }
            // o = Sᵀq.
            let ot = &mut o[ti * dv..(ti + 1) * dv];
            for a in 0..dk {
                let qa = qt[a];
                for (y, &z) in ot.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                    *y += qa * z;
                }
            }
        }
    })
}
