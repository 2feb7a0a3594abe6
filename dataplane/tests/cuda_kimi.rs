//! Kimi-Linear (KDA + latent attention, `kimi_linear`) on the CUDA backend against
//! the CPU reference (issue 19, GPU part).
//!
//! The device tests are built only with `--features cuda`; without a usable CUDA
//! device each prints `skipped: …` and returns (it does not report a comparison it
//! could not make). One test runs everywhere: the chunked kernel's algorithm
//! transcribed in Rust against the CPU references.
//!
//! * KDA kernels (`cuda::kda`): the per-token kernel and the chunked kernel (with its
//!   transition `T_C`) against the CPU `mixers::kda::{naive, chunk}` and against each
//!   other, around every chunk edge, at the fixture's head dim (16), the real one
//!   (128) and `dk ≠ dv`, with mild and strong decays; the bf16 instantiation on
//!   bf16-rounded inputs; the bf16 tensor-core chunked kernel (`kda::chunked_tc`, dk = dv
//!   = 128) against the per-token kernel (`kda_tc_matches_recurrent`).
//! * The whole model on the transformers golden fixture
//!   (`dataplane/tests/fixtures/golden/kimi_linear`: 3 KDA layers, 1 MLA layer, a
//!   dense first layer, sigmoid-routed grouped MoE with an ungated shared expert),
//!   uploaded from the CPU `Model` with the default FFN path (device router) and, in
//!   f32, also with the host-routed one: logits of every row at prompt lengths around the
//!   16-token and 64-token path edges and ≥ 200 (f32), final states, decode steps,
//!   span-split prefill, a host state uploaded mid-sequence, batched decode; bf16
//!   argmax and 16 greedy tokens.
//! * bf16 drift split by source (`kimi_bf16_rounding_split_with_qwen_control`): the
//!   bf16 GPU logits against the f32 CPU model and against the CPU model with the same
//!   bf16-rounded weights (`Model::round_projections`), for the fixture, a random Kimi
//!   model, and as the control the Qwen3.5 fixture and a random Qwen3.5-MoE model of
//!   Kimi's size; the activation part (GPU against rounded weights) is asserted.
//! * The GPU PIC engine against the CPU engine in every mode (full, prefix, naive,
//!   HYPIC at w = 8 and with covering seams), and HYPIC with covering seams against
//!   full recompute on the GPU itself.
//!
//! Error metric (as tests/cuda_model.rs): `max|gpu − cpu| / max(1, max|cpu|)`.
//!
//! Paths: the repository root is `$HYPIC_REPO_ROOT`, else the current folder or its
//! parent when it holds `dataplane/tests/fixtures`, else the build-time checkout.

/// The algorithm of `kda_chunked_*` (kernels/kda.cu) transcribed loop for loop in
/// Rust, checked against the CPU reference recurrence and the CPU chunked `T_C`: the
/// kernel's math without a device (runs with or without `--features cuda`).
mod kernel_algorithm {
    use dataplane::mixers::gated_deltanet::GdrDims;
    use dataplane::mixers::kda::{chunk as cpu_chunk, naive as cpu_naive};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// `kda_chunked_impl` for every head: returns (o, T) and advances `state`.
    #[allow(clippy::too_many_arguments)]
    fn kernel(
        d: &GdrDims,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        state: &mut [f32],
        chunk: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let GdrDims { t, hk, hv, dk, dv } = *d;
        let mut out = vec![0f32; t * hv * dv];
        let mut trans = vec![0f32; hv * dk * dk];
        for h in 0..hv {
            for i in 0..dk {
                trans[(h * dk + i) * dk + i] = 1.0;
            }
        }
        for h in 0..hv {
            let kh = h / (hv / hk);
            let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
            let tm = &mut trans[h * dk * dk..(h + 1) * dk * dk];
            let qa = |ti: usize, a: usize| q[(ti * hk + kh) * dk + a];
            let ka = |ti: usize, a: usize| k[(ti * hk + kh) * dk + a];
            let mut c0 = 0;
            while c0 < t {
                let n = chunk.min(t - c0);
                let mut gam = vec![0f32; n * dk];
                for a in 0..dk {
                    let mut cum = 0f32;
                    for i in 0..n {
                        cum += g[((c0 + i) * hv + h) * dk + a];
                        gam[i * dk + a] = cum;
                    }
                }
                let (mut am, mut qk) = (vec![0f32; n * n], vec![0f32; n * n]);
                for i in 0..n {
                    for j in 0..=i {
                        let (mut sq, mut sk) = (0f32, 0f32);
                        for a in 0..dk {
                            let w = ka(c0 + j, a) * (gam[i * dk + a] - gam[j * dk + a]).exp();
                            sq += qa(c0 + i, a) * w;
                            sk += ka(c0 + i, a) * w;
                        }
                        qk[i * n + j] = sq;
                        if j < i {
                            am[i * n + j] = -beta[(c0 + i) * hv + h] * sk;
                        }
                    }
                }
                let (mut u, mut w) = (vec![0f32; n * dv], vec![0f32; n * dk]);
                for col in 0..dv + dk {
                    for i in 0..n {
                        let b = beta[(c0 + i) * hv + h];
                        if col < dv {
                            let mut acc = b * v[((c0 + i) * hv + h) * dv + col];
                            for j in 0..i {
                                acc += am[i * n + j] * u[j * dv + col];
                            }
                            u[i * dv + col] = acc;
                        } else {
                            let a = col - dv;
                            let mut acc = b * ka(c0 + i, a) * gam[i * dk + a].exp();
                            for j in 0..i {
                                acc += am[i * n + j] * w[j * dk + a];
                            }
                            w[i * dk + a] = acc;
                        }
                    }
                }
                for i in 0..n {
                    for c in 0..dv {
                        let x: f32 = (0..dk).map(|a| w[i * dk + a] * s[a * dv + c]).sum();
                        u[i * dv + c] -= x;
                    }
                }
                for i in 0..n {
                    for c in 0..dv {
                        let mut o = 0f32;
                        for a in 0..dk {
                            o += qa(c0 + i, a) * gam[i * dk + a].exp() * s[a * dv + c];
                        }
                        for j in 0..=i {
                            o += qk[i * n + j] * u[j * dv + c];
                        }
                        out[((c0 + i) * hv + h) * dv + c] = o;
                    }
                }
                let last = gam[(n - 1) * dk..n * dk].to_vec();
                for a in 0..dk {
                    for c in 0..dv {
                        let mut x = last[a].exp() * s[a * dv + c];
                        for j in 0..n {
                            x += ka(c0 + j, a) * (last[a] - gam[j * dk + a]).exp() * u[j * dv + c];
                        }
                        s[a * dv + c] = x;
                    }
                }
                let mut tc = vec![0f32; dk * dk];
                for a in 0..dk {
                    for b in 0..dk {
                        let mut x = 0f32;
                        for j in 0..n {
                            x += ka(c0 + j, a) * (last[a] - gam[j * dk + a]).exp() * w[j * dk + b];
                        }
                        tc[a * dk + b] = if a == b { last[a].exp() } else { 0.0 } - x;
                    }
                }
                let mut tn = vec![0f32; dk * dk];
                for a in 0..dk {
                    for b in 0..dk {
                        tn[a * dk + b] = (0..dk).map(|x| tc[a * dk + x] * tm[x * dk + b]).sum();
                    }
                }
                tm.copy_from_slice(&tn);
                c0 += n;
            }
        }
        (out, trans)
    }

