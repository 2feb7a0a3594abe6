//! Transition families for position-independent caching (docs/pic-design.md §2;
//! issue 3 item 1).
//!
//! Every supported linear-attention layer is the recurrence (paper Eq. 2)
//!
//! ```text
//! S_t = T_t S_{t−1} + u_t,   o_t = S_tᵀ q_t,   S ∈ R^{dk×dv} per value head
//! ```
//!
//! | [`Family`]     | `T_t`                               | `u_t`          | `g` layout     |
//! |----------------|-------------------------------------|----------------|----------------|
//! | `Scalar`       | `exp(g_t)·I`                        | `k_t v_tᵀ`     | `[T, Hv]`      |
//! | `Diagonal`     | `diag(exp(g_t))`, `g_t ∈ R^{dk}`    | `k_t v_tᵀ`     | `[T, Hv, dk]`  |
//! | `GatedDelta`   | `exp(g_t)(I − β_t k_t k_tᵀ)`        | `β_t k_t v_tᵀ` | `[T, Hv]`      |
//! | `KimiDelta`    | `(I − β_t k_t k_tᵀ) diag(exp(g_t))` | `β_t k_t v_tᵀ` | `[T, Hv, dk]`  |
//!
//! (Scalar: RetNet, Lightning / Ring-linear with constant `g = ln γ`, Mamba2;
//! diagonal: GLA; dense: Gated DeltaNet in Qwen3-Next/Qwen3.5 and Kimi Delta
//! Attention, docs/pic-design.md §8.4 and §9.2.)
//!
//! A segment `C` of `m` tokens is summarised by the [`Pair`] `(T_C, S_{C|0})` with
//! `T_C = T_m ··· T_1` and `S_{C|0}` the final state from a zero start, so that
//! running the segment from any state `S` gives `T_C S + S_{C|0}` ([`Pair::apply`]).
//! Pairs form a monoid ([`Pair::compose`]):
//! `(T_B, B_B) ∘ (T_A, B_A) = (T_B T_A, T_B B_A + B_B)`.
//! `T_C` is one scalar (scalar family), a `[dk]` vector (diagonal) or a `[dk, dk]`
//! matrix (dense) per value head; `S_{C|0}` is `[Hv, dk, dv]`. Both are fp32.
//!
//! Building (`Family::build`) costs no second pass: scalar/diagonal `T_C` is the
//! exponential of summed log decays; GDN's comes out of the chunked WY kernel
//! ([`gdr::chunked_with_transition`]); KDA's is updated inside the token loop here
//! (`3·dk²` flops per token), an independent check of the chunked KDA kernel that
//! the CPU model uses (`mixers::kda::chunk::chunked_with_transition`).
//!
//! Entries of `T` below 2⁻⁴⁰ ≈ 9.1e-13 (its natural scale is 1: ‖T‖₂ ≤ 1) and of
//! `S` below 1e-30 are flushed to exactly zero (built pairs, compositions, the
//! token loops and the chunked kernel), so a fully decayed `T_C` is exactly 0 and
//! never drives arithmetic into the slow underflow range; a zero dense `T` head is
//! skipped by [`Pair::compose`] and [`Pair::apply`].
//!
//! All public functions validate their inputs and return [`TransitionError`]
//! instead of panicking.
use rayon::prelude::*;

use crate::mixers::gated_deltanet::{
    self as gdr, flush, flush_all, matmul, GdrDims, FLUSH_STATE, FLUSH_UNIT,
};

/// Errors of the transition API (shape or family mismatches). Never panics instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// Head counts or the chunk size are invalid.
    #[error("invalid dimensions: {0}")]
    Dims(String),
    /// An input slice has the wrong number of elements.
    #[error("`{name}` has {got} elements, expected {expected}")]
    Shape {
        /// Which input.
        name: &'static str,
        /// Elements implied by the dimensions.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// `beta` is missing for a delta-rule family or given to a non-delta family.
    #[error("family {family:?} {}", if *.needs_beta { "requires beta [T, Hv]" } else { "takes no beta" })]
    Beta {
        /// The family.
        family: Family,
        /// Whether that family needs `beta`.
        needs_beta: bool,
    },
    /// Two pairs of different transition kinds were combined.
    #[error("cannot combine a {0:?} transition with a {1:?} one")]
    KindMismatch(TransitionKind, TransitionKind),
    /// Two pairs (or a pair and a state) of different `(Hv, dk, dv)`.
    #[error("dimension mismatch: (Hv, dk, dv) = {0:?} vs {1:?}")]
    PairDims((usize, usize, usize), (usize, usize, usize)),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, TransitionError>;

/// A linear-attention family (see the module table for `T_t`, `u_t` and layouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `T_t = exp(g_t)·I` per value head, `g: [T, Hv]`, no `beta`.
    Scalar,
    /// `T_t = diag(exp(g_t))`, `g: [T, Hv, dk]`, no `beta`.
    Diagonal,
    /// Gated DeltaNet: `T_t = exp(g_t)(I − β_t k_t k_tᵀ)`, `g, beta: [T, Hv]`.
    GatedDelta,
    /// Kimi Delta Attention: `T_t = (I − β_t k_t k_tᵀ) diag(exp(g_t))`,
    /// `g: [T, Hv, dk]`, `beta: [T, Hv]`.
    KimiDelta,
}

