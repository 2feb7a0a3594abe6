//! The bf16 drift of a GPU model split by source, shared by `cuda_families.rs` and
//! `cuda_kimi.rs`: `weights` (the CPU model with bf16-rounded weights,
//! `Model::round_projections`, against the f32 one: no GPU involved), `activations`
//! (the bf16 GPU model against the rounded-weights CPU model: the rounding of
//! activations and intermediates, what the kernels add) and `total` (the GPU against
//! the f32 CPU model).
use std::sync::Arc;

use dataplane::cuda::model::GpuModel;
use dataplane::cuda::Gpu;
use dataplane::model::{Logits, Model};
use dataplane::sampling::argmax;
use half::bf16;

/// Bound on the median of the per-row logits error `‖gpu_r − cpu_r‖ / ‖cpu_r‖` of the
/// bf16 GPU model against the CPU model with the same bf16-rounded weights, pooled over
/// the prompt lengths. With the weights equal on both sides, what
/// remains is the rounding of activations and intermediates to bf16 (unit roundoff 2⁻⁹
/// per stored value, a few dozen stores per layer), which on these random tiny models
/// gives per-row errors of order 1e-2. The median ignores the minority of rows whose
/// MoE top-k selection flips at a near tie (such a row moves by up to the whole logit
/// range). A broken bf16 path makes most rows unrelated to the reference (per-row
/// errors of order 1). Not applied per length: a length of a few rows is a handful of
/// samples, and one near tie moves its median (the Qwen3.5 control itself reaches 0.14
/// on its one row at T = 1).
pub const SPLIT_ROW_MEDIAN_TOL: f64 = 0.1;
/// Bound on a family's pooled activation row median over that of the Qwen control of
/// the same kind (golden fixture against golden fixture, random model against random
/// model): the control runs the GDN / attention kernels that serve Qwen in bf16, so
/// the family's mixers may add no more than this factor of bf16 error on top of what
/// the same rounding gives there. A defect in a family kernel shows as per-row errors
/// of order 1, a ratio of tens.
pub const SPLIT_CONTROL_RATIO_MAX: f64 = 2.5;

/// The failure of the control comparison, if any: `family` and `control` are pooled
/// activation row medians of [`bf16_split`].
pub fn control_ratio_failure(label: &str, family: f64, control: f64) -> Option<String> {
    let r = family / control;
    (r.is_nan() || r > SPLIT_CONTROL_RATIO_MAX).then(|| {
        format!(
            "{label}: activation row-median {family:.2e} is {r:.2} × the Qwen control's \
             {control:.2e} (max {SPLIT_CONTROL_RATIO_MAX})"
        )
    })
}
/// Least fraction of rows (pooled over the prompt lengths) whose argmax equals the
/// rounded-weights CPU model's: rounding flips only near ties; unrelated logits agree
/// on about 1/vocab of the rows.
pub const SPLIT_ARGMAX_MIN: f64 = 0.75;

/// The three comparisons of [`bf16_split`], in its order.
pub const SPLIT_SOURCES: [&str; 3] = [
    "weights (CPU bf16-rounded vs CPU f32)",
    "activations (GPU bf16 vs CPU bf16-rounded)",
    "total (GPU bf16 vs CPU f32)",
];

/// `(max|a−b| / max(1, max|b|), ‖a−b‖ / ‖b‖)`; NaN anywhere gives NaN; a length
/// mismatch gives +∞.
pub fn rel(a: &[f32], b: &[f32]) -> (f64, f64) {
    if a.len() != b.len() {
        return (f64::INFINITY, f64::INFINITY);
    }
    let (mut maxd, mut maxb, mut num, mut den) = (0f64, 1f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        if x.is_nan() || y.is_nan() {
            return (f64::NAN, f64::NAN);
        }
        let d = (x as f64 - y as f64).abs();
        maxd = maxd.max(d);
        maxb = maxb.max((y as f64).abs());
        num += d * d;
        den += (y as f64) * (y as f64);
    }
    (maxd / maxb, (num / den.max(1e-300)).sqrt())
}