    fn max_err(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    #[test]
    fn chunked_kernel_algorithm_matches_the_cpu_references() {
        for (t, hk, hv, dk, dv, g_lo, chunk) in [
            (70, 2, 2, 16, 16, -1.0f32, 64),
            (70, 1, 2, 8, 12, -6.0, 16),
            (9, 2, 2, 16, 16, -0.5, 4),
        ] {
            let d = GdrDims { t, hk, hv, dk, dv };
            let mut rng = StdRng::seed_from_u64(t as u64 + dk as u64);
            let mut u = |n: usize, a: f32, b: f32| -> Vec<f32> {
                (0..n).map(|_| rng.random_range(a..b)).collect()
            };
            let mut q = u(t * hk * dk, -1.0, 1.0);
            let mut k = u(t * hk * dk, -1.0, 1.0);
            for x in [&mut q, &mut k] {
                for row in x.chunks_exact_mut(dk) {
                    let r = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
                    row.iter_mut().for_each(|v| *v *= r);
                }
            }
            q.iter_mut().for_each(|x| *x *= (dk as f32).powf(-0.5));
            let v = u(t * hv * dv, -1.0, 1.0);
            let g = u(t * hv * dk, g_lo, 0.0);
            let beta = u(t * hv, 0.05, 0.95);
            let s0 = u(hv * dk * dv, -0.5, 0.5);
            let mut s_ref = s0.clone();
            let o_ref = cpu_naive::recurrent(&d, &q, &k, &v, &g, &beta, &mut s_ref);
            let mut s_c = s0.clone();
            let (_, t_ref) =
                cpu_chunk::chunked_with_transition(&d, &q, &k, &v, &g, &beta, &mut s_c, chunk);
            let mut s = s0.clone();
            let (o, tr) = kernel(&d, &q, &k, &v, &g, &beta, &mut s, chunk);
            let label = format!("T {t} Hk {hk} Hv {hv} dk {dk} dv {dv} chunk {chunk}");
            assert!(
                max_err(&o, &o_ref) < 1e-5,
                "{label}: o {}",
                max_err(&o, &o_ref)
            );
            assert!(
                max_err(&s, &s_ref) < 1e-5,
                "{label}: S {}",
                max_err(&s, &s_ref)
            );
            assert!(
                max_err(&tr, &t_ref) < 1e-5,
                "{label}: T {}",
                max_err(&tr, &t_ref)
            );
        }
    }
}

#[cfg(feature = "cuda")]
#[path = "common/bf16_split.rs"]
mod bf16_split;

#[cfg(feature = "cuda")]
mod gpu {
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

    use cudarc::cublas::{CudaBlas, Gemm};
    use dataplane::cuda::model::{FfnPath, GpuModel};
    use dataplane::cuda::pic::GpuPicEngine;
    use dataplane::cuda::{kda, Elem, Gpu};
    use dataplane::mixers::gated_deltanet::GdrDims;
    use dataplane::mixers::kda::{chunk as cpu_chunk, naive as cpu_naive};
    use dataplane::model::{Logits, Model};
    use dataplane::pic::{Mode, PicEngine, SegmentRef};
    use dataplane::sampling::argmax;
    use dataplane::state::{LayerState, ModelState};
    use half::bf16;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// f32 bound on logits (max-relative) of the GPU model against the CPU.
    const F32_TOL: f64 = 3e-5;
    /// f32 bound on states and on the kernels' outputs.
    const F32_STATE_TOL: f64 = 1e-4;
    /// f32 bounds of the PIC comparisons (as tests/cuda_pic.rs: composed states and
    /// seams accumulate more rounding than one prefill).
    const PIC_TOL: f64 = 1e-4;
    const PIC_STATE_TOL: f64 = 1e-3;
    /// Two device paths that should agree to the last bit; a bound of rounding noise,
    /// so a reordered reduction is reported with its size rather than as a failure.
    const SAME_TOL: f64 = 1e-6;
    /// Prompt lengths: around the recurrent/chunked switch (16) and the chunk (64),
    /// and past 200.
    const LENGTHS: [usize; 13] = [1, 3, 15, 16, 17, 63, 64, 65, 128, 129, 200, 257, 300];
    const GREEDY: usize = 16;
    const KIMI: &str = "kimi_linear";