/// Storage form of a segment transition `T_C` (per value head).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransitionKind {
    /// One scalar per head: `T` is `[Hv]`.
    Scalar,
    /// A diagonal per head: `T` is `[Hv, dk]`.
    Diagonal,
    /// A dense matrix per head: `T` is `[Hv, dk, dk]` row-major (`T[h][i][j]`
    /// multiplies state row `j` into row `i`).
    Dense,
}

impl TransitionKind {
    /// Elements of `T` for `hv` heads of key dim `dk`.
    pub fn t_len(self, hv: usize, dk: usize) -> usize {
        match self {
            TransitionKind::Scalar => hv,
            TransitionKind::Diagonal => hv * dk,
            TransitionKind::Dense => hv * dk * dk,
        }
    }
}

/// One layer's per-token inputs over a segment (time-major, fp32, as in
/// [`gdr::recurrent`]).
#[derive(Clone, Copy, Debug)]
pub struct LinearInputs<'a> {
    /// Queries `[T, Hk, dk]` (normalised and scaled as the layer requires).
    pub q: &'a [f32],
    /// Keys `[T, Hk, dk]` (L2-normalised for the delta families).
    pub k: &'a [f32],
    /// Values `[T, Hv, dv]`.
    pub v: &'a [f32],
    /// Log decays (≤ 0): `[T, Hv]` (Scalar, GatedDelta) or `[T, Hv, dk]`
    /// (Diagonal, KimiDelta).
    pub g: &'a [f32],
    /// Write strengths `[T, Hv]` in (0, 1) for the delta families; `None` otherwise.
    pub beta: Option<&'a [f32]>,
}

/// A built segment: its layer outputs from a zero start and its cached pair.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    /// Outputs `o_t = S_tᵀ q_t` from `S₀ = 0`: `[T, Hv, dv]`.
    pub out: Vec<f32>,
    /// The pair `(T_C, S_{C|0})`.
    pub pair: Pair,
}

impl Family {
    /// The storage form of this family's transitions.
    pub fn kind(self) -> TransitionKind {
        match self {
            Family::Scalar => TransitionKind::Scalar,
            Family::Diagonal => TransitionKind::Diagonal,
            Family::GatedDelta | Family::KimiDelta => TransitionKind::Dense,
        }
    }

    fn per_channel_decay(self) -> bool {
        matches!(self, Family::Diagonal | Family::KimiDelta)
    }

    fn delta(self) -> bool {
        matches!(self, Family::GatedDelta | Family::KimiDelta)
    }

    /// Checks every length and dimension of `x` against `d`.
    pub fn validate(self, d: &GdrDims, x: &LinearInputs) -> Result<()> {
        if d.hk == 0 || !d.hv.is_multiple_of(d.hk) {
            return Err(TransitionError::Dims(format!(
                "Hv = {} must be a nonzero multiple of Hk = {}",
                d.hv, d.hk
            )));
        }
        let shape = |name, expected, got| {
            if expected == got {
                Ok(())
            } else {
                Err(TransitionError::Shape {
                    name,
                    expected,
                    got,
                })
            }
        };
        shape("q [T, Hk, dk]", d.t * d.hk * d.dk, x.q.len())?;
        shape("k [T, Hk, dk]", d.t * d.hk * d.dk, x.k.len())?;
        shape("v [T, Hv, dv]", d.t * d.hv * d.dv, x.v.len())?;
        let g_len = if self.per_channel_decay() {
            d.t * d.hv * d.dk
        } else {
            d.t * d.hv
        };
        shape("g", g_len, x.g.len())?;
        match (self.delta(), x.beta) {
            (true, Some(b)) => shape("beta [T, Hv]", d.t * d.hv, b.len()),
            (false, None) => Ok(()),
            (needs_beta, _) => Err(TransitionError::Beta {
                family: self,
                needs_beta,
            }),
        }
    }

    /// Token-by-token reference recurrence of this family (fp32).
    ///
    /// `state`: `[Hv, dk, dv]`, initial → final in place. Returns `o`: `[T, Hv, dv]`.
    /// `GatedDelta` runs [`gdr::recurrent`].
    pub fn recurrent(self, d: &GdrDims, x: &LinearInputs, state: &mut [f32]) -> Result<Vec<f32>> {
        self.validate(d, x)?;
        check_state(d, state)?;
        if let (Family::GatedDelta, Some(beta)) = (self, x.beta) {
            return Ok(gdr::recurrent(d, x.q, x.k, x.v, x.g, beta, state));
        }
        Ok(gdr::for_each_head(d, state, None, |h, s, tr, o| {
            token_loop(self, d, x, h, s, tr, o)
        }))
    }

