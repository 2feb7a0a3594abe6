//! The GPU PIC engine (`dataplane::cuda::pic::GpuPicEngine`) against the CPU
//! `pic::PicEngine` (issue 6, part 3).
//!
//! Built only with `--features cuda` (without it this binary has no tests); built
//! with the feature, every test needs a usable CUDA device and fails without one.
//! `cpu_side_runs_without_a_device` runs the CPU half of every scenario.
//!
//! Models: the three golden fixtures (dk = dv = 16, head_dim 32: the generic
//! transition kernel of pic.cu and the generic GDR/attention kernels), the bundled
//! `models/hypic-tiny` (dk = dv = 64, head_dim 64), and a synthetic random model
//! (dk = dv = 128, head_dim 256: `T_body` from the chunked kernel in the same pass for
//! bodies of ≥ 16 tokens).
//!
//! Per model and dtype, every mode (full, prefix, naive, hypic w = 0, hypic w = 8,
//! hypic w = 8 without the RoPE fix) serves the same prompt (system + 3 documents +
//! query, as tests/pic.rs builds them) cold, then reordered, then the reordered
//! prompt again (hot), on both engines. Checked: identical `PicStats` (outcomes,
//! hits, misses, token counts, hashes), logits (fp32: max-relative error
//! `max|gpu − cpu| / max(1, max|cpu|)` ≤ 1e-4; bf16: norm-wise ≤ 0.1 on hypic-tiny,
//! 0.35 on the randomly initialised golden and synthetic models, the bounds of
//! cuda_model.rs), 8 greedy tokens
//! decoded from the returned states (fp32: equal, unless the CPU's top-2 logit gap at
//! the first difference is below 2e-4 · max(1, max|logit|), a near tie, printed), and
//! tenant isolation (another tenant with its own isolation key gets no hit). Separately: the body
//! pairs and KV of cache entries against the CPU's, the transition kernel against
//! `linear::gdr::chunked_with_transition` (f32 keys, and bf16 keys against the CPU on
//! the same rounded keys; 1e-5), the spill tier (restores bit-exact,
//! damaged blobs recomputed) and bad input.
//!
//! Every case prints a line starting with two spaces (collected into the gpu-check
//! report).

#[cfg(feature = "cuda")]
#[path = "common/synthetic.rs"]
mod synthetic;

#[cfg(feature = "cuda")]
mod gpu {
    use super::synthetic::synthetic_model;
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

    use cudarc::cublas::{CudaBlas, Gemm};
    use dataplane::cuda::gdr::set_identity;
    use dataplane::cuda::model::GpuModel;
    use dataplane::cuda::pic::{gdr_transition, GpuPicEngine};
    use dataplane::cuda::{Elem, Gpu};
    use dataplane::linear::gdr::{chunked_with_transition, GdrDims};
    use dataplane::model::Model;
    use dataplane::pic::engine::EntryLayer;
    use dataplane::pic::{Mode, Outcome, PicEngine, PicStats, SegmentRef};
    use dataplane::sampling::argmax;
    use dataplane::state::ModelState;
    use half::bf16;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const F32_TOL: f64 = 1e-4;
    const BF16_TOL: f64 = 0.1;
    const BF16_TOL_RANDOM_GOLDEN: f64 = 0.35;
    const GREEDY: usize = 8;