    /// The device, opened once, or why there is none (then each test prints
    /// `skipped: …`). The lock serialises tests on the one stream.
    fn gpu(test: &str) -> Option<(Arc<Gpu>, MutexGuard<'static, ()>)> {
        static G: OnceLock<std::result::Result<Arc<Gpu>, String>> = OnceLock::new();
        static L: Mutex<()> = Mutex::new(());
        let guard = L.lock().unwrap_or_else(|e| e.into_inner());
        let g = G.get_or_init(|| match std::panic::catch_unwind(|| Gpu::new(0)) {
            Ok(Ok(g)) => {
                println!("cuda_kimi: device {} ({})", g.name(), g.arch());
                Ok(g)
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("panic while loading the CUDA libraries".into()),
        });
        match g {
            Ok(g) => Some((g.clone(), guard)),
            Err(e) => {
                println!("{test}: skipped: no usable CUDA device ({e})");
                None
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

    fn kimi_model() -> Arc<Model> {
        static M: OnceLock<Arc<Model>> = OnceLock::new();
        M.get_or_init(|| {
            let dir = repo_root()
                .join("dataplane/tests/fixtures/golden")
                .join(KIMI);
            Arc::new(Model::load(&dir, &mut |_, _| {}).expect("kimi_linear fixture loads"))
        })
        .clone()
    }

    /// The model on the device with the default FFN path (device routing by the
    /// sigmoid rule with selection bias and groups, grouped expert GEMMs).
    fn upload<T: Elem>(gpu: &Arc<Gpu>, m: &Model) -> Arc<GpuModel<T>>
    where
        CudaBlas: Gemm<T>,
    {
        upload_with(gpu, m, FfnPath::Fused)
    }

    fn upload_with<T: Elem>(gpu: &Arc<Gpu>, m: &Model, path: FfnPath) -> Arc<GpuModel<T>>
    where
        CudaBlas: Gemm<T>,
    {
        Arc::new(GpuModel::<T>::upload_with(gpu.clone(), m, path).expect("kimi_linear uploads"))
    }

    /// `max|a − b| / max(1, max|b|)` (b the reference).
    fn err(a: &[f32], b: &[f32]) -> f64 {
        assert_eq!(a.len(), b.len(), "lengths differ");
        let scale = b.iter().fold(1f64, |m, x| m.max(x.abs() as f64));
        let d = a
            .iter()
            .zip(b)
            .fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
        if a.iter().any(|x| !x.is_finite()) {
            return f64::INFINITY;
        }
        d / scale
    }

    /// Failures collected over one test, so that one GPU run reports all of them.
    /// Each check is printed only when it fails (or with `HYPIC_VERBOSE=1`); the
    /// summary names the check closest to its bound.
    struct Report {
        test: &'static str,
        failures: Vec<String>,
        checks: usize,
        /// (check, error, bound) with the largest error / bound so far.
        tightest: Option<(String, f64, f64)>,
        /// Largest error per kind of check (the check's name without numbers and
        /// PIC phases), in first-seen order.
        worst: Vec<(String, f64, f64)>,
        verbose: bool,
    }

    /// The kind of a check: its name without digits and PIC phase words.
    fn kind_of(what: &str) -> String {
        let s: String = what.chars().filter(|c| !c.is_ascii_digit()).collect();
        let s = [" cold:", " reordered:", " hot:"]
            .iter()
            .fold(s, |a, p| a.replace(p, ":"));
        s.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    impl Report {
        fn new(test: &'static str) -> Self {
            Report {
                test,
                failures: vec![],
                checks: 0,
                tightest: None,
                worst: vec![],
                verbose: std::env::var("HYPIC_VERBOSE").is_ok_and(|v| v == "1"),
            }
        }
        fn check(&mut self, what: String, e: f64, tol: f64) {
            self.checks += 1;
            let ok = e <= tol;
            if self.verbose || !ok {
                println!(
                    "  {what}: {e:.3e} (tol {tol:.0e}) {}",
                    if ok { "ok" } else { "FAIL" }
                );
            }
            let ratio = |e: f64, t: f64| if t > 0.0 { e / t } else { e * 1e30 };
            if self
                .tightest
                .as_ref()
                .is_none_or(|(_, te, tt)| ratio(e, tol) > ratio(*te, *tt))
            {
                self.tightest = Some((what.clone(), e, tol));
            }
            let kind = kind_of(&what);
            match self.worst.iter_mut().find(|w| w.0 == kind) {
                Some(w) => {
                    if e > w.1 {
                        w.1 = e;
                    }
                }
                None => self.worst.push((kind, e, tol)),
            }
            if !ok {
                self.failures.push(format!("{what}: {e:.3e} > {tol:.0e}"));
            }
        }
        fn fail(&mut self, m: String) {
            println!("  FAIL {m}");
            self.failures.push(m);
        }
        fn finish(self) {
            let tight = self
                .tightest
                .as_ref()
                .map(|(w, e, t)| format!("; closest to its bound: {w}: {e:.2e} (tol {t:.0e})"))
                .unwrap_or_default();
            println!(
                "{}: {} checks, {} failed{tight}",
                self.test,
                self.checks,
                self.failures.len()
            );
            for (k, e, t) in &self.worst {
                println!("  worst {k}: {e:.2e} (tol {t:.0e})");
            }
            assert!(
                self.failures.is_empty(),
                "{}: {} failure(s):\n{}",
                self.test,
                self.failures.len(),
                self.failures.join("\n")
            );
        }
    }

    /// Recurrence inputs as the CPU tests make them: q, k L2-normalised (q scaled),
    /// v in [−1, 1), g in [g_lo, 0] per channel, β in (0.05, 0.95), a random state.
    struct Case {
        d: GdrDims,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
        s0: Vec<f32>,
    }

    fn case(d: GdrDims, g_lo: f32, seed: u64) -> Case {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut u = |n: usize, a: f32, b: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(a..b)).collect()
        };
        let mut q = u(d.t * d.hk * d.dk, -1.0, 1.0);
        let mut k = u(d.t * d.hk * d.dk, -1.0, 1.0);
        for x in [&mut q, &mut k] {
            for row in x.chunks_exact_mut(d.dk) {
                let r = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
                row.iter_mut().for_each(|v| *v *= r);
            }
        }
        let scale = (d.dk as f32).powf(-0.5);
        q.iter_mut().for_each(|v| *v *= scale);
        Case {
            q,
            k,
            v: u(d.t * d.hv * d.dv, -1.0, 1.0),
            g: u(d.t * d.hv * d.dk, g_lo, 0.0),
            beta: u(d.t * d.hv, 0.05, 0.95),
            s0: u(d.hv * d.dk * d.dv, -0.5, 0.5),
            d,
        }
    }

    fn round_bf16(v: &[f32]) -> Vec<f32> {
        v.iter().map(|x| bf16::from_f32(*x).to_f32()).collect()
    }

    /// GPU kernel run: (output, final state, transition when asked).
    fn gpu_run<T: Elem>(
        gpu: &Gpu,
        c: &Case,
        chunked: Option<usize>,
        with_t: bool,
    ) -> dataplane::cuda::Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let d = &c.d;
        let up = |v: &[f32]| gpu.upload(&v.iter().map(|x| T::from_f32(*x)).collect::<Vec<T>>());
        let (q, k, v) = (up(&c.q)?, up(&c.k)?, up(&c.v)?);
        let (g, beta) = (gpu.upload(&c.g)?, gpu.upload(&c.beta)?);
        let mut s = gpu.upload(&c.s0)?;
        let mut o = gpu.zeros::<T>(d.t * d.hv * d.dv)?;
        let mut tr = None;
        match chunked {
            None => kda::recurrent(gpu, d, &q, &k, &v, &g, &beta, &mut s, &mut o)?,
            Some(ch) => {
                let mut eye = vec![0f32; d.hv * d.dk * d.dk];
                for h in 0..d.hv {
                    for i in 0..d.dk {
                        eye[(h * d.dk + i) * d.dk + i] = 1.0;
                    }
                }
                let mut t = gpu.upload(&eye)?;
                kda::chunked(
                    gpu,
                    d,
                    &q,
                    &k,
                    &v,
                    &g,
                    &beta,
                    &mut s,
                    &mut o,
                    with_t.then_some(&mut t),
                    ch,
                )?;
                tr = Some(t);
            }
        }
        let out: Vec<f32> = gpu.download(&o)?.into_iter().map(Elem::to_f32).collect();
        let st = gpu.download(&s)?;
        let t = match (tr, with_t) {
            (Some(t), true) => gpu.download(&t)?,
            _ => vec![],
        };
        Ok((out, st, t))
    }

    /// The per-token and the chunked KDA kernels against the CPU naive recurrence
    /// and chunked `T_C`, and against each other, around every chunk edge.
    #[test]
    fn kda_kernels_match_cpu_and_each_other() {
        let Some((gpu, _l)) = gpu("kda_kernels_match_cpu_and_each_other") else {
            return;
        };
        let mut rep = Report::new("kda_kernels_match_cpu_and_each_other");
        let shapes = [(4, 4, 16, 16), (2, 2, 128, 128), (1, 2, 32, 64)];
        let lens = [1usize, 5, 16, 63, 64, 65, 129, 200];
        for (si, &(hk, hv, dk, dv)) in shapes.iter().enumerate() {
            for &t in &lens {
                for g_lo in [-1.0f32, -8.0] {
                    let d = GdrDims { t, hk, hv, dk, dv };
                    let c = case(d, g_lo, (si * 1000 + t) as u64);
                    let label = format!("Hk {hk} Hv {hv} dk {dk} dv {dv} T {t} g≥{g_lo}");
                    let mut s_ref = c.s0.clone();
                    let o_ref =
                        cpu_naive::recurrent(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s_ref);
                    let mut s_c = c.s0.clone();
                    let (_, t_ref) = cpu_chunk::chunked_with_transition(
                        &d,
                        &c.q,
                        &c.k,
                        &c.v,
                        &c.g,
                        &c.beta,
                        &mut s_c,
                        cpu_chunk::KDA_CHUNK,
                    );
                    let rec = gpu_run::<f32>(&gpu, &c, None, false);
                    let chk = gpu_run::<f32>(&gpu, &c, Some(kda::CHUNK), true);
                    let (rec, chk) = match (rec, chk) {
                        (Ok(a), Ok(b)) => (a, b),
                        (Err(e), _) | (_, Err(e)) => {
                            rep.fail(format!("{label}: kernel error {e}"));
                            continue;
                        }
                    };
                    rep.check(
                        format!("{label} recurrent o vs CPU naive"),
                        err(&rec.0, &o_ref),
                        F32_STATE_TOL,
                    );
                    rep.check(
                        format!("{label} recurrent S vs CPU naive"),
                        err(&rec.1, &s_ref),
                        F32_STATE_TOL,
                    );
                    rep.check(
                        format!("{label} chunked o vs CPU naive"),
                        err(&chk.0, &o_ref),
                        F32_STATE_TOL,
                    );
                    rep.check(
                        format!("{label} chunked S vs CPU naive"),
                        err(&chk.1, &s_ref),
                        F32_STATE_TOL,
                    );
                    rep.check(
                        format!("{label} chunked o vs recurrent kernel"),
                        err(&chk.0, &rec.0),
                        F32_STATE_TOL,
                    );
                    rep.check(
                        format!("{label} chunked T_C vs CPU chunked"),
                        err(&chk.2, &t_ref),
                        F32_STATE_TOL,
                    );
                    // The chunked kernel without the transition gives the same output.
                    match gpu_run::<f32>(&gpu, &c, Some(kda::CHUNK), false) {
                        Ok(plain) => {
                            if plain.0 != chk.0 || plain.1 != chk.1 {
                                rep.fail(format!("{label}: chunked with and without T_C differ"));
                            }
                        }
                        Err(e) => rep.fail(format!("{label}: chunked without T_C: {e}")),
                    }
                }
            }
        }
        // Small chunks: many chunk boundaries in one span.
        let d = GdrDims {
            t: 77,
            hk: 4,
            hv: 4,
            dk: 16,
            dv: 16,
        };
        let c = case(d, -2.0, 5);
        let mut s_ref = c.s0.clone();
        let o_ref = cpu_naive::recurrent(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s_ref);
        for ch in [1usize, 7, 16] {
            match gpu_run::<f32>(&gpu, &c, Some(ch), true) {
                Ok((o, s, _)) => {
                    rep.check(
                        format!("chunk {ch}: o vs CPU naive"),
                        err(&o, &o_ref),
                        F32_STATE_TOL,
                    );
                    rep.check(
                        format!("chunk {ch}: S vs CPU naive"),
                        err(&s, &s_ref),
                        F32_STATE_TOL,
                    );
                }
                Err(e) => rep.fail(format!("chunk {ch}: {e}")),
            }
        }
        // bf16 instantiation on bf16-rounded inputs (state fp32, output rounded).
        let d = GdrDims {
            t: 130,
            hk: 2,
            hv: 2,
            dk: 128,
            dv: 128,
        };
        let mut c = case(d, -1.0, 9);
        c.q = round_bf16(&c.q);
        c.k = round_bf16(&c.k);
        c.v = round_bf16(&c.v);
        let mut s_ref = c.s0.clone();
        let o_ref = cpu_naive::recurrent(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s_ref);
        for (name, ch) in [("recurrent", None), ("chunked", Some(kda::CHUNK))] {
            match gpu_run::<bf16>(&gpu, &c, ch, false) {
                Ok((o, s, _)) => {
                    rep.check(
                        format!("bf16 {name}: o vs CPU naive"),
                        err(&o, &o_ref),
                        1e-2,
                    );
                    rep.check(
                        format!("bf16 {name}: S vs CPU naive"),
                        err(&s, &s_ref),
                        F32_STATE_TOL,
                    );
                }
                Err(e) => rep.fail(format!("bf16 {name}: {e}")),
            }
        }
        rep.finish();
    }

    /// Relative L2 error `‖a − b‖ / ‖b‖` (the metric of tools/kernel-emu `kda-tc`);
    /// infinite when `a` has a non-finite entry.
    fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
        assert_eq!(a.len(), b.len(), "lengths differ");
        if a.iter().any(|x| !x.is_finite()) {
            return f64::INFINITY;
        }
        let (mut num, mut den) = (0f64, 0f64);
        for (x, y) in a.iter().zip(b) {
            let (x, y) = (*x as f64, *y as f64);
            num += (x - y) * (x - y);
            den += y * y;
        }
        (num / den.max(1e-300)).sqrt()
    }

    /// [`kda::chunked_tc`] run on a case (bf16 inputs): (output, final state).
    fn gpu_run_tc(gpu: &Gpu, c: &Case) -> dataplane::cuda::Result<(Vec<f32>, Vec<f32>)> {
        let d = &c.d;
        let up = |v: &[f32]| gpu.upload(&v.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>());
        let (q, k, v) = (up(&c.q)?, up(&c.k)?, up(&c.v)?);
        let (g, beta) = (gpu.upload(&c.g)?, gpu.upload(&c.beta)?);
        let mut s = gpu.upload(&c.s0)?;
        let mut o = gpu.zeros::<bf16>(d.t * d.hv * d.dv)?;
        kda::chunked_tc(gpu, d, &q, &k, &v, &g, &beta, &mut s, &mut o)?;
        let out: Vec<f32> = gpu.download(&o)?.into_iter().map(Elem::to_f32).collect();
        Ok((out, gpu.download(&s)?))
    }

    /// The tensor-core chunked KDA (`kda::chunked_tc`, kernels/kda_tc.cu) against the
    /// per-token kernel (`kda::recurrent`) on the same bf16 inputs and fp32 initial
    /// state, around every chunk and sub-chunk edge and at T = 1000, 4096 and 4200 (two slabs of `kda::TC_SLAB`), Hk = Hv = 2
    /// and Hk = 1 < Hv = 2, with mild decays (g in [−0.1, 0]), mixed ones (10% of the
    /// entries −5) and strong ones (g in [−8, 0]).
    ///
    /// Bounds: in the host emulation (tools/kernel-emu `kda-tc`, T ≤ 1000) the kernels
    /// are within 3.6e-3 (relative L2) of the fp64 recurrence on output and state, and
    /// within 6e-4 (output) / 2.1e-3 (state) in the max-relative metric of [`err`]; the
    /// per-token kernel adds its own bf16 output rounding. The bounds below leave about
    /// 2.5× of that.
    #[test]
    fn kda_tc_matches_recurrent() {
        let Some((gpu, _l)) = gpu("kda_tc_matches_recurrent") else {
            return;
        };
        const TC_L2_TOL: f64 = 1e-2;
        const TC_MAX_TOL: f64 = 5e-3;
        let mut rep = Report::new("kda_tc_matches_recurrent");
        let lens = [
            1usize, 15, 16, 17, 63, 64, 65, 128, 200, 300, 1000, 4096, 4200,
        ];
        for (si, &(hk, hv)) in [(2usize, 2usize), (1, 2)].iter().enumerate() {
            for &t in &lens {
                for (di, decay) in ["mild", "mixed", "strong"].into_iter().enumerate() {
                    let d = GdrDims {
                        t,
                        hk,
                        hv,
                        dk: 128,
                        dv: 128,
                    };
                    let g_lo = if decay == "strong" { -8.0 } else { -0.1 };
                    let mut c = case(d, g_lo, (si * 100_000 + di * 10_000 + t) as u64);
                    if decay == "mixed" {
                        let mut rng = StdRng::seed_from_u64(t as u64 + 7);
                        for x in c.g.iter_mut() {
                            if rng.random_range(0.0f32..1.0) < 0.1 {
                                *x = -5.0;
                            }
                        }
                    }
                    c.q = round_bf16(&c.q);
                    c.k = round_bf16(&c.k);
                    c.v = round_bf16(&c.v);
                    let label = format!("Hk {hk} Hv {hv} T {t} {decay}");
                    let (rec, tc) =
                        match (gpu_run::<bf16>(&gpu, &c, None, false), gpu_run_tc(&gpu, &c)) {
                            (Ok(a), Ok(b)) => (a, b),
                            (Err(e), _) | (_, Err(e)) => {
                                rep.fail(format!("{label}: kernel error {e}"));
                                continue;
                            }
                        };
                    rep.check(
                        format!("{label} o rel-L2"),
                        rel_l2(&tc.0, &rec.0),
                        TC_L2_TOL,
                    );
                    rep.check(
                        format!("{label} S rel-L2"),
                        rel_l2(&tc.1, &rec.1),
                        TC_L2_TOL,
                    );
                    rep.check(format!("{label} o max-rel"), err(&tc.0, &rec.0), TC_MAX_TOL);
                    rep.check(format!("{label} S max-rel"), err(&tc.1, &rec.1), TC_MAX_TOL);
                }
            }
        }
        // Outside its domain it refuses instead of computing something else.
        let c = case(
            GdrDims {
                t: 8,
                hk: 1,
                hv: 1,
                dk: 64,
                dv: 64,
            },
            -0.1,
            3,
        );
        if gpu_run_tc(&gpu, &c).is_ok() {
            rep.fail("chunked_tc accepted dk = dv = 64".into());
        }
        rep.finish();
    }

    fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
    }