    /// Builds a segment: outputs from a zero state and the pair `(T_C, S_{C|0})`.
    ///
    /// `chunk` is the chunk length of the GDN kernel ([`gdr::DEFAULT_CHUNK`] = 64;
    /// must be > 0; ignored by the other families). `T_C` comes from the same pass
    /// that computes `S_{C|0}` (see the module doc).
    pub fn build(self, d: &GdrDims, x: &LinearInputs, chunk: usize) -> Result<Segment> {
        self.validate(d, x)?;
        if chunk == 0 {
            return Err(TransitionError::Dims("chunk must be > 0".into()));
        }
        let GdrDims { t, hv, dk, dv, .. } = *d;
        let mut b = vec![0f32; hv * dk * dv];
        let kind = self.kind();
        let (out, tm) = match self {
            Family::GatedDelta => {
                let beta = x.beta.unwrap_or_default();
                gdr::chunked_with_transition(d, x.q, x.k, x.v, x.g, beta, &mut b, chunk)
            }
            Family::KimiDelta => {
                let mut tm = Pair::identity(kind, hv, dk, dv).t;
                let out = gdr::for_each_head(d, &mut b, Some(&mut tm), |h, s, tr, o| {
                    token_loop(self, d, x, h, s, tr, o)
                });
                (out, tm)
            }
            Family::Scalar | Family::Diagonal => {
                let out = gdr::for_each_head(d, &mut b, None, |h, s, tr, o| {
                    token_loop(self, d, x, h, s, tr, o)
                });
                // T_C = exp(Σ_t g_t), summed in f64.
                let width = if self == Family::Diagonal { dk } else { 1 };
                let mut acc = vec![0f64; hv * width];
                for ti in 0..t {
                    for (a, &gv) in acc
                        .iter_mut()
                        .zip(&x.g[ti * hv * width..(ti + 1) * hv * width])
                    {
                        *a += gv as f64;
                    }
                }
                (
                    out,
                    acc.iter()
                        .map(|&a| flush(a.exp() as f32, FLUSH_UNIT))
                        .collect(),
                )
            }
        };
        let mut tm = tm;
        flush_all(&mut tm, FLUSH_UNIT);
        flush_all(&mut b, FLUSH_STATE);
        Ok(Segment {
            out,
            pair: Pair {
                kind,
                hv,
                dk,
                dv,
                t: tm,
                b,
            },
        })
    }
}

fn check_state(d: &GdrDims, state: &[f32]) -> Result<()> {
    if state.len() != d.state_len() {
        return Err(TransitionError::Shape {
            name: "state [Hv, dk, dv]",
            expected: d.state_len(),
            got: state.len(),
        });
    }
    Ok(())
}

/// One value head, token by token: state `s` `[dk, dv]`, optional dense transition
/// `tr` `[dk, dk]` updated as `T ← T_t T`, outputs into `out_h` `[T, dv]`.
fn token_loop(
    fam: Family,
    d: &GdrDims,
    x: &LinearInputs,
    h: usize,
    s: &mut [f32],
    mut tr: Option<&mut [f32]>,
    out_h: &mut [f32],
) {
    let GdrDims { t, hk, hv, dk, dv } = *d;
    let kh = h / (hv / hk);
    let mut u = vec![0f32; dv];
    let mut w = vec![0f32; dk];
    let mut kv = vec![0f32; dv];
    for ti in 0..t {
        let qt = &x.q[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk];
        let kt = &x.k[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk];
        let vt = &x.v[(ti * hv + h) * dv..(ti * hv + h + 1) * dv];
        // Decay: S ← diag(α) S with α scalar or per key channel (also T ← diag(α) T).
        let decay = |a: usize| -> f32 {
            if fam.per_channel_decay() {
                x.g[(ti * hv + h) * dk + a].exp()
            } else {
                x.g[ti * hv + h].exp()
            }
        };
        for a in 0..dk {
            let e = decay(a);
            s[a * dv..(a + 1) * dv]
                .iter_mut()
                .for_each(|y| *y = flush(*y * e, FLUSH_STATE));
            if let Some(tr) = tr.as_deref_mut() {
                tr[a * dk..(a + 1) * dk]
                    .iter_mut()
                    .for_each(|y| *y = flush(*y * e, FLUSH_UNIT));
            }
        }
        // Write: u = v (scalar/diagonal) or u = β(v − Sᵀk) (delta); S += k uᵀ.
        u.copy_from_slice(vt);
        if fam.delta() {
            let b = x.beta.map_or(0.0, |bb| bb[ti * hv + h]);
            kv.iter_mut().for_each(|y| *y = 0.0);
            for a in 0..dk {
                let ka = kt[a];
                for (y, &z) in kv.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                    *y += ka * z;
                }
            }
            for (y, &z) in u.iter_mut().zip(&kv) {
                *y = b * (*y - z);
            }
            if let Some(tr) = tr.as_deref_mut() {
                // T ← (I − β k kᵀ) T.
                w.iter_mut().for_each(|y| *y = 0.0);
                for a in 0..dk {
                    let ka = kt[a];
                    for (y, &z) in w.iter_mut().zip(&tr[a * dk..(a + 1) * dk]) {
                        *y += ka * z;
                    }
                }
                for a in 0..dk {
                    let c = b * kt[a];
                    for (y, &z) in tr[a * dk..(a + 1) * dk].iter_mut().zip(&w) {
                        *y -= c * z;
                    }
                }
            }
        }
        for a in 0..dk {
            let ka = kt[a];
            for (y, &z) in s[a * dv..(a + 1) * dv].iter_mut().zip(&u) {
                *y += ka * z;
            }
        }
        let o = &mut out_h[ti * dv..(ti + 1) * dv];
        for a in 0..dk {
            let qa = qt[a];
            for (y, &z) in o.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                *y += qa * z;
            }
        }
    }
}

/// A cached segment transition `(T_C, S_{C|0})` for one layer (docs/pic-design.md §2.2).
///
/// * `t`: `[Hv]` (scalar), `[Hv, dk]` (diagonal) or `[Hv, dk, dk]` (dense, row-major);
/// * `b` (= `S_{C|0}`): `[Hv, dk, dv]` K-major, like the recurrent state.
///
/// Both fp32. Fields are private so that lengths always match the dimensions; use
/// [`Pair::from_parts`] to rebuild one from storage.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    kind: TransitionKind,
    hv: usize,
    dk: usize,
    dv: usize,
    t: Vec<f32>,
    b: Vec<f32>,
}