    fn gpu(test: &str) -> Option<(Arc<Gpu>, MutexGuard<'static, ()>)> {
        static G: OnceLock<std::result::Result<Arc<Gpu>, String>> = OnceLock::new();
        static L: Mutex<()> = Mutex::new(());
        let guard = L.lock().unwrap_or_else(|e| e.into_inner());
        let g = G.get_or_init(|| match std::panic::catch_unwind(|| Gpu::new(0)) {
            Ok(Ok(g)) => {
                println!("cuda_pic: device {} ({})", g.name(), g.arch());
                Ok(g)
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("panic while loading the CUDA libraries".into()),
        });
        match g {
            Ok(g) => Some((g.clone(), guard)),
            Err(e) => {
                panic!("{test}: built with `--features cuda`, so it needs a CUDA device, and none is usable: {e}")
            }
        }
    }

    fn repo_root() -> PathBuf {
        let probe = |p: &Path| p.join("dataplane/tests/fixtures/golden").is_dir();
        let mut cands = vec![];
        if let Some(p) = std::env::var_os("HYPIC_REPO_ROOT") {
            cands.push(PathBuf::from(p));
        }
        if let Ok(cwd) = std::env::current_dir() {
            cands.push(cwd.clone());
            if let Some(p) = cwd.parent() {
                cands.push(p.to_path_buf());
            }
        }
        cands.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."));
        cands
            .into_iter()
            .find(|p| probe(p))
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."))
    }

    fn model_dir(label: &str) -> PathBuf {
        if label == "hypic-tiny" {
            repo_root().join("models/hypic-tiny")
        } else {
            repo_root()
                .join("dataplane/tests/fixtures/golden")
                .join(label)
        }
    }

    fn load(label: &str) -> std::result::Result<Model, String> {
        if label == "synthetic" {
            return synthetic_model();
        }
        let dir = model_dir(label);
        Model::load(&dir, &mut |_, _| {}).map_err(|e| format!("load {}: {e}", dir.display()))
    }

    /// `(max|a−b| / max(1, max|b|), ‖a−b‖ / ‖b‖)`; NaN gives NaN, a length mismatch +∞.
    fn rel(a: &[f32], b: &[f32]) -> (f64, f64) {
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

    fn ok(e: f64, tol: f64) -> bool {
        e.is_finite() && e <= tol
    }

    /// System prompt (24 tokens), `docs` documents of 20–89 tokens, a 10-token query
    /// (as tests/pic.rs), ids below `min(vocab, 317)`, isolation key `iso`.
    fn prompt(seed: u64, docs: usize, vocab: usize, iso: &str) -> Vec<SegmentRef> {
        let mut rng = StdRng::seed_from_u64(seed);
        let top = vocab.min(317) as u32;
        let seg = |rng: &mut StdRng, len: usize| SegmentRef {
            tokens: (0..len).map(|_| rng.random_range(0..top)).collect(),
            isolation: iso.into(),
        };
        let mut v = vec![seg(&mut rng, 24)];
        for _ in 0..docs {
            let len = rng.random_range(20..90);
            v.push(seg(&mut rng, len));
        }
        v.push(seg(&mut rng, 10));
        v
    }

    /// `[sys, d3, d1, d2, query]` of a 3-document prompt.
    fn reorder(p: &[SegmentRef]) -> Vec<SegmentRef> {
        vec![
            p[0].clone(),
            p[3].clone(),
            p[1].clone(),
            p[2].clone(),
            p[4].clone(),
        ]
    }

    fn modes() -> Vec<(&'static str, Mode)> {
        vec![
            ("full", Mode::FullRecompute),
            ("prefix", Mode::PrefixCache),
            ("naive", Mode::NaiveAddition),
            (
                "hypic-w0",
                Mode::Hypic {
                    seam_width: 0,
                    rope_fix: true,
                },
            ),
            ("hypic-w8", Mode::hypic_default()),
            (
                "hypic-w8-norope",
                Mode::Hypic {
                    seam_width: 8,
                    rope_fix: false,
                },
            ),
        ]
    }

    fn outcomes(s: &PicStats) -> String {
        s.segments
            .iter()
            .map(|x| match x.outcome {
                Outcome::Computed => 'C',
                Outcome::PrefixHit => 'P',
                Outcome::Hit => 'H',
                Outcome::Miss => 'M',
            })
            .collect()
    }

    /// CPU greedy tokens with, per step, the top-1 − top-2 gap relative to
    /// `max(1, max|logit|)` (the scale of the logits tolerance).
    fn cpu_greedy(m: &Model, logits: &[f32], mut st: ModelState, n: usize) -> Vec<(u32, f32)> {
        let step = |l: &[f32]| {
            let scale = l.iter().fold(1f32, |a, x| a.max(x.abs()));
            (argmax(l), gap(l) / scale)
        };
        let mut out = vec![step(logits)];
        for _ in 1..n {
            let Ok(l) = m.decode(out[out.len() - 1].0, &mut st) else {
                break;
            };
            out.push(step(&l));
        }
        out
    }

    /// Top-1 minus top-2 logit.
    fn gap(l: &[f32]) -> f32 {
        let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &x in l {
            if x > a {
                b = a;
                a = x;
            } else if x > b {
                b = x;
            }
        }
        a - b
    }

    struct Report {
        failures: Vec<String>,
    }

    impl Report {
        fn new() -> Self {
            Report { failures: vec![] }
        }
        fn fail(&mut self, m: String) {
            println!("  FAIL {m}");
            self.failures.push(m);
        }
        fn finish(self, test: &str) {
            assert!(
                self.failures.is_empty(),
                "{test}: {} failure(s):\n{}",
                self.failures.len(),
                self.failures.join("\n")
            );
        }
    }

    fn dtype<T: Elem>() -> &'static str {
        T::SUFFIX
    }

    /// Every mode on one model in dtype `T`: cold, reordered, hot; stats, logits,
    /// greedy tokens and tenant isolation against the CPU engine.
    fn pic_scenario<T: Elem>(gpu: &Arc<Gpu>, label: &str, model: &Arc<Model>, rep: &mut Report)
    where
        CudaBlas: Gemm<T>,
    {
        let gm = match GpuModel::<T>::upload(gpu.clone(), model) {
            Ok(m) => Arc::new(m),
            Err(e) => return rep.fail(format!("{label} {}: upload: {e}", dtype::<T>())),
        };
        let f32_run = T::SUFFIX == "f32";
        let random_golden = label.starts_with("qwen3") || label == "synthetic";
        let tol = if f32_run {
            F32_TOL
        } else if random_golden {
            BF16_TOL_RANDOM_GOLDEN
        } else {
            BF16_TOL
        };
        let vocab = model.config.vocab_size;
        let cold = prompt(7, 3, vocab, "t");
        let hot = reorder(&cold);
        for (mname, mode) in modes() {
            let cpu = PicEngine::new(model.clone(), label, 1 << 30, 1 << 30);
            let gpe = GpuPicEngine::new(gm.clone(), label, 1 << 30, 1 << 30);
            let phases: [(&str, &[SegmentRef]); 3] =
                [("cold", &cold), ("reordered", &hot), ("hot", &hot)];
            let mut last = None;
            for (phase, segs) in phases {
                let case = format!("{label} {} {mname} {phase}", dtype::<T>());
                let c = match cpu.run(segs, mode, "t") {
                    Ok(c) => c,
                    Err(e) => return rep.fail(format!("{case}: CPU run: {e}")),
                };
                let g = match gpe.run(segs, mode, "t") {
                    Ok(g) => g,
                    Err(e) => return rep.fail(format!("{case}: GPU run: {e}")),
                };
                let (mx, nw) = rel(&g.logits, &c.logits);
                let e = if f32_run { mx } else { nw };
                println!(
                    "  {case}: outcomes cpu {} gpu {}, hits {}/{}, misses {}/{}, computed {}/{}, \
                     logits max-rel {mx:.2e} norm-rel {nw:.2e} (tol {tol:.0e} on {})",
                    outcomes(&c.stats),
                    outcomes(&g.stats),
                    c.stats.hits,
                    g.stats.hits,
                    c.stats.misses,
                    g.stats.misses,
                    c.stats.tokens_computed,
                    g.stats.tokens_computed,
                    if f32_run { "max-rel" } else { "norm-rel" }
                );
                if g.stats != c.stats {
                    rep.fail(format!(
                        "{case}: stats differ: cpu {:?} gpu {:?}",
                        c.stats, g.stats
                    ));
                }
                if !ok(e, tol) {
                    rep.fail(format!("{case}: logits error {e:.3e} > {tol:.0e}"));
                }
                last = Some((c, g));
            }
            // Greedy continuation from the returned states.
            if let Some((c, mut g)) = last {
                let cg = cpu_greedy(model, &c.logits, c.state, GREEDY);
                let mut gg = vec![argmax(&g.logits)];
                while gg.len() < cg.len() {
                    match gm.decode(gg[gg.len() - 1], &mut g.state) {
                        Ok(l) => gg.push(argmax(&l)),
                        Err(e) => {
                            rep.fail(format!("{label} {mname}: GPU decode: {e}"));
                            break;
                        }
                    }
                }
                let ct: Vec<u32> = cg.iter().map(|x| x.0).collect();
                let first_diff = ct.iter().zip(&gg).position(|(a, b)| a != b);
                println!(
                    "  {label} {} {mname} greedy {GREEDY}: cpu {ct:?} gpu {gg:?}",
                    dtype::<T>()
                );
                if let (true, Some(i)) = (f32_run, first_diff) {
                    // Within twice the logits tolerance: a near tie, not a failure.
                    if (cg[i].1 as f64) < 2.0 * F32_TOL {
                        println!(
                            "  {label} {mname}: greedy differs at {i}, a near tie (relative gap {:.2e})",
                            cg[i].1
                        );
                    } else {
                        rep.fail(format!(
                            "{label} f32 {mname}: greedy differs at step {i} (cpu relative gap {:.2e})",
                            cg[i].1
                        ));
                    }
                }
            }
            // Tenant isolation: another tenant with its own isolation keys gets no hit.
            let other: Vec<SegmentRef> = hot
                .iter()
                .map(|s| SegmentRef {
                    tokens: s.tokens.clone(),
                    isolation: "u".into(),
                })
                .collect();
            match (cpu.run(&other, mode, "u"), gpe.run(&other, mode, "u")) {
                (Ok(c), Ok(g)) => {
                    let hit = g
                        .stats
                        .segments
                        .iter()
                        .any(|s| matches!(s.outcome, Outcome::Hit | Outcome::PrefixHit));
                    println!(
                        "  {label} {} {mname} other tenant: outcomes cpu {} gpu {}",
                        dtype::<T>(),
                        outcomes(&c.stats),
                        outcomes(&g.stats)
                    );
                    if hit || g.stats != c.stats {
                        rep.fail(format!(
                            "{label} {mname}: other tenant saw a hit or stats differ"
                        ));
                    }
                    let n = gpe.invalidate_owner("u");
                    let m = cpu.invalidate_owner("u");
                    if n != m {
                        rep.fail(format!("{label} {mname}: invalidate_owner gpu {n} cpu {m}"));
                    }
                }
                (Err(e), _) => rep.fail(format!("{label} {mname}: other tenant, CPU: {e}")),
                (_, Err(e)) => rep.fail(format!("{label} {mname}: other tenant, GPU: {e}")),
            }
        }
    }

    fn run_pic(test: &str, label: &str) {
        let Some((g, _l)) = gpu(test) else {
            return;
        };
        let mut rep = Report::new();
        match load(label) {
            Ok(m) => {
                let m = Arc::new(m);
                println!("-- {label}");
                pic_scenario::<f32>(&g, label, &m, &mut rep);
                pic_scenario::<bf16>(&g, label, &m, &mut rep);
            }
            Err(e) => rep.fail(e),
        }
        rep.finish(test);
    }

    #[test]
    fn pic_matches_cpu_golden_qwen3_next() {
        run_pic("pic_matches_cpu_golden_qwen3_next", "qwen3_next");
    }

    #[test]
    fn pic_matches_cpu_golden_qwen3_5_moe() {
        run_pic("pic_matches_cpu_golden_qwen3_5_moe", "qwen3_5_moe");
    }

    #[test]
    fn pic_matches_cpu_golden_qwen3_5() {
        run_pic("pic_matches_cpu_golden_qwen3_5", "qwen3_5");
    }

    #[test]
    fn pic_matches_cpu_hypic_tiny() {
        run_pic("pic_matches_cpu_hypic_tiny", "hypic-tiny");
    }

    #[test]
    fn pic_matches_cpu_synthetic_dk128_hd256() {
        run_pic("pic_matches_cpu_synthetic_dk128_hd256", "synthetic");
    }

    /// Cache entries built on the GPU (fp32) against the CPU's: per layer the body
    /// pair `(T, S|0)`, the conv tail, the body K/V; body starts 0, 8 and 30.
    #[test]
    fn entries_match_cpu() {
        let test = "entries_match_cpu";
        let Some((g, _l)) = gpu(test) else {
            return;
        };
        let mut rep = Report::new();
        for label in [
            "qwen3_next",
            "qwen3_5_moe",
            "qwen3_5",
            "hypic-tiny",
            "synthetic",
        ] {
            let m = match load(label) {
                Ok(m) => Arc::new(m),
                Err(e) => {
                    rep.fail(e);
                    continue;
                }
            };
            let gm = match GpuModel::<f32>::upload(g.clone(), &m) {
                Ok(x) => Arc::new(x),
                Err(e) => {
                    rep.fail(format!("{label}: upload: {e}"));
                    continue;
                }
            };
            let cpu = PicEngine::new(m.clone(), label, 1 << 30, 1 << 30);
            let gpe = GpuPicEngine::new(gm, label, 1 << 30, 1 << 30);
            let tokens = prompt(11, 3, m.config.vocab_size, "t")[2].tokens.clone();
            for bs in [0usize, 8, 30] {
                let (c, ge) = match (cpu.build_entry(&tokens, bs), gpe.build_entry(&tokens, bs)) {
                    (Ok(c), Ok(x)) => (c, x),
                    (Err(e), _) => return rep.fail(format!("{label}: CPU build: {e}")),
                    (_, Err(e)) => return rep.fail(format!("{label}: GPU build: {e}")),
                };
                let h = match ge.to_host() {
                    Ok(h) => h,
                    Err(e) => return rep.fail(format!("{label}: download: {e}")),
                };
                let mut worst = (0f64, String::new());
                for (i, (a, b)) in h.layers.iter().zip(&c.layers).enumerate() {
                    let errs: Vec<(&str, f64)> = match (a, b) {
                        (
                            EntryLayer::Linear {
                                pair: pa,
                                conv_tail: ca,
                            },
                            EntryLayer::Linear {
                                pair: pb,
                                conv_tail: cb,
                            },
                        ) => vec![
                            ("T", rel(pa.t(), pb.t()).0),
                            ("S|0", rel(pa.b(), pb.b()).0),
                            ("conv", rel(ca, cb).0),
                        ],
                        (EntryLayer::Full { k: ka, v: va }, EntryLayer::Full { k: kb, v: vb }) => {
                            vec![("K", rel(ka, kb).0), ("V", rel(va, vb).0)]
                        }
                        _ => vec![("kind", f64::INFINITY)],
                    };
                    for (w, e) in errs {
                        // NaN counts as worst.
                        if e.is_nan() || e > worst.0 {
                            worst = (e, format!("layer {i} {w}"));
                        }
                    }
                }
                println!(
                    "  {label} entry {} tokens body_start {bs}: worst max-rel {:.2e} at {}, {} bytes",
                    tokens.len(),
                    worst.0,
                    worst.1,
                    ge.bytes()
                );
                if h.layers.len() != c.layers.len()
                    || (h.body_start, h.len) != (c.body_start, c.len)
                {
                    rep.fail(format!("{label} bs {bs}: entry shape differs"));
                }
                if !ok(worst.0, F32_TOL) {
                    rep.fail(format!(
                        "{label} bs {bs}: {} error {:.3e}",
                        worst.1, worst.0
                    ));
                }
            }
        }
        rep.finish(test);
    }

    /// The generic transition kernel (pic.cu) against the CPU `T_C` of
    /// `linear::gdr::chunked_with_transition`, dk ∈ {16, 64, 128}, bf16 and f32 inputs.
    #[test]
    fn transition_kernel_matches_cpu() {
        let test = "transition_kernel_matches_cpu";
        let Some((g, _l)) = gpu(test) else {
            return;
        };
        let mut rep = Report::new();
        for (dk, t, hk, hv) in [
            (16usize, 5usize, 2usize, 4usize),
            (16, 77, 1, 2),
            (64, 40, 2, 4),
            (128, 70, 2, 4),
        ] {
            let d = GdrDims {
                t,
                hk,
                hv,
                dk,
                dv: dk,
            };
            let mut r = StdRng::seed_from_u64(dk as u64 * 1000 + t as u64);
            let mut unit = |n: usize| -> Vec<f32> {
                let mut v: Vec<f32> = (0..n * dk).map(|_| r.random_range(-1.0f32..1.0)).collect();
                for row in v.chunks_mut(dk) {
                    let s = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                    row.iter_mut().for_each(|x| *x /= s);
                }
                v
            };
            let q = unit(t * hk);
            let k = unit(t * hk);
            let v: Vec<f32> = (0..t * hv * dk)
                .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                .collect();
            let gg: Vec<f32> = (0..t * hv).map(|i| -0.02 - (i % 7) as f32 * 0.03).collect();
            let beta: Vec<f32> = (0..t * hv).map(|i| 0.1 + (i % 5) as f32 * 0.17).collect();
            let mut st = vec![0f32; hv * dk * dk];
            let (_, tc) = chunked_with_transition(&d, &q, &k, &v, &gg, &beta, &mut st, 64);
            // Reference for bf16 keys: the same recurrence on the bf16-rounded keys.
            let kr: Vec<f32> = k.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
            let mut st = vec![0f32; hv * dk * dk];
            let (_, tcb) = chunked_with_transition(&d, &q, &kr, &v, &gg, &beta, &mut st, 64);
            let run = || -> Result<(Vec<f32>, Vec<f32>), String> {
                let e = |x: dataplane::cuda::CudaError| x.to_string();
                let g_d = g.upload(&gg).map_err(e)?;
                let b_d = g.upload(&beta).map_err(e)?;
                let mut tr = g.zeros::<f32>(hv * dk * dk).map_err(e)?;
                set_identity(&g, &mut tr, hv, dk).map_err(e)?;
                gdr_transition(&g, &d, &g.upload(&k).map_err(e)?, &g_d, &b_d, &mut tr)
                    .map_err(e)?;
                let a = g.download(&tr).map_err(e)?;
                let kb: Vec<bf16> = k.iter().map(|&x| bf16::from_f32(x)).collect();
                set_identity(&g, &mut tr, hv, dk).map_err(e)?;
                gdr_transition(&g, &d, &g.upload(&kb).map_err(e)?, &g_d, &b_d, &mut tr)
                    .map_err(e)?;
                Ok((a, g.download(&tr).map_err(e)?))
            };
            match run() {
                Ok((a, b)) => {
                    let (ea, eb) = (rel(&a, &tc).0, rel(&b, &tcb).0);
                    println!("  transition dk {dk} T {t} Hk {hk} Hv {hv}: f32 max-rel {ea:.2e}, bf16-k {eb:.2e}");
                    if !ok(ea, 1e-5) {
                        rep.fail(format!("transition dk {dk} T {t}: f32 error {ea:.3e}"));
                    }
                    if !ok(eb, 1e-5) {
                        rep.fail(format!("transition dk {dk} T {t}: bf16 error {eb:.3e}"));
                    }
                }
                Err(e) => rep.fail(format!("transition dk {dk}: {e}")),
            }
        }
        rep.finish(test);
    }

    /// Spill tier: a public pool that holds one entry, with a host spill tier. The
    /// reordered prompt restores its entries from host blobs: stats and logits equal
    /// (bit-exact) to a big-pool engine. After damaging every blob, another order
    /// recomputes them (misses, `spill_corrupt` counted) and still matches.
    #[test]
    fn spill_restores_bit_exact_and_recomputes_damaged() {
        let test = "spill_restores_bit_exact_and_recomputes_damaged";
        let Some((g, _l)) = gpu(test) else {
            return;
        };
        let mut rep = Report::new();
        for label in ["qwen3_5", "hypic-tiny"] {
            let m = match load(label) {
                Ok(m) => m,
                Err(e) => {
                    rep.fail(e);
                    continue;
                }
            };
            let gm = match GpuModel::<f32>::upload(g.clone(), &m) {
                Ok(x) => Arc::new(x),
                Err(e) => {
                    rep.fail(format!("{label}: upload: {e}"));
                    continue;
                }
            };
            let mode = Mode::hypic_default();
            let p = prompt(21, 3, m.config.vocab_size, "t");
            let big = GpuPicEngine::new(gm.clone(), label, 1 << 30, 0);
            // The largest entry of the prompt (the system prompt is cached whole, the
            // documents from the seam width): the pool holds one of them.
            let mut one = 0usize;
            for (i, seg) in p[..4].iter().enumerate() {
                match big.build_entry(&seg.tokens, if i == 0 { 0 } else { 8 }) {
                    Ok(e) => one = one.max(e.bytes()),
                    Err(e) => return rep.fail(format!("{label}: build: {e}")),
                }
            }
            let small = GpuPicEngine::new(gm.clone(), label, one * 3 / 2 + 1, 0);
            small.enable_spill(1 << 30, 0);
            let r1 = reorder(&p);
            let r2 = vec![
                p[0].clone(),
                p[2].clone(),
                p[3].clone(),
                p[1].clone(),
                p[4].clone(),
            ];
            let step = |name: &str,
                        segs: &[SegmentRef],
                        rep: &mut Report|
             -> Option<(PicStats, PicStats)> {
                match (big.run(segs, mode, "t"), small.run(segs, mode, "t")) {
                    (Ok(a), Ok(b)) => {
                        let (mx, _) = rel(&b.logits, &a.logits);
                        let exact = a
                            .logits
                            .iter()
                            .zip(&b.logits)
                            .all(|(x, y)| x.to_bits() == y.to_bits());
                        let (_, _, ps) = small.public_usage();
                        println!(
                            "  {label} spill {name}: big {} small {}, logits max-rel {mx:.2e} bit-exact {exact}, \
                             spilled {} restores {} corrupt {}, spill tier {:?}",
                            outcomes(&a.stats),
                            outcomes(&b.stats),
                            ps.spilled,
                            ps.spill_restores,
                            ps.spill_corrupt,
                            small.spill_usage()[0]
                        );
                        if !exact && name != "damaged" {
                            rep.fail(format!(
                                "{label} spill {name}: logits not bit-exact ({mx:.3e})"
                            ));
                        }
                        if !ok(mx, F32_TOL) {
                            rep.fail(format!("{label} spill {name}: logits error {mx:.3e}"));
                        }
                        Some((a.stats, b.stats))
                    }
                    (Err(e), _) | (_, Err(e)) => {
                        rep.fail(format!("{label} spill {name}: {e}"));
                        None
                    }
                }
            };
            step("cold", &p, &mut rep);
            if let Some((a, b)) = step("restored", &r1, &mut rep) {
                let (_, _, ps) = small.public_usage();
                if a != b || ps.spill_restores == 0 {
                    rep.fail(format!(
                        "{label}: restored run stats differ or nothing restored ({} restores)",
                        ps.spill_restores
                    ));
                }
            }
            let damaged = small.damage_spilled(40);
            println!("  {label} spill: damaged {damaged} blobs");
            if damaged == 0 {
                rep.fail(format!("{label}: no spilled blob to damage"));
            }
            if let Some((a, b)) = step("damaged", &r2, &mut rep) {
                let (_, _, ps) = small.public_usage();
                if ps.spill_corrupt == 0 || b.misses <= a.misses {
                    rep.fail(format!(
                        "{label}: damaged blobs were not recomputed (corrupt {}, misses big {} small {})",
                        ps.spill_corrupt, a.misses, b.misses
                    ));
                }
            }
        }
        rep.finish(test);
    }

    /// The column recurrence of `pic_transition_*` (pic.cu), transcribed line by line
    /// on the host, against `linear::gdr::chunked_with_transition`: checks the kernel's
    /// math (operation order, head mapping, layout) without a device.
    #[test]
    fn transition_recurrence_math_matches_cpu_chunked() {
        for (dk, t, hk, hv) in [
            (16usize, 5usize, 2usize, 4usize),
            (16, 77, 1, 2),
            (64, 40, 2, 4),
        ] {
            let d = GdrDims {
                t,
                hk,
                hv,
                dk,
                dv: dk,
            };
            let mut r = StdRng::seed_from_u64(dk as u64 + t as u64);
            let mut k: Vec<f32> = (0..t * hk * dk)
                .map(|_| r.random_range(-1.0f32..1.0))
                .collect();
            for row in k.chunks_mut(dk) {
                let s = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                row.iter_mut().for_each(|x| *x /= s);
            }
            let q = k.clone();
            let v = vec![0.5f32; t * hv * dk];
            let gg: Vec<f32> = (0..t * hv).map(|i| -0.02 - (i % 7) as f32 * 0.03).collect();
            let beta: Vec<f32> = (0..t * hv).map(|i| 0.1 + (i % 5) as f32 * 0.17).collect();
            let mut st = vec![0f32; hv * dk * dk];
            let (_, tc) = chunked_with_transition(&d, &q, &k, &v, &gg, &beta, &mut st, 64);
            let mut tr = vec![0f32; hv * dk * dk];
            for h in 0..hv {
                for i in 0..dk {
                    tr[h * dk * dk + i * dk + i] = 1.0;
                }
            }
            for h in 0..hv {
                let kh = h / (hv / hk);
                for j in 0..dk {
                    let trh = &mut tr[h * dk * dk..(h + 1) * dk * dk];
                    for ti in 0..t {
                        let kt = &k[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk];
                        let (dec, b) = (gg[ti * hv + h].exp(), beta[ti * hv + h]);
                        let mut kv = 0f32;
                        for i in 0..dk {
                            let s = trh[i * dk + j] * dec;
                            trh[i * dk + j] = s;
                            kv += s * kt[i];
                        }
                        let u = b * (0.0 - kv);
                        for i in 0..dk {
                            trh[i * dk + j] += kt[i] * u;
                        }
                    }
                }
            }
            let e = rel(&tr, &tc).0;
            println!("  transition math dk {dk} T {t}: max-rel {e:.2e}");
            assert!(ok(e, 1e-5), "dk {dk} T {t}: {e:.3e}");
        }
    }

    /// The engine can be shared between serving threads.
    #[test]
    fn engine_is_send_and_sync() {
        fn check<X: Send + Sync>() {}
        check::<GpuPicEngine<f32>>();
        check::<GpuPicEngine<bf16>>();
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let test = "bad_input_is_an_error_not_a_panic";
        let Some((g, _l)) = gpu(test) else {
            return;
        };
        let m = load("qwen3_5").expect("golden model");
        let gm = Arc::new(GpuModel::<f32>::upload(g.clone(), &m).expect("upload"));
        let e = GpuPicEngine::new(gm, "qwen3_5", 1 << 30, 1 << 30);
        let vocab = m.config.vocab_size as u32;
        let s = |t: Vec<u32>| SegmentRef {
            tokens: t,
            isolation: "t".into(),
        };
        let cases: Vec<(&str, Vec<SegmentRef>)> = vec![
            ("no segments", vec![]),
            ("empty segment", vec![s(vec![1, 2]), s(vec![])]),
            ("token outside the vocabulary", vec![s(vec![1, vocab])]),
            (
                "over the context limit",
                vec![s(vec![1; m.config.max_position_embeddings + 1])],
            ),
        ];
        for (what, segs) in cases {
            let r = e.run(&segs, Mode::hypic_default(), "t");
            println!(
                "  bad input {what}: {:?}",
                r.as_ref().err().map(|x| x.to_string())
            );
            assert!(r.is_err(), "{what} should be an error");
        }
        assert!(e.build_entry(&[], 0).is_err());
    }

    /// States of `a` and `b` (host copies) compared layer by layer: the worst
    /// `(max-relative, norm-wise)` error over conv tails, recurrent states and KV.
    fn state_rel(a: &ModelState, b: &ModelState) -> (f64, f64) {
        use dataplane::state::LayerState;
        let mut worst = (0f64, 0f64);
        let mut add = |x: &[f32], y: &[f32]| {
            let (m, n) = rel(x, y);
            worst = (worst.0.max(m), worst.1.max(n));
        };
        for (la, lb) in a.layers.iter().zip(&b.layers) {
            match (la, lb) {
                (LayerState::Linear(x), LayerState::Linear(y)) => {
                    add(&x.recurrent, &y.recurrent);
                    add(&x.conv, &y.conv);
                }
                (LayerState::Full(x), LayerState::Full(y)) => {
                    add(&x.k, &y.k);
                    add(&x.v, &y.v);
                }
                _ => return (f64::INFINITY, f64::INFINITY),
            }
        }
        worst
    }

    /// `GpuModel::prefill_many` (several requests' spans in one batched forward, the
    /// path `HYPIC_CUDA_BATCHED_PREFILL=1` turns on) against `GpuModel::prefill` of each
    /// span alone: three sequences (a fresh one of 37 tokens with logits, one already
    /// 20 tokens in taking 64 more without logits, a fresh one of 5 tokens with
    /// logits) on the golden families, hypic-tiny and the synthetic model, f32 and
    /// bf16: logits and every layer's state (conv tails, recurrent states, KV) within
    /// 1e-4 max-relative in f32 and 5e-2 norm-wise in bf16 (only the batched GEMM
    /// shapes differ), positions advanced alike; an empty span is refused.
    #[test]
    fn batched_prefill_matches_each_alone() {
        let test = "batched_prefill_matches_each_alone";
        let Some((g, _l)) = gpu(test) else {
            return;
        };
        let mut rep = Report::new();
        for label in [
            "qwen3_next",
            "qwen3_5_moe",
            "bailing_moe_linear",
            "kimi_linear",
            "hypic-tiny",
            "synthetic",
        ] {
            let m = match load(label) {
                Ok(m) => m,
                Err(e) => {
                    rep.fail(e);
                    continue;
                }
            };
            batched_case::<f32>(&g, label, &m, 1e-4, false, &mut rep);
            batched_case::<bf16>(&g, label, &m, 5e-2, true, &mut rep);
        }
        rep.finish(test);
    }

    fn batched_case<T: Elem>(
        g: &Arc<Gpu>,
        label: &str,
        m: &Model,
        tol: f64,
        norm_wise: bool,
        rep: &mut Report,
    ) where
        CudaBlas: Gemm<T>,
    {
        let dt = dtype::<T>();
        let gm = match GpuModel::<T>::upload(g.clone(), m) {
            Ok(x) => x,
            Err(e) => return rep.fail(format!("{label} {dt}: upload: {e}")),
        };
        let vocab = m.config.vocab_size as u32;
        let toks = |seed: u32, n: usize| -> Vec<u32> {
            (0..n as u32)
                .map(|i| (i * 29 + seed * 7 + 3) % vocab)
                .collect()
        };
        let (pre, a, b, c) = (toks(1, 20), toks(2, 37), toks(3, 64), toks(4, 5));
        let run = |batched: bool| -> dataplane::cuda::Result<(Vec<Vec<f32>>, Vec<ModelState>)> {
            let mut sa = gm.new_state()?;
            let mut sb = gm.new_state()?;
            let mut sc = gm.new_state()?;
            gm.prefill(&pre, &mut sb, dataplane::model::Logits::None)?;
            let logits = if batched {
                gm.prefill_many(&mut [
                    (&a[..], &mut sa, true),
                    (&b[..], &mut sb, false),
                    (&c[..], &mut sc, true),
                ])?
            } else {
                let last = dataplane::model::Logits::Last;
                vec![
                    gm.prefill(&a, &mut sa, last)?,
                    gm.prefill(&b, &mut sb, dataplane::model::Logits::None)?,
                    gm.prefill(&c, &mut sc, last)?,
                ]
            };
            Ok((logits, vec![sa.to_host()?, sb.to_host()?, sc.to_host()?]))
        };
        let (alone, batched) = match (run(false), run(true)) {
            (Ok(x), Ok(y)) => (x, y),
            (Err(e), _) | (_, Err(e)) => return rep.fail(format!("{label} {dt}: {e}")),
        };
        for i in 0..3 {
            let (lm, ln) = rel(&batched.0[i], &alone.0[i]);
            let (sm, sn) = state_rel(&batched.1[i], &alone.1[i]);
            let (le, se) = if norm_wise { (ln, sn) } else { (lm, sm) };
            let pos_eq = batched.1[i].next_position == alone.1[i].next_position;
            let line = format!(
                "{label} {dt} sequence {i}: batched vs alone: logits {le:.2e}, state {se:.2e}, positions {}",
                if pos_eq { "equal" } else { "DIFFER" }
            );
            if (batched.0[i].is_empty() == alone.0[i].is_empty())
                && (batched.0[i].is_empty() || ok(le, tol))
                && ok(se, tol)
                && pos_eq
            {
                println!("  {line}");
            } else {
                rep.fail(line);
            }
        }
        let mut s = match gm.new_state() {
            Ok(s) => s,
            Err(e) => return rep.fail(format!("{label} {dt}: {e}")),
        };
        if gm.prefill_many(&mut [(&[][..], &mut s, true)]).is_ok() {
            rep.fail(format!("{label} {dt}: an empty span was accepted"));
        }
    }

    /// The serving path over the GPU engine, as `hypic serve --device cuda` wires it
    /// (`dataplane::engine::{Engine, EnginePools}`): segment registration
    /// (prefetch, residency, eviction, invalidation) and the scheduler's continuous
    /// batching (four requests decoded together by `GpuModel::decode_batch`, tokens
    /// sampled on the host), against the same calls on the CPU engine (hypic-tiny,
    /// f32): equal prefetch results, `PicStats` and greedy tokens (a near tie at the
    /// first difference, top-2 log-probability gap below 1e-3 on the CPU, is printed
    /// and ends the comparison of that request).
    #[test]
    fn scheduler_over_the_gpu_engine_matches_cpu() {
        use dataplane::engine::EnginePools;
        use dataplane::pic::Prefetch;
        use dataplane::sampling::SamplingParams;
        use dataplane::scheduler::{GenEvent, GenRequest, Scheduler, SchedulerConfig};
        let test = "scheduler_over_the_gpu_engine_matches_cpu";
        let Some((g, _l)) = gpu(test) else {
            return;
        };
        let label = "hypic-tiny";
        let m = Arc::new(load(label).expect("model"));
        let gm = Arc::new(GpuModel::<f32>::upload(g.clone(), &m).expect("upload"));
        let cpu = Arc::new(PicEngine::new(m.clone(), label, 1 << 30, 1 << 30));
        let gpe = Arc::new(GpuPicEngine::new(gm, label, 1 << 30, 1 << 30));
        let mut rep = Report::new();
        let b = EnginePools::backend(&*gpe);
        println!("  backend {} ({} / {})", b.describe, b.device, b.dtype);
        if b.device != "cuda" || b.dtype != "f32" {
            rep.fail(format!("backend {b:?}"));
        }
        if EnginePools::kv_bytes_per_token(&*gpe) != EnginePools::kv_bytes_per_token(&*cpu) {
            rep.fail("kv bytes per token differ for f32".into());
        }
        let vocab = m.config.vocab_size;
        let base = prompt(11, 3, vocab, "t");
        let kinds = |v: &[(Prefetch, usize)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
        for (i, seg) in base[1..4].iter().enumerate() {
            for round in ["cold", "again"] {
                let a = EnginePools::prefetch_many(&*cpu, &seg.tokens, "t", &[0, 8, 8])
                    .expect("cpu prefetch");
                let r = EnginePools::prefetch_many(&*gpe, &seg.tokens, "t", &[0, 8, 8])
                    .expect("gpu prefetch");
                println!("  prefetch doc {i} {round}: cpu {a:?} gpu {r:?}");
                if kinds(&a) != kinds(&r) {
                    rep.fail(format!("prefetch doc {i} {round}: cpu {a:?} gpu {r:?}"));
                }
            }
            for body in [0, 8] {
                let (a, r) = (
                    EnginePools::resident_bytes(&*cpu, &seg.tokens, "t", body),
                    EnginePools::resident_bytes(&*gpe, &seg.tokens, "t", body),
                );
                if a.is_none() || r.is_none() {
                    rep.fail(format!("doc {i} body {body}: resident cpu {a:?} gpu {r:?}"));
                }
            }
            if EnginePools::content_hash(&*gpe, &seg.tokens)
                != EnginePools::content_hash(&*cpu, &seg.tokens)
            {
                rep.fail(format!("doc {i}: content hashes differ"));
            }
        }
        let other = prompt(12, 3, vocab, "t");
        let prompts = [
            base.clone(),
            reorder(&base),
            vec![
                base[0].clone(),
                base[2].clone(),
                base[3].clone(),
                other[4].clone(),
            ],
            other,
        ];
        let req = |segments: Vec<SegmentRef>| GenRequest {
            segments,
            mode: Mode::hypic_default(),
            tenant: "t".into(),
            sampling: SamplingParams::default(),
            max_tokens: 12,
            stop_token_ids: vec![],
            top_logprobs: 2,
            logprobs: true,
            score: None,
        };
        type Run = (Option<PicStats>, Vec<(u32, Vec<(u32, f32)>)>, String);
        let serve = |sched: &Scheduler| -> Vec<Run> {
            let mut hs: Vec<_> = prompts
                .iter()
                .map(|p| sched.submit(req(p.clone())).expect("submit"))
                .collect();
            hs.iter_mut()
                .map(|h| {
                    let (mut stats, mut toks, mut end) = (None, vec![], String::new());
                    while let Some(e) = h.events.blocking_recv() {
                        match e {
                            GenEvent::Started { stats: s, .. } => stats = Some(s),
                            GenEvent::Token { id, top, .. } => toks.push((id, top)),
                            GenEvent::Scored { .. } => {}
                            GenEvent::Done { reason, .. } => {
                                end = format!("{reason:?}");
                                break;
                            }
                            GenEvent::Error { kind, message } => {
                                end = format!("error {kind:?}: {message}");
                                break;
                            }
                        }
                    }
                    (stats, toks, end)
                })
                .collect()
        };
        let cfg = SchedulerConfig::default();
        let want = serve(&Scheduler::start(cpu.clone(), cfg.clone()));
        let sg = Scheduler::start(gpe.clone(), cfg);
        let got = serve(&sg);
        if sg
            .metrics()
            .generated_tokens
            .load(std::sync::atomic::Ordering::Relaxed)
            == 0
        {
            rep.fail("the GPU scheduler generated nothing".into());
        }
        for (i, ((ws, wt, we), (gs, gt, ge))) in want.iter().zip(&got).enumerate() {
            let o = |s: &Option<PicStats>| s.as_ref().map(outcomes).unwrap_or_default();
            println!(
                "  request {i}: cpu {} {} tokens {we}, gpu {} {} tokens {ge}",
                o(ws),
                wt.len(),
                o(gs),
                gt.len()
            );
            if ws != gs {
                rep.fail(format!("request {i}: stats differ: cpu {ws:?} gpu {gs:?}"));
            }
            if ge.starts_with("error") || we.starts_with("error") {
                rep.fail(format!("request {i}: cpu {we}, gpu {ge}"));
                continue;
            }
            let first = wt.iter().zip(gt).position(|(a, b)| a.0 != b.0);
            match first {
                None if wt.len() == gt.len() => {}
                None => rep.fail(format!(
                    "request {i}: {} tokens on the CPU, {} on the GPU",
                    wt.len(),
                    gt.len()
                )),
                Some(j) => {
                    let top = &wt[j].1;
                    let gap = match (top.first(), top.get(1)) {
                        (Some(a), Some(b)) => a.1 - b.1,
                        _ => f32::INFINITY,
                    };
                    if gap < 1e-3 {
                        println!("  request {i}: near tie at token {j} (gap {gap:.1e})");
                    } else {
                        rep.fail(format!(
                            "request {i}: token {j} differs (gap {gap:.2e}): cpu {:?} gpu {:?}",
                            wt.iter().map(|x| x.0).collect::<Vec<_>>(),
                            gt.iter().map(|x| x.0).collect::<Vec<_>>()
                        ));
                    }
                }
            }
        }
        drop(sg);
        let (a, r) = (
            EnginePools::evict_segment(&*cpu, &base[1].tokens, "t", &[0, 8]),
            EnginePools::evict_segment(&*gpe, &base[1].tokens, "t", &[0, 8]),
        );
        println!("  evict doc 0: cpu {a} gpu {r}");
        if a != r || r == 0 || EnginePools::resident_bytes(&*gpe, &base[1].tokens, "t", 8).is_some()
        {
            rep.fail(format!("evict: cpu {a} gpu {r}"));
        }
        let (a, r) = (
            EnginePools::invalidate_owner(&*cpu, "t"),
            EnginePools::invalidate_owner(&*gpe, "t"),
        );
        println!("  invalidate owner t: cpu {a} gpu {r}");
        if a != r || EnginePools::public_usage(&*gpe).0 != 0 {
            rep.fail(format!("invalidate: cpu {a} gpu {r}"));
        }
        rep.finish(test);
    }

    /// The CPU half of the scenarios, without a device, so that a GPU run cannot
    /// fail on the test's own plumbing (prompts, modes, loading).
    #[test]
    fn cpu_side_runs_without_a_device() {
        for label in [
            "qwen3_next",
            "qwen3_5_moe",
            "qwen3_5",
            "hypic-tiny",
            "synthetic",
        ] {
            let m = Arc::new(load(label).expect("model"));
            let cold = prompt(7, 3, m.config.vocab_size, "t");
            let hot = reorder(&cold);
            for (mname, mode) in modes() {
                let cpu = PicEngine::new(m.clone(), label, 1 << 30, 1 << 30);
                let a = cpu.run(&cold, mode, "t").expect("cold");
                let b = cpu.run(&hot, mode, "t").expect("reordered");
                assert_eq!(a.logits.len(), m.config.vocab_size);
                println!(
                    "  cpu {label} {mname}: cold {} reordered {}",
                    outcomes(&a.stats),
                    outcomes(&b.stats)
                );
                if mode != Mode::FullRecompute {
                    assert!(
                        b.stats.hits > 0,
                        "{label} {mname}: reordered run reuses nothing"
                    );
                }
            }
        }
    }
}