    /// Per-layer errors of two host states (recurrent, conv tail, KV).
    fn state_err(g: &ModelState, c: &ModelState) -> Vec<(String, f64)> {
        let mut v = vec![];
        for (i, (a, b)) in g.layers.iter().zip(&c.layers).enumerate() {
            match (a, b) {
                (LayerState::Linear(a), LayerState::Linear(b)) => {
                    v.push((
                        format!("layer {i} KDA state"),
                        err(&a.recurrent, &b.recurrent),
                    ));
                    v.push((format!("layer {i} conv tail"), err(&a.conv, &b.conv)));
                }
                (LayerState::Full(a), LayerState::Full(b)) => {
                    if a.positions != b.positions {
                        v.push((format!("layer {i} KV positions"), f64::INFINITY));
                    } else {
                        v.push((format!("layer {i} MLA rows (K)"), err(&a.k, &b.k)));
                        v.push((format!("layer {i} MLA rows (V)"), err(&a.v, &b.v)));
                    }
                }
                _ => v.push((format!("layer {i} kind"), f64::INFINITY)),
            }
        }
        v
    }

    /// f32: logits of every row and the final states at every prompt length, then
    /// decode steps; bf16: argmax within a near tie of the CPU model with the same
    /// bf16-rounded weights (`Model::round_projections`: rounding the weights alone
    /// moves argmaxes of this fixture, which is not what this checks) on at least
    /// [`BF16_ARGMAX_MIN`] of the rows pooled and [`BF16_ARGMAX_MIN_PER_LENGTH`] at each
    /// length.
    #[test]
    fn model_matches_cpu_at_prompt_lengths() {
        let Some((gpu, _l)) = gpu("model_matches_cpu_at_prompt_lengths") else {
            return;
        };
        let mut rep = Report::new("model_matches_cpu_at_prompt_lengths");
        let m = kimi_model();
        let vocab = m.config.vocab_size;
        let g32 = upload::<f32>(&gpu, &m);
        let g32h = upload_with::<f32>(&gpu, &m, FfnPath::HostRouted);
        let g16 = upload::<bf16>(&gpu, &m);
        let mut mr = Model::load(
            &repo_root()
                .join("dataplane/tests/fixtures/golden")
                .join(KIMI),
            &mut |_, _| {},
        )
        .expect("kimi_linear fixture loads");
        mr.round_projections(|x| bf16::from_f32(x).to_f32());
        let (mut agree, mut rows) = (0usize, 0usize);
        for &n in &LENGTHS {
            let toks = tokens(n, n as u64, vocab);
            let mut cs = m.new_state();
            let cpu = m.prefill(&toks, &mut cs, Logits::All).unwrap().logits;
            let mut gs = g32.new_state().unwrap();
            match g32.prefill(&toks, &mut gs, Logits::All) {
                Ok(l) => rep.check(
                    format!("f32 T {n}: logits (all rows)"),
                    err(&l, &cpu),
                    F32_TOL,
                ),
                Err(e) => {
                    rep.fail(format!("f32 T {n}: prefill: {e}"));
                    continue;
                }
            }
            let mut hs = g32h.new_state().unwrap();
            match g32h.prefill(&toks, &mut hs, Logits::All) {
                Ok(l) => rep.check(
                    format!("f32 host-routed FFN T {n}: logits (all rows)"),
                    err(&l, &cpu),
                    F32_TOL,
                ),
                Err(e) => rep.fail(format!("f32 host-routed T {n}: prefill: {e}")),
            }
            match gs.to_host() {
                Ok(h) => {
                    for (what, e) in state_err(&h, &cs) {
                        rep.check(format!("f32 T {n}: {what}"), e, F32_STATE_TOL);
                    }
                }
                Err(e) => rep.fail(format!("f32 T {n}: to_host: {e}")),
            }
            // Four decode steps from there.
            let mut tok = argmax(&cpu[(n - 1) * vocab..]);
            for step in 0..4 {
                let c = m.decode(tok, &mut cs).unwrap();
                match g32.decode(tok, &mut gs) {
                    Ok(g) => rep.check(
                        format!("f32 T {n}: decode step {step}"),
                        err(&g, &c),
                        F32_TOL,
                    ),
                    Err(e) => rep.fail(format!("f32 T {n}: decode: {e}")),
                }
                tok = argmax(&c);
            }
            let mut bs = g16.new_state().unwrap();
            let cpu = mr
                .prefill(&toks, &mut mr.new_state(), Logits::All)
                .unwrap()
                .logits;
            match g16.prefill(&toks, &mut bs, Logits::All) {
                Ok(l) => {
                    let (mut same, mut ties) = (0, 0);
                    for r in 0..n {
                        let (a, b) = (
                            &l[r * vocab..(r + 1) * vocab],
                            &cpu[r * vocab..(r + 1) * vocab],
                        );
                        if argmax(a) == argmax(b) {
                            same += 1;
                        } else if b[argmax(a) as usize]
                            >= b[argmax(b) as usize] - 0.05 * gap_scale(b)
                        {
                            ties += 1;
                        }
                    }
                    println!(
                        "  bf16 T {n}: argmax equal to the rounded-weights CPU on {same}/{n} rows ({ties} near ties), logits err {:.3e}",
                        err(&l, &cpu)
                    );
                    // Per length a floor (a bug confined to some lengths), pooled the
                    // bound (flips away from near ties are MoE top-k selections that
                    // move at a near tie of the router, which the logits do not show).
                    let frac = (same + ties) as f64 / n as f64;
                    if frac < BF16_ARGMAX_MIN_PER_LENGTH {
                        rep.fail(format!(
                            "bf16 T {n}: argmax agrees (or nearly ties) on {frac:.3} of the rows \
                             (min {BF16_ARGMAX_MIN_PER_LENGTH})"
                        ));
                    }
                    agree += same + ties;
                    rows += n;
                }
                Err(e) => rep.fail(format!("bf16 T {n}: prefill: {e}")),
            }
        }
        let frac = agree as f64 / rows.max(1) as f64;
        println!(
            "  bf16 pooled: argmax agrees (or nearly ties) on {agree}/{rows} rows ({frac:.3})"
        );
        if frac < BF16_ARGMAX_MIN {
            rep.fail(format!(
                "bf16 pooled: argmax agrees (or nearly ties) on {frac:.3} of the rows (min {BF16_ARGMAX_MIN})"
            ));
        }
        rep.finish();
    }