impl Pair {
    /// The monoid identity (an empty segment): `T = I`, `B = 0`.
    pub fn identity(kind: TransitionKind, hv: usize, dk: usize, dv: usize) -> Pair {
        let t = match kind {
            TransitionKind::Scalar | TransitionKind::Diagonal => vec![1f32; kind.t_len(hv, dk)],
            TransitionKind::Dense => {
                let mut t = vec![0f32; hv * dk * dk];
                for h in 0..hv {
                    for i in 0..dk {
                        t[h * dk * dk + i * dk + i] = 1.0;
                    }
                }
                t
            }
        };
        Pair {
            kind,
            hv,
            dk,
            dv,
            t,
            b: vec![0f32; hv * dk * dv],
        }
    }

    /// Rebuilds a pair from its parts (e.g. read back from a cache tier); checks the
    /// lengths (`t`: `kind.t_len(hv, dk)`, `b`: `hv·dk·dv`).
    pub fn from_parts(
        kind: TransitionKind,
        hv: usize,
        dk: usize,
        dv: usize,
        t: Vec<f32>,
        b: Vec<f32>,
    ) -> Result<Pair> {
        if t.len() != kind.t_len(hv, dk) {
            return Err(TransitionError::Shape {
                name: "T",
                expected: kind.t_len(hv, dk),
                got: t.len(),
            });
        }
        if b.len() != hv * dk * dv {
            return Err(TransitionError::Shape {
                name: "S_C|0 [Hv, dk, dv]",
                expected: hv * dk * dv,
                got: b.len(),
            });
        }
        Ok(Pair {
            kind,
            hv,
            dk,
            dv,
            t,
            b,
        })
    }

    /// Storage form of `T`.
    pub fn kind(&self) -> TransitionKind {
        self.kind
    }