/// Median of `v` (NaN sorts last, so NaN rows push the median up).
fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One line of the split (`max-rel, norm-rel, row median, argmax same/n` of `a`
/// against `b`, `[rows, vocab]`), the per-row norm-wise errors and the number of rows
/// whose argmax agrees.
fn split_line(a: &[f32], b: &[f32], vocab: usize) -> (String, Vec<f64>, usize) {
    let (mx, nw) = rel(a, b);
    let n = b.len() / vocab;
    let mut rows = Vec::with_capacity(n);
    let mut same = 0;
    for r in 0..n {
        let (x, y) = (
            &a[r * vocab..(r + 1) * vocab],
            &b[r * vocab..(r + 1) * vocab],
        );
        rows.push(rel(x, y).1);
        same += usize::from(argmax(x) == argmax(y));
    }
    let med = median(&mut rows.clone());
    (
        format!("max-rel {mx:.2e} norm-rel {nw:.2e} row-median {med:.2e} argmax {same}/{n}"),
        rows,
        same,
    )
}

/// What [`bf16_split`] found: the failed checks (empty when all passed) and the pooled
/// activation row median.
pub struct Split {
    pub failures: Vec<String>,
    pub activation_median: f64,
}

/// The bf16 GPU model of `make()` against the CPU at every length of `lengths`
/// (prompts from `tokens(n, vocab)`), split into its three sources ([`SPLIT_SOURCES`]).
/// Prints one line per length and source and a pooled line per source (lines start
/// with two spaces). Checks the activation part: finite logits at every length;
/// pooled, its row median within [`SPLIT_ROW_MEDIAN_TOL`] and its argmax agreement at
/// least [`SPLIT_ARGMAX_MIN`].
pub fn bf16_split(
    g: &Arc<Gpu>,
    label: &str,
    make: &dyn Fn() -> Model,
    lengths: &[usize],
    tokens: &dyn Fn(usize, usize) -> Vec<u32>,
) -> Split {
    let mut failures = Vec::new();
    let m = make();
    let mut mr = make();
    mr.round_projections(|x| bf16::from_f32(x).to_f32());
    // The upload rounds exactly these weights to bf16, so the device holds `mr`'s.
    let gm = match GpuModel::<bf16>::upload(g.clone(), &m) {
        Ok(x) => x,
        Err(e) => {
            failures.push(format!("{label} bf16 split: upload: {e}"));
            return Split {
                failures,
                activation_median: f64::INFINITY,
            };
        }
    };
    let vocab = m.config.vocab_size;
    // Pooled per-row errors and argmax agreements of weights, activations, total.
    let mut pooled: [(Vec<f64>, usize); 3] = Default::default();
    for &n in lengths {
        let p = tokens(n, vocab);
        let cf = m
            .prefill(&p, &mut m.new_state(), Logits::All)
            .expect("CPU prefill")
            .logits;
        let cr = mr
            .prefill(&p, &mut mr.new_state(), Logits::All)
            .expect("CPU prefill")
            .logits;
        let gl = match gm
            .new_state()
            .and_then(|mut s| gm.prefill(&p, &mut s, Logits::All))
        {
            Ok(x) => x,
            Err(e) => {
                failures.push(format!("{label} bf16 split T {n}: prefill: {e}"));
                continue;
            }
        };
        let pairs = [(&cr, &cf), (&gl, &cr), (&gl, &cf)];
        for (i, ((src, (a, b)), acc)) in
            SPLIT_SOURCES.iter().zip(pairs).zip(&mut pooled).enumerate()
        {
            let (line, mut rows, same) = split_line(a, b, vocab);
            println!("  {label} bf16 T {n} {src}: {line}");
            if i == 1 {
                // No NaN or infinite row at any length (the median would sort them away).
                let finite = rows.iter().all(|e| e.is_finite()) && a.iter().all(|x| x.is_finite());
                if !finite {
                    failures.push(format!("{label} bf16 T {n} activations: non-finite logits"));
                }
            }
            acc.0.append(&mut rows);
            acc.1 += same;
        }
    }
    let mut medians = [0f64; 3];
    let mut fracs = [0f64; 3];
    for (i, (rows, same)) in pooled.iter_mut().enumerate() {
        fracs[i] = *same as f64 / rows.len().max(1) as f64;
        medians[i] = median(rows);
        println!(
            "  {label} bf16 pooled {} over {} rows: row-median {:.2e} argmax {:.3}",
            SPLIT_SOURCES[i],
            rows.len(),
            medians[i],
            fracs[i]
        );
    }
    let (am, af) = (medians[1], fracs[1]);
    let what = format!("{label} bf16 activations (GPU vs CPU with bf16-rounded weights), pooled");
    if am.is_nan() || am > SPLIT_ROW_MEDIAN_TOL {
        failures.push(format!(
            "{what}: row-median {am:.2e} (tol {SPLIT_ROW_MEDIAN_TOL})"
        ));
    }
    if af < SPLIT_ARGMAX_MIN {
        failures.push(format!(
            "{what}: argmax agrees on {af:.3} of the rows (min {SPLIT_ARGMAX_MIN})"
        ));
    }
    Split {
        failures,
        activation_median: am,
    }
}