    /// Least fraction of rows, pooled over the prompt lengths, whose bf16 GPU argmax
    /// equals (or nearly ties) the argmax of the CPU model with the same bf16-rounded
    /// weights; the Qwen3.5 control agrees on about 0.95 of its rows by the stricter
    /// measure of `bf16_split` (no near ties counted).
    const BF16_ARGMAX_MIN: f64 = 0.9;
    /// Its floor at one prompt length.
    const BF16_ARGMAX_MIN_PER_LENGTH: f64 = 0.75;

    /// `max(1, max|l|)`: the scale of a near tie.
    fn gap_scale(l: &[f32]) -> f32 {
        l.iter().fold(1f32, |a, x| a.max(x.abs()))
    }

    /// Greedy 16 tokens after a 200-token prompt: f32 and bf16 against the CPU (a
    /// difference after a near tie of the CPU's logits is reported, not failed).
    #[test]
    fn greedy_tokens_match_cpu() {
        let Some((gpu, _l)) = gpu("greedy_tokens_match_cpu") else {
            return;
        };
        let mut rep = Report::new("greedy_tokens_match_cpu");
        let m = kimi_model();
        let vocab = m.config.vocab_size;
        let toks = tokens(200, 77, vocab);
        let mut cs = m.new_state();
        let mut l = m.prefill(&toks, &mut cs, Logits::Last).unwrap().logits;
        let mut cpu = vec![];
        for _ in 0..GREEDY {
            let t = argmax(&l);
            let mut s = l.clone();
            s.sort_by(|a, b| b.total_cmp(a));
            cpu.push((t, (s[0] - s[1]) / gap_scale(&l)));
            l = m.decode(t, &mut cs).unwrap();
        }
        fn run<T: Elem>(
            g: &GpuModel<T>,
            toks: &[u32],
            n: usize,
        ) -> dataplane::cuda::Result<Vec<u32>>
        where
            CudaBlas: Gemm<T>,
        {
            let mut s = g.new_state()?;
            let mut l = g.prefill(toks, &mut s, Logits::Last)?;
            let mut out = vec![];
            for _ in 0..n {
                let t = argmax(&l);
                out.push(t);
                l = g.decode(t, &mut s)?;
            }
            Ok(out)
        }
        let ct: Vec<u32> = cpu.iter().map(|x| x.0).collect();
        for (name, got, tie) in [
            ("f32", run(&upload::<f32>(&gpu, &m), &toks, GREEDY), 1e-4f32),
            ("bf16", run(&upload::<bf16>(&gpu, &m), &toks, GREEDY), 0.05),
        ] {
            match got {
                Ok(g) => {
                    println!("  {name} greedy: cpu {ct:?} gpu {g:?}");
                    if let Some(i) = ct.iter().zip(&g).position(|(a, b)| a != b) {
                        if cpu[i].1 < tie {
                            println!(
                                "  {name}: differs at {i} after a near tie (gap {:.2e})",
                                cpu[i].1
                            );
                        } else {
                            rep.fail(format!(
                                "{name} greedy differs at step {i} (cpu gap {:.2e})",
                                cpu[i].1
                            ));
                        }
                    }
                }
                Err(e) => rep.fail(format!("{name}: {e}")),
            }
        }
        rep.finish();
    }