    /// `(Hv, dk, dv)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        (self.hv, self.dk, self.dv)
    }

    /// `T_C` (layout in the type doc).
    pub fn t(&self) -> &[f32] {
        &self.t
    }

    /// `S_{C|0}`: `[Hv, dk, dv]`.
    pub fn b(&self) -> &[f32] {
        &self.b
    }

    /// `(T_C, S_{C|0})` by value.
    pub fn into_parts(self) -> (Vec<f32>, Vec<f32>) {
        (self.t, self.b)
    }

    /// Bytes of the pair's payload (`4·(len T + len S_{C|0})`): per head with
    /// dk = dv = 128, 4 B (scalar) / 512 B (diagonal) / 64 KiB (dense) for `T` plus
    /// 64 KiB for `S_{C|0}`.
    pub fn bytes(&self) -> usize {
        4 * (self.t.len() + self.b.len())
    }

    fn same_shape(&self, other: &Pair) -> Result<()> {
        if self.kind != other.kind {
            return Err(TransitionError::KindMismatch(self.kind, other.kind));
        }
        if self.dims() != other.dims() {
            return Err(TransitionError::PairDims(self.dims(), other.dims()));
        }
        Ok(())
    }

    /// `self ∘ earlier`: the pair of segment `earlier` followed by segment `self`,
    /// `(T_B, B_B) ∘ (T_A, B_A) = (T_B T_A, T_B B_A + B_B)` with `self = B`.
    /// Associative, not commutative; [`Pair::identity`] is neutral.
    pub fn compose(&self, earlier: &Pair) -> Result<Pair> {
        self.same_shape(earlier)?;
        let mut b = earlier.b.clone();
        self.apply_unchecked(&mut b);
        let (hv, dk) = (self.hv, self.dk);
        let t = match self.kind {
            TransitionKind::Scalar | TransitionKind::Diagonal => self
                .t
                .iter()
                .zip(&earlier.t)
                .map(|(&x, &y)| flush(x * y, FLUSH_UNIT))
                .collect(),
            TransitionKind::Dense => {
                let mut t = vec![0f32; hv * dk * dk];
                if dk > 0 {
                    t.par_chunks_mut(dk * dk)
                        .zip(
                            self.t
                                .par_chunks(dk * dk)
                                .zip(earlier.t.par_chunks(dk * dk)),
                        )
                        .for_each(|(dst, (tb, ta))| {
                            // A fully decayed factor makes the product exactly 0.
                            if tb.iter().any(|&x| x != 0.0) && ta.iter().any(|&x| x != 0.0) {
                                matmul(dk, dk, dk, dst, dk, tb, dk, 1, ta, dk, 1, 0.0, 1.0);
                                flush_all(dst, FLUSH_UNIT);
                            }
                        });
                }
                t
            }
        };
        Ok(Pair {
            kind: self.kind,
            hv,
            dk,
            dv: self.dv,
            t,
            b,
        })
    }

    /// `earlier.then(later) = later ∘ earlier` (reads in token order).
    pub fn then(&self, later: &Pair) -> Result<Pair> {
        later.compose(self)
    }

    /// Runs the cached segment from a running state: `S ← T_C S + S_{C|0}`.
    /// `state`: `[Hv, dk, dv]`.
    pub fn apply(&self, state: &mut [f32]) -> Result<()> {
        self.check_state(state)?;
        self.apply_unchecked(state);
        Ok(())
    }

    /// Naive addition `S ← S + S_{C|0}` (the structurally wrong baseline: its error is
    /// `(T_C − I) S`). `state`: `[Hv, dk, dv]`.
    pub fn apply_naive(&self, state: &mut [f32]) -> Result<()> {
        self.check_state(state)?;
        state.iter_mut().zip(&self.b).for_each(|(s, &b)| *s += b);
        Ok(())
    }

    fn check_state(&self, state: &[f32]) -> Result<()> {
        let n = self.hv * self.dk * self.dv;
        if state.len() != n {
            return Err(TransitionError::Shape {
                name: "state [Hv, dk, dv]",
                expected: n,
                got: state.len(),
            });
        }
        Ok(())
    }

    /// `S ← T S + B` with `state.len() == hv·dk·dv` already checked.
    fn apply_unchecked(&self, state: &mut [f32]) {
        let (dk, dv) = (self.dk, self.dv);
        if dk * dv == 0 {
            return;
        }
        state
            .par_chunks_mut(dk * dv)
            .zip(self.b.par_chunks(dk * dv))
            .enumerate()
            .for_each(|(h, (s, b))| match self.kind {
                TransitionKind::Scalar => {
                    let a = self.t[h];
                    s.iter_mut().zip(b).for_each(|(x, &y)| *x = a * *x + y);
                }
                TransitionKind::Diagonal => {
                    for i in 0..dk {
                        let a = self.t[h * dk + i];
                        s[i * dv..(i + 1) * dv]
                            .iter_mut()
                            .zip(&b[i * dv..(i + 1) * dv])
                            .for_each(|(x, &y)| *x = a * *x + y);
                    }
                }
                TransitionKind::Dense => {
                    let th = &self.t[h * dk * dk..(h + 1) * dk * dk];
                    if th.iter().all(|&x| x == 0.0) {
                        s.copy_from_slice(b);
                    } else {
                        let prev = s.to_vec();
                        s.copy_from_slice(b);
                        matmul(dk, dv, dk, s, dv, th, dk, 1, &prev, dv, 1, 1.0, 1.0);
                    }
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::testutil::{norm_ratio, rel, rel64, rng, uniform, unit_rows};

    const FAMILIES: [Family; 4] = [
        Family::Scalar,
        Family::Diagonal,
        Family::GatedDelta,
        Family::KimiDelta,
    ];

    /// Owned random inputs for one family: q, k L2-normalised (q scaled by dk^-0.5),
    /// v in [-1, 1), g in [g_lo, 0], β in (0, 1) for the delta families.
    struct Case {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Option<Vec<f32>>,
    }

    impl Case {
        fn random(fam: Family, d: &GdrDims, g_lo: f32, seed: u64) -> Case {
            let mut r = rng(seed);
            let q = unit_rows(&mut r, d.t * d.hk, d.dk, (d.dk as f32).powf(-0.5));
            let k = unit_rows(&mut r, d.t * d.hk, d.dk, 1.0);
            let v = uniform(&mut r, d.t * d.hv * d.dv, -1.0, 1.0);
            let gn = if fam.per_channel_decay() {
                d.t * d.hv * d.dk
            } else {
                d.t * d.hv
            };
            let g = uniform(&mut r, gn, g_lo, 0.0);
            let beta = fam.delta().then(|| uniform(&mut r, d.t * d.hv, 1e-3, 1.0));
            Case { q, k, v, g, beta }
        }
        fn inputs(&self) -> LinearInputs<'_> {
            LinearInputs {
                q: &self.q,
                k: &self.k,
                v: &self.v,
                g: &self.g,
                beta: self.beta.as_deref(),
            }
        }
        /// Tokens `[a, b)` as a new case.
        fn slice(&self, d: &GdrDims, a: usize, b: usize) -> Case {
            let gw = self.g.len() / d.t.max(1);
            Case {
                q: self.q[a * d.hk * d.dk..b * d.hk * d.dk].to_vec(),
                k: self.k[a * d.hk * d.dk..b * d.hk * d.dk].to_vec(),
                v: self.v[a * d.hv * d.dv..b * d.hv * d.dv].to_vec(),
                g: self.g[a * gw..b * gw].to_vec(),
                beta: self.beta.as_ref().map(|bb| bb[a * d.hv..b * d.hv].to_vec()),
            }
        }
    }

    /// f64 per-token reference of any family from `s0`: returns (final state
    /// `[Hv, dk, dv]`, outputs `[T, Hv, dv]`) and, if `with_t`, the dense product
    /// `T_T ··· T_1` `[Hv, dk, dk]`.
    fn reference(
        fam: Family,
        d: &GdrDims,
        c: &Case,
        s0: &[f32],
        with_t: bool,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let GdrDims { t, hk, hv, dk, dv } = *d;
        let rep = hv / hk;
        let mut st: Vec<f64> = s0.iter().map(|&x| x as f64).collect();
        let mut out = vec![0f64; t * hv * dv];
        let mut tt = vec![0f64; if with_t { hv * dk * dk } else { 0 }];
        for h in 0..hv {
            let kh = h / rep;
            let s = &mut st[h * dk * dv..(h + 1) * dk * dv];
            let mut tm = vec![0f64; if with_t { dk * dk } else { 0 }];
            for i in 0..if with_t { dk } else { 0 } {
                tm[i * dk + i] = 1.0;
            }
            for ti in 0..t {
                let kt: Vec<f64> = c.k[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                let qt: Vec<f64> = c.q[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                let alpha: Vec<f64> = (0..dk)
                    .map(|a| {
                        let gi = if fam.per_channel_decay() {
                            (ti * hv + h) * dk + a
                        } else {
                            ti * hv + h
                        };
                        (c.g[gi] as f64).exp()
                    })
                    .collect();
                let b = c.beta.as_ref().map_or(1.0, |bb| bb[ti * hv + h] as f64);
                // Decay rows, then (I − β k kᵀ) for the delta families, then the write.
                for (mat, w) in [(&mut *s, dv), (&mut tm, dk)] {
                    if mat.is_empty() {
                        continue;
                    }
                    for a in 0..dk {
                        mat[a * w..(a + 1) * w]
                            .iter_mut()
                            .for_each(|y| *y *= alpha[a]);
                    }
                    if fam.delta() {
                        let mut kx = vec![0f64; w];
                        for a in 0..dk {
                            for j in 0..w {
                                kx[j] += kt[a] * mat[a * w + j];
                            }
                        }
                        for a in 0..dk {
                            for j in 0..w {
                                mat[a * w + j] -= b * kt[a] * kx[j];
                            }
                        }
                    }
                }
                for a in 0..dk {
                    for j in 0..dv {
                        let vj = c.v[(ti * hv + h) * dv + j] as f64;
                        s[a * dv + j] += if fam.delta() { b } else { 1.0 } * kt[a] * vj;
                    }
                }
                for j in 0..dv {
                    out[(ti * hv + h) * dv + j] = (0..dk).map(|a| qt[a] * s[a * dv + j]).sum();
                }
            }
            if with_t {
                tt[h * dk * dk..(h + 1) * dk * dk].copy_from_slice(&tm);
            }
        }
        (st, out, tt)
    }

    /// A pair's `T` expanded to dense `[Hv, dk, dk]` f64.
    fn dense_t(p: &Pair) -> Vec<f64> {
        let (hv, dk, _) = p.dims();
        let mut out = vec![0f64; hv * dk * dk];
        for h in 0..hv {
            for i in 0..dk {
                for j in 0..dk {
                    out[h * dk * dk + i * dk + j] = match p.kind() {
                        TransitionKind::Scalar => (i == j) as u8 as f64 * p.t()[h] as f64,
                        TransitionKind::Diagonal => {
                            (i == j) as u8 as f64 * p.t()[h * dk + i] as f64
                        }
                        TransitionKind::Dense => p.t()[h * dk * dk + i * dk + j] as f64,
                    };
                }
            }
        }
        out
    }

    fn dims(t: usize) -> GdrDims {
        GdrDims {
            t,
            hk: 2,
            hv: 4,
            dk: 32,
            dv: 24,
        }
    }

    /// Builds the pairs of consecutive segments of lengths `lens` of one case.
    fn segment_pairs(
        fam: Family,
        d: &GdrDims,
        c: &Case,
        lens: &[usize],
        chunk: usize,
    ) -> Vec<Pair> {
        let mut a = 0;
        lens.iter()
            .map(|&n| {
                let ds = GdrDims { t: n, ..*d };
                let seg = c.slice(d, a, a + n);
                a += n;
                fam.build(&ds, &seg.inputs(), chunk).unwrap().pair
            })
            .collect()
    }

    #[test]
    fn built_pairs_match_definitions() {
        // T_C = product of per-token T_t; S_C|0 = run from 0; outputs = run from 0.
        for fam in FAMILIES {
            for &(t, g_lo) in &[(1usize, -2.0f32), (70, -0.3), (150, -0.05)] {
                let d = dims(t);
                let c = Case::random(fam, &d, g_lo, 11 + t as u64);
                let seg = fam.build(&d, &c.inputs(), 32).unwrap();
                let (s_ref, o_ref, t_ref) =
                    reference(fam, &d, &c, &vec![0f32; d.state_len()], true);
                let et = rel64(
                    &dense_t(&seg.pair)
                        .iter()
                        .map(|&x| x as f32)
                        .collect::<Vec<_>>(),
                    &t_ref,
                );
                let eb = rel64(seg.pair.b(), &s_ref);
                let eo = rel64(&seg.out, &o_ref);
                assert!(
                    et <= 1e-5 && eb <= 1e-5 && eo <= 1e-5,
                    "{fam:?} T={t}: T {et:e} B {eb:e} out {eo:e}"
                );
                assert_eq!(seg.pair.kind(), fam.kind());
                // Family::recurrent from zero gives the same outputs and state.
                let mut s = vec![0f32; d.state_len()];
                let o = fam.recurrent(&d, &c.inputs(), &mut s).unwrap();
                assert!(
                    rel(&o, &seg.out) <= 1e-5 && rel(&s, seg.pair.b()) <= 1e-5,
                    "{fam:?} T={t}: recurrent"
                );
            }
        }
    }

    #[test]
    fn composed_pairs_match_concatenated_recurrence() {
        let lens = [37usize, 69, 100];
        for fam in FAMILIES {
            for &g_lo in &[-0.02f32, -2.0] {
                for &chunk in &[16usize, 64] {
                    let d = dims(lens.iter().sum());
                    let c = Case::random(fam, &d, g_lo, 21);
                    let s0 = uniform(&mut rng(22), d.state_len(), -1.0, 1.0);
                    let pairs = segment_pairs(fam, &d, &c, &lens, chunk);
                    let composed = pairs[0].then(&pairs[1]).unwrap().then(&pairs[2]).unwrap();
                    // Applying the composed pair == the recurrence over the concatenation.
                    let mut s = s0.clone();
                    composed.apply(&mut s).unwrap();
                    let (s_ref, _, _) = reference(fam, &d, &c, &s0, false);
                    let e = rel64(&s, &s_ref);
                    eprintln!(
                        "{fam:?} g_lo={g_lo} chunk={chunk}: composed vs f64 recurrence {e:.2e}"
                    );
                    assert!(
                        e <= 1e-5,
                        "{fam:?} g_lo={g_lo} chunk={chunk}: composed vs f64 recurrence {e:e}"
                    );
                    let mut s32 = s0.clone();
                    fam.recurrent(&d, &c.inputs(), &mut s32).unwrap();
                    let e32 = rel(&s, &s32);
                    assert!(
                        e32 <= 1e-5,
                        "{fam:?} g_lo={g_lo}: composed vs fp32 recurrence {e32:e}"
                    );
                    // Applying the pairs one after another gives the same state.
                    let mut s_seq = s0.clone();
                    for p in &pairs {
                        p.apply(&mut s_seq).unwrap();
                    }
                    assert!(rel(&s_seq, &s) <= 1e-5);
                    // The composed pair equals the pair built over the concatenation.
                    let whole = fam.build(&d, &c.inputs(), chunk).unwrap().pair;
                    let et = rel(composed.t(), whole.t());
                    let eb = rel(composed.b(), whole.b());
                    assert!(
                        et <= 1e-5 && eb <= 1e-5,
                        "{fam:?} g_lo={g_lo}: composed vs whole T {et:e} B {eb:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn composed_dense_pairs_at_dk128_and_long_segments() {
        // GDN at the Qwen3-Next head size over 1792 tokens in three segments.
        let lens = [256usize, 512, 1024];
        let d = GdrDims {
            t: lens.iter().sum(),
            hk: 1,
            hv: 2,
            dk: 128,
            dv: 128,
        };
        for &g_lo in &[-0.01f32, -2.0] {
            let fam = Family::GatedDelta;
            let c = Case::random(fam, &d, g_lo, 31);
            let s0 = uniform(&mut rng(32), d.state_len(), -1.0, 1.0);
            let pairs = segment_pairs(fam, &d, &c, &lens, 64);
            let composed = pairs[0].then(&pairs[1]).unwrap().then(&pairs[2]).unwrap();
            let mut s = s0.clone();
            composed.apply(&mut s).unwrap();
            let (s_ref, _, _) = reference(fam, &d, &c, &s0, false);
            let e = rel64(&s, &s_ref);
            eprintln!(
                "GDN dk=dv=128, T=256+512+1024, g_lo={g_lo}: composed vs f64 recurrence {e:.2e}"
            );
            assert!(e <= 1e-5, "g_lo={g_lo}: {e:e}");
        }
    }

    #[test]
    fn composition_is_associative_and_identity_is_neutral() {
        let lens = [20usize, 33, 47];
        for fam in FAMILIES {
            let d = dims(lens.iter().sum());
            let c = Case::random(fam, &d, -0.05, 41);
            let p = segment_pairs(fam, &d, &c, &lens, 16);
            let left = p[2].compose(&p[1]).unwrap().compose(&p[0]).unwrap();
            let right = p[2].compose(&p[1].compose(&p[0]).unwrap()).unwrap();
            let (et, eb) = (rel(left.t(), right.t()), rel(left.b(), right.b()));
            assert!(et <= 1e-6 && eb <= 1e-6, "{fam:?}: T {et:e} B {eb:e}");
            // Not commutative (dense and with nonzero B).
            let swapped = p[0].compose(&p[1]).unwrap();
            assert!(
                rel(swapped.b(), p[1].compose(&p[0]).unwrap().b()) > 1e-3,
                "{fam:?}"
            );
            // Identity on either side is exact.
            let id = Pair::identity(fam.kind(), 4, 32, 24);
            assert_eq!(p[1].compose(&id).unwrap(), p[1]);
            assert_eq!(id.compose(&p[1]).unwrap(), p[1]);
        }
    }

    #[test]
    fn naive_addition_error_is_t_minus_identity_times_s() {
        for fam in FAMILIES {
            let d = dims(90);
            let c = Case::random(fam, &d, -0.02, 51);
            let pair = fam.build(&d, &c.inputs(), 64).unwrap().pair;
            let s0 = uniform(&mut rng(52), d.state_len(), -1.0, 1.0);
            let mut exact = s0.clone();
            pair.apply(&mut exact).unwrap();
            let mut naive = s0.clone();
            pair.apply_naive(&mut naive).unwrap();
            // exact − naive = (T_C − I) S, computed in f64 from the stored T_C.
            let t = dense_t(&pair);
            let mut expect = vec![0f64; d.state_len()];
            for h in 0..4 {
                for i in 0..32 {
                    for j in 0..24 {
                        let ts: f64 = (0..32)
                            .map(|m| t[h * 1024 + i * 32 + m] * s0[h * 768 + m * 24 + j] as f64)
                            .sum();
                        expect[h * 768 + i * 24 + j] = ts - s0[h * 768 + i * 24 + j] as f64;
                    }
                }
            }
            let diff: Vec<f32> = exact.iter().zip(&naive).map(|(a, b)| a - b).collect();
            let e = rel64(&diff, &expect);
            assert!(e <= 1e-5, "{fam:?}: {e:e}");
            // …and that error is large: naive addition is structurally wrong.
            let r = norm_ratio(&diff, &s0);
            assert!(r > 0.5, "{fam:?}: ‖(T_C − I)S‖ / ‖S‖ = {r}");
        }
    }

    #[test]
    fn naive_addition_scalar_decay_loses_63_percent() {
        // docs/pic-design.md §2.3: γ = 1 − 2⁻¹⁰ over 1024 tokens:
        // ‖(T_C − I)S‖ / ‖S‖ = 1 − γ¹⁰²⁴.
        let d = GdrDims {
            t: 1024,
            hk: 1,
            hv: 1,
            dk: 8,
            dv: 8,
        };
        let mut c = Case::random(Family::Scalar, &d, -1.0, 61);
        let lng = (1.0f64 - 2f64.powi(-10)).ln() as f32;
        c.g.iter_mut().for_each(|x| *x = lng);
        let pair = Family::Scalar.build(&d, &c.inputs(), 64).unwrap().pair;
        let expect = (1.0f64 - 2f64.powi(-10)).powi(1024);
        assert!((pair.t()[0] as f64 - expect).abs() <= 1e-6 * expect);
        let s0 = uniform(&mut rng(62), 64, -1.0, 1.0);
        let (mut exact, mut naive) = (s0.clone(), s0.clone());
        pair.apply(&mut exact).unwrap();
        pair.apply_naive(&mut naive).unwrap();
        let diff: Vec<f32> = naive.iter().zip(&exact).map(|(a, b)| a - b).collect();
        let lost = norm_ratio(&diff, &s0);
        assert!((lost - (1.0 - expect)).abs() <= 1e-5, "lost {lost}");
        assert!((lost - 0.6323).abs() < 1e-3);
    }

    #[test]
    fn pair_bytes_per_head_at_dk_dv_128() {
        let state = 128 * 128 * 4;
        assert_eq!(
            Pair::identity(TransitionKind::Scalar, 1, 128, 128).bytes(),
            4 + state
        );
        assert_eq!(
            Pair::identity(TransitionKind::Diagonal, 1, 128, 128).bytes(),
            512 + state
        );
        assert_eq!(
            Pair::identity(TransitionKind::Dense, 1, 128, 128).bytes(),
            65536 + state
        );
        // Qwen3.5-35B-A3B shape: 32 value heads → 2 MiB of T and 2 MiB of S per layer.
        assert_eq!(
            Pair::identity(TransitionKind::Dense, 32, 128, 128).bytes(),
            4 << 20
        );
    }

    #[test]
    fn invalid_inputs_return_errors() {
        let d = dims(5);
        let c = Case::random(Family::GatedDelta, &d, -1.0, 71);
        let x = c.inputs();
        // Missing / superfluous beta.
        let nob = LinearInputs { beta: None, ..x };
        assert_eq!(
            Family::GatedDelta.build(&d, &nob, 64).unwrap_err(),
            TransitionError::Beta {
                family: Family::GatedDelta,
                needs_beta: true
            }
        );
        assert!(matches!(
            Family::Scalar.build(&d, &x, 64),
            Err(TransitionError::Beta {
                needs_beta: false,
                ..
            })
        ));
        // Wrong lengths.
        let short = LinearInputs { v: &c.v[1..], ..x };
        assert!(matches!(
            Family::GatedDelta.build(&d, &short, 64),
            Err(TransitionError::Shape { .. })
        ));
        // Per-channel g expected for KDA.
        assert!(matches!(
            Family::KimiDelta.build(&d, &x, 64),
            Err(TransitionError::Shape { .. })
        ));
        // Bad heads and chunk.
        let bad = GdrDims { hv: 3, ..d };
        assert!(matches!(
            Family::GatedDelta.build(&bad, &x, 64),
            Err(TransitionError::Dims(_))
        ));
        assert!(matches!(
            Family::GatedDelta.build(&d, &x, 0),
            Err(TransitionError::Dims(_))
        ));
        let mut s = vec![0f32; 7];
        assert!(matches!(
            Family::GatedDelta.recurrent(&d, &x, &mut s),
            Err(TransitionError::Shape { .. })
        ));
        // Pair mismatches.
        let dense = Pair::identity(TransitionKind::Dense, 4, 32, 24);
        let diag = Pair::identity(TransitionKind::Diagonal, 4, 32, 24);
        let other = Pair::identity(TransitionKind::Dense, 4, 32, 16);
        assert_eq!(
            dense.compose(&diag).unwrap_err(),
            TransitionError::KindMismatch(TransitionKind::Dense, TransitionKind::Diagonal)
        );
        assert!(matches!(
            dense.compose(&other),
            Err(TransitionError::PairDims(..))
        ));
        assert!(matches!(
            dense.apply(&mut s),
            Err(TransitionError::Shape { .. })
        ));
        assert!(matches!(
            dense.apply_naive(&mut s),
            Err(TransitionError::Shape { .. })
        ));
        assert!(Pair::from_parts(
            TransitionKind::Diagonal,
            4,
            32,
            24,
            vec![1.0; 4],
            vec![0.0; 4 * 32 * 24]
        )
        .is_err());
        let (t, b) = diag.clone().into_parts();
        assert_eq!(
            Pair::from_parts(TransitionKind::Diagonal, 4, 32, 24, t, b).unwrap(),
            diag
        );
    }
}