    /// A prefill split in spans (across the path edges) equals one shot; a host
    /// state uploaded mid-sequence continues as the CPU; a batched decode equals
    /// single decodes.
    #[test]
    fn spans_host_states_and_batched_decode() {
        let Some((gpu, _l)) = gpu("spans_host_states_and_batched_decode") else {
            return;
        };
        let mut rep = Report::new("spans_host_states_and_batched_decode");
        let m = kimi_model();
        let vocab = m.config.vocab_size;
        let g = upload::<f32>(&gpu, &m);
        let toks = tokens(230, 5, vocab);
        let mut one = g.new_state().unwrap();
        let whole = g.prefill(&toks, &mut one, Logits::Last).unwrap();
        let mut sp = g.new_state().unwrap();
        let mut last = vec![];
        let mut a = 0;
        for len in [1usize, 15, 16, 64, 3, 70, 61] {
            last = g.prefill(&toks[a..a + len], &mut sp, Logits::Last).unwrap();
            a += len;
        }
        assert_eq!(a, toks.len());
        rep.check(
            "spans vs one shot: logits".into(),
            err(&last, &whole),
            F32_TOL,
        );
        let (h1, h2) = (one.to_host().unwrap(), sp.to_host().unwrap());
        for (what, e) in state_err(&h2, &h1) {
            rep.check(format!("spans vs one shot: {what}"), e, F32_STATE_TOL);
        }
        // A CPU state after 100 tokens, uploaded, continued on the GPU.
        let mut cs = m.new_state();
        m.prefill(&toks[..100], &mut cs, Logits::None).unwrap();
        let mut gs = match g.state_from_host(&cs) {
            Ok(s) => s,
            Err(e) => {
                rep.fail(format!("from_host: {e}"));
                return rep.finish();
            }
        };
        match gs.to_host() {
            Ok(back) => {
                if back != cs {
                    rep.fail("from_host then to_host is not the identity in f32".into());
                }
            }
            Err(e) => rep.fail(format!("to_host: {e}")),
        }
        let c = m
            .prefill(&toks[100..], &mut cs, Logits::Last)
            .unwrap()
            .logits;
        match g.prefill(&toks[100..], &mut gs, Logits::Last) {
            Ok(l) => rep.check(
                "uploaded host state, continued: logits".into(),
                err(&l, &c),
                F32_TOL,
            ),
            Err(e) => rep.fail(format!("continue from host state: {e}")),
        }
        // Batched decode of two sequences = two single decodes.
        let mut s1 = one.try_clone().unwrap();
        let mut s2 = gs.try_clone().unwrap();
        let (mut r1, mut r2) = (one, gs);
        let t = [3u32, 99];
        match g.decode_batch(&t, &mut [&mut s1, &mut s2]) {
            Ok(b) => {
                let d1 = g.decode(t[0], &mut r1).unwrap();
                let d2 = g.decode(t[1], &mut r2).unwrap();
                rep.check(
                    "decode_batch row 0 vs decode".into(),
                    err(&b[0], &d1),
                    F32_TOL,
                );
                rep.check(
                    "decode_batch row 1 vs decode".into(),
                    err(&b[1], &d2),
                    F32_TOL,
                );
            }
            Err(e) => rep.fail(format!("decode_batch: {e}")),
        }
        rep.finish();
    }

    fn seg(rng: &mut StdRng, len: usize, vocab: u32) -> SegmentRef {
        SegmentRef {
            tokens: (0..len).map(|_| rng.random_range(0..vocab)).collect(),
            isolation: "t".into(),
        }
    }

    /// System prompt, documents across the 16- and 64-token edges, a query.
    fn prompt(seed: u64, docs: usize) -> Vec<SegmentRef> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut v = vec![seg(&mut rng, 24, 128)];
        for _ in 0..docs {
            let len = rng.random_range(12..90);
            v.push(seg(&mut rng, len, 128));
        }
        v.push(seg(&mut rng, 10, 128));
        v
    }

    /// The GPU PIC engine against the CPU engine in every mode (cold, reordered,
    /// hot), and HYPIC with covering seams against full recompute on the GPU.
    #[test]
    fn pic_modes_match_the_cpu_engine() {
        let Some((gpu, _l)) = gpu("pic_modes_match_the_cpu_engine") else {
            return;
        };
        let mut rep = Report::new("pic_modes_match_the_cpu_engine");
        let m = kimi_model();
        let g = upload::<f32>(&gpu, &m);
        let modes = [
            ("full", Mode::FullRecompute),
            ("prefix", Mode::PrefixCache),
            ("naive", Mode::NaiveAddition),
            ("hypic-w8", Mode::hypic_default()),
            (
                "hypic-w0",
                Mode::Hypic {
                    seam_width: 0,
                    rope_fix: true,
                },
            ),
            (
                "hypic-cover",
                Mode::Hypic {
                    seam_width: 1000,
                    rope_fix: true,
                },
            ),
        ];
        let cold = prompt(7, 4);
        let mut hot = cold.clone();
        hot[1..cold.len() - 1].reverse();
        for (name, mode) in modes {
            let cpu = PicEngine::new(m.clone(), KIMI, 1 << 30, 1 << 30);
            let gpe = GpuPicEngine::new(g.clone(), KIMI, 1 << 30, 1 << 30);
            for (phase, segs) in [("cold", &cold), ("reordered", &hot), ("hot", &hot)] {
                let c = cpu.run(segs, mode, "t");
                let r = gpe.run(segs, mode, "t");
                match (c, r) {
                    (Ok(c), Ok(r)) => {
                        rep.check(
                            format!("{name} {phase}: logits vs CPU engine"),
                            err(&r.logits, &c.logits),
                            PIC_TOL,
                        );
                        if r.stats != c.stats {
                            rep.fail(format!(
                                "{name} {phase}: stats cpu {:?} gpu {:?}",
                                c.stats, r.stats
                            ));
                        }
                        match r.state.to_host() {
                            Ok(h) => {
                                let worst = state_err(&h, &c.state)
                                    .into_iter()
                                    .fold(0f64, |a, (_, e)| a.max(e));
                                rep.check(
                                    format!("{name} {phase}: worst state vs CPU engine"),
                                    worst,
                                    PIC_STATE_TOL,
                                );
                            }
                            Err(e) => rep.fail(format!("{name} {phase}: to_host {e}")),
                        }
                    }
                    (Err(e), _) => rep.fail(format!("{name} {phase}: CPU {e}")),
                    (_, Err(e)) => rep.fail(format!("{name} {phase}: GPU {e}")),
                }
            }
        }
        // On the GPU alone: covering seams = full recompute, cold and warm.
        let p = prompt(4, 4);
        let gpe = GpuPicEngine::new(g.clone(), KIMI, 1 << 30, 1 << 30);
        let full = gpe.run(&p, Mode::FullRecompute, "t").unwrap();
        for pass in 0..2 {
            match gpe.run(
                &p,
                Mode::Hypic {
                    seam_width: 1000,
                    rope_fix: true,
                },
                "t",
            ) {
                Ok(h) => rep.check(
                    format!("GPU covering seams pass {pass} vs GPU full recompute"),
                    err(&h.logits, &full.logits),
                    F32_TOL,
                ),
                Err(e) => rep.fail(format!("covering seams pass {pass}: {e}")),
            }
        }
        // The bf16 engine (printed: its argmax and distance to the f32 engine).
        let g16 = upload::<bf16>(&gpu, &m);
        let gpe16 = GpuPicEngine::new(g16, KIMI, 1 << 30, 1 << 30);
        for (name, mode) in [
            ("full", Mode::FullRecompute),
            ("hypic-w8", Mode::hypic_default()),
        ] {
            let a = gpe.run(&p, mode, "t");
            let b = gpe16.run(&p, mode, "t");
            match (a, b) {
                (Ok(a), Ok(b)) => println!(
                    "  bf16 engine {name}: argmax {} (f32 {}), logits err {:.3e}",
                    argmax(&b.logits),
                    argmax(&a.logits),
                    err(&b.logits, &a.logits)
                ),
                (Err(e), _) | (_, Err(e)) => rep.fail(format!("bf16 engine {name}: {e}")),
            }
        }
        rep.finish();
    }

    /// `GpuModel::load` (the checkpoint streamed to the device) gives the uploaded
    /// model's logits (the same weights: to the last bit, bounded by [`SAME_TOL`]).
    #[test]
    fn streamed_load_equals_upload() {
        let Some((gpu, _l)) = gpu("streamed_load_equals_upload") else {
            return;
        };
        let mut rep = Report::new("streamed_load_equals_upload");
        let m = kimi_model();
        let dir = repo_root()
            .join("dataplane/tests/fixtures/golden")
            .join(KIMI);
        let ckpt = dataplane::weights::Checkpoint::open(&dir).expect("checkpoint opens");
        let toks = tokens(150, 3, m.config.vocab_size);
        fn logits<T: Elem>(g: &GpuModel<T>, toks: &[u32]) -> dataplane::cuda::Result<Vec<f32>>
        where
            CudaBlas: Gemm<T>,
        {
            let mut s = g.new_state()?;
            g.prefill(toks, &mut s, Logits::All)
        }
        let up32 = logits(&upload::<f32>(&gpu, &m), &toks).unwrap();
        match GpuModel::<f32>::load(gpu.clone(), m.config.clone(), &ckpt, &mut |_, _| {}) {
            Ok((g, _)) => match logits(&g, &toks) {
                Ok(l) => rep.check("f32 load vs upload".into(), err(&l, &up32), SAME_TOL),
                Err(e) => rep.fail(format!("f32 loaded model: {e}")),
            },
            Err(e) => rep.fail(format!("f32 load: {e}")),
        }
        let up16 = logits(&upload::<bf16>(&gpu, &m), &toks).unwrap();
        match GpuModel::<bf16>::load(gpu.clone(), m.config.clone(), &ckpt, &mut |_, _| {}) {
            Ok((g, _)) => match logits(&g, &toks) {
                Ok(l) => rep.check("bf16 load vs upload".into(), err(&l, &up16), SAME_TOL),
                Err(e) => rep.fail(format!("bf16 loaded model: {e}")),
            },
            Err(e) => rep.fail(format!("bf16 load: {e}")),
        }
        rep.finish();
    }

    /// `GpuModel::random` (weights generated on the device) equals the upload of
    /// `Model::random` with the same seed (bounded by [`SAME_TOL`]), and the CPU.
    #[test]
    fn device_random_weights_equal_the_host_generator() {
        let Some((gpu, _l)) = gpu("device_random_weights_equal_the_host_generator") else {
            return;
        };
        let mut rep = Report::new("device_random_weights_equal_the_host_generator");
        let c = kimi_model().config.clone();
        let cpu = Model::random(c.clone(), 42);
        let toks = tokens(90, 11, c.vocab_size);
        let mut cs = cpu.new_state();
        let want = cpu.prefill(&toks, &mut cs, Logits::All).unwrap().logits;
        let up = upload::<f32>(&gpu, &cpu);
        let mut us = up.new_state().unwrap();
        let got_up = up.prefill(&toks, &mut us, Logits::All).unwrap();
        rep.check(
            "upload(Model::random) vs CPU".into(),
            err(&got_up, &want),
            F32_TOL,
        );
        match GpuModel::<f32>::random(gpu.clone(), c, 42) {
            Ok(g) => {
                let mut s = g.new_state().unwrap();
                match g.prefill(&toks, &mut s, Logits::All) {
                    Ok(l) => rep.check(
                        "GpuModel::random vs upload".into(),
                        err(&l, &got_up),
                        SAME_TOL,
                    ),
                    Err(e) => rep.fail(format!("random model prefill: {e}")),
                }
            }
            Err(e) => rep.fail(format!("GpuModel::random: {e}")),
        }
        rep.finish();
    }

    // ------------------------------------------------------------------ bf16 rounding

    /// [`super::bf16_split::bf16_split`] at this file's prompt lengths, its failures
    /// reported to `rep`; returns the pooled activation row median.
    fn bf16_split(g: &Arc<Gpu>, label: &str, make: &dyn Fn() -> Model, rep: &mut Report) -> f64 {
        let s = super::bf16_split::bf16_split(g, label, make, &LENGTHS, &|n, vocab| {
            tokens(n, n as u64, vocab)
        });
        for f in s.failures {
            rep.fail(f);
        }
        s.activation_median
    }

    /// A Qwen3.5-MoE text config of the Kimi fixture's size (hidden 64, vocab 128, four
    /// layers `[linear, linear, full, linear]`, 4 heads × 16, 8 experts of width 16,
    /// top-2, one shared expert of width 16): the control of
    /// [`kimi_bf16_rounding_split_with_qwen_control`].
    fn qwen_control_config() -> dataplane::config::ModelConfig {
        let lt = [
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
        ];
        let v = serde_json::json!({
            "model_type": "qwen3_5_moe_text",
            "hidden_size": 64, "num_hidden_layers": lt.len(), "vocab_size": 128,
            "layer_types": lt, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "attn_output_gate": true, "partial_rotary_factor": 0.5,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16, "norm_topk_prob": true,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "max_position_embeddings": 4096
        });
        dataplane::config::ModelConfig::from_json(&v).expect("Qwen3.5-MoE control config")
    }

    /// Where the bf16 drift of Kimi-Linear comes from: for the golden fixture and a
    /// `Model::random` model of its config, and as the control for the Qwen3.5 golden
    /// fixture and a random Qwen3.5-MoE model of Kimi's size, the bf16 GPU logits
    /// against the f32 CPU model, split into weight rounding (CPU only) and activation
    /// rounding (GPU against the CPU with the same bf16 weights); see [`bf16_split`].
    /// The activation part is asserted for every model, and Kimi's against the control's
    /// ([`super::bf16_split::SPLIT_CONTROL_RATIO_MAX`]).
    #[test]
    fn kimi_bf16_rounding_split_with_qwen_control() {
        let test = "kimi_bf16_rounding_split_with_qwen_control";
        let Some((g, _l)) = gpu(test) else {
            return;
        };
        let mut rep = Report::new(test);
        let golden = repo_root().join("dataplane/tests/fixtures/golden");
        let load = |name: &str| {
            let dir = golden.join(name);
            Model::load(&dir, &mut |_, _| {})
                .unwrap_or_else(|e| panic!("load {}: {e}", dir.display()))
        };
        let kimi_cfg = kimi_model().config.clone();
        let fixture = bf16_split(&g, KIMI, &|| load(KIMI), &mut rep);
        let random = bf16_split(
            &g,
            "kimi random",
            &|| Model::random(kimi_cfg.clone(), 7),
            &mut rep,
        );
        let q_fixture = bf16_split(&g, "qwen3_5 (control)", &|| load("qwen3_5"), &mut rep);
        let q_random = bf16_split(
            &g,
            "qwen3.5-moe random (control)",
            &|| Model::random(qwen_control_config(), 7),
            &mut rep,
        );
        println!(
            "  activation row-median ratios: kimi fixture / qwen3_5 fixture {:.2}, \
             kimi random / qwen3.5-moe random {:.2}",
            fixture / q_fixture,
            random / q_random
        );
        for (label, fam, ctrl) in [
            ("kimi fixture vs qwen3_5 fixture", fixture, q_fixture),
            ("kimi random vs qwen3.5-moe random", random, q_random),
        ] {
            if let Some(f) = super::bf16_split::control_ratio_failure(label, fam, ctrl) {
                rep.fail(f);
            }
        }
        rep.finish();
    }
}
