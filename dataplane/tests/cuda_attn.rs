//! The GEMM-based attention fast path `cuda::attn::prefill_fast` and the bf16 flash
//! kernel `cuda::attn::prefill_flash` against the CPU reference `model::attention` and
//! against the tiled kernel `cuda::attn::prefill`.
//!
//! Built only with `--features cuda` (without it this binary has no tests); built
//! with the feature, every test needs a usable CUDA device and fails without one.
//!
//! Cases (each for f32 and bf16, at 16/2 heads × 256, 8/2 × 128 and 4/4 × 64):
//! the PIC seam case (three cached segments out of order with a gap, an 8-query
//! window, queries at scattered positions, one query that sees no key); causal
//! prefill at T = 600 (one query block) and T = 2100 with a workspace budget that
//! forces query blocks of 992 rows (crosses two block boundaries, partial last
//! block) and with the default one (blocks of 1024); permuted query and key
//! positions in blocks of 64; blocks of 16 queries that see no key (key limit 0);
//! 70 queries over an empty cache (zeros). Every case prints the norm-wise
//! `‖gpu − ref‖ / ‖ref‖` and max-relative `max|gpu − ref| / max|ref|` errors; all
//! failures are collected and asserted at the end of each test. Output buffers are
//! poisoned (NaN) before each call, so an unwritten element fails.
//!
//! Flash cases (bf16; 16/2 and 8/1 heads × 256 and × 128, 4/4 × 64): causal prefill at
//! T = 1, 17, 200, 1000 (not multiples of the 128-query / 64-key tiles), forced key
//! splits (3, 7, and more splits than tiles), permuted positions, blind queries, an
//! empty cache; the seam case (keys at positions above some queries, a query that sees
//! nothing), the seam window appended after the cache, and a short span over a long
//! cache of scrambled 64-position blocks (the automatic split plan and no split); the
//! other tile shapes (`attn::flash_variants`) on causal 1000 and the seam case; `f32`
//! and head_dim 96 are `Shape` errors.
//!
//! Wgmma flash cases (`attn::prefill_flash_wg`, Hopper only: they fail on other devices;
//! bf16; 16/2 and 8/1 heads × 256 and × 128): `flash_wg_causal_bf16` (causal T = 1, 17,
//! 64, 200, 333, 512, 1000, key splits 3, 7, 64, permuted positions, blind queries, empty
//! cache), `flash_wg_seam_bf16` (the flash seam cases), `flash_wg_vs_flash_4096` (causal
//! T = 4096, 16/2 × 256, against `attn::prefill_flash`), `flash_wg_errors_are_errors`;
//! `flash_wg3tmal_causal_bf16`, `flash_wg3tmalb80_causal_bf16`, `flash_wg3tmal_seam_bf16`,
//! `flash_wg3tmal_vs_flash_4096`: the same cases on the warp-specialised kernels `GpuModel`
//! runs (`attn::FlashWgKernel::WarpSpecializedTmaLean` and `WarpSpecializedTmaLeanBc80`:
//! K/V by TMA, 64- and 80-key tiles). The wgmma tests fail (not pass) on a GPU that is
//! not Hopper.
//!
//! Tolerances: f32 1e-5 norm-wise / 1e-4 max-relative; bf16 4e-3 / 4e-2 (against
//! the CPU on the bf16-rounded inputs: the fast path stores the probabilities `P` in
//! bf16 before the `P·V` GEMM, the tiled kernel keeps them in fp32; both round `o`).

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

    use dataplane::cuda::{attn, CudaSlice, Elem, Gpu};
    use dataplane::state::KvCache;
    use half::bf16;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const HEADS: [(usize, usize, usize); 3] = [(16, 2, 256), (8, 2, 128), (4, 4, 64)];

    fn gpu(test: &str) -> Option<(Arc<Gpu>, MutexGuard<'static, ()>)> {
        static G: OnceLock<std::result::Result<Arc<Gpu>, String>> = OnceLock::new();
        static L: Mutex<()> = Mutex::new(());
        let guard = L.lock().unwrap_or_else(|e| e.into_inner());
        let g = G.get_or_init(|| match std::panic::catch_unwind(|| Gpu::new(0)) {
            Ok(Ok(g)) => {
                println!("cuda_attn: device {} ({})", g.name(), g.arch());
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

    fn uniform(r: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
    }

    /// (norm-wise relative error, max relative error); NaN anywhere gives NaN.
    fn errs(a: &[f32], b: &[f32]) -> (f64, f64) {
        if a.len() != b.len() {
            return (f64::INFINITY, f64::INFINITY);
        }
        let (mut num, mut den, mut maxd, mut maxb) = (0f64, 0f64, 0f64, 0f64);
        for (&x, &y) in a.iter().zip(b) {
            if x.is_nan() || y.is_nan() {
                return (f64::NAN, f64::NAN);
            }
            let d = (x as f64 - y as f64).abs();
            num += d * d;
            den += (y as f64) * (y as f64);
            maxd = maxd.max(d);
            maxb = maxb.max((y as f64).abs());
        }
        ((num / den.max(1e-300)).sqrt(), maxd / maxb.max(1e-300))
    }

    #[derive(Default)]
    struct Failures(Vec<String>);

    impl Failures {
        fn check(&mut self, what: &str, got: &[f32], want: &[f32], tol: f64, tol_max: f64) {
            let (n, m) = errs(got, want);
            let pass = n <= tol && m <= tol_max;
            println!(
                "{what}: rel {n:.2e} (tol {tol:.0e}), max rel {m:.2e} (tol {tol_max:.0e}) {}",
                if pass { "ok" } else { "FAIL" }
            );
            if !pass {
                self.0.push(format!("{what}: rel {n:e} max rel {m:e}"));
            }
        }
        fn fail(&mut self, what: String) {
            println!("FAIL {what}");
            self.0.push(what);
        }
        fn assert_none(self, test: &str) {
            assert!(
                self.0.is_empty(),
                "{test}: {} failure(s):\n{}",
                self.0.len(),
                self.0.join("\n")
            );
        }
    }

    fn up<T: Elem>(g: &Gpu, x: &[f32]) -> CudaSlice<T> {
        let v: Vec<T> = x.iter().map(|&a| T::from_f32(a)).collect();
        g.upload(&v).unwrap()
    }

    fn down<T: Elem>(g: &Gpu, x: &CudaSlice<T>, n: usize) -> Vec<f32> {
        g.download(x).unwrap()[..n]
            .iter()
            .map(|a| a.to_f32())
            .collect()
    }

    fn round<T: Elem>(x: Vec<f32>) -> Vec<f32> {
        x.into_iter().map(|a| T::from_f32(a).to_f32()).collect()
    }

    fn tols<T: Elem>() -> (f64, f64) {
        if T::SUFFIX == "bf16" {
            (4e-3, 4e-2)
        } else {
            (1e-5, 1e-4)
        }
    }

    /// The implementation under test in [`case_path`].
    #[derive(Clone, Copy, Debug)]
    enum Path {
        /// `attn::prefill_fast_with` with this workspace budget (bytes).
        Fast(usize),
        /// `attn::prefill_flash_with` with these options (`split: None`: its own plan).
        Flash(attn::FlashOpts),
        /// `attn::prefill_flash_wg_with` with this many key splits (`None`: its own plan).
        FlashWg(Option<usize>),
        /// The same with another kernel (`FlashWgKernel::WarpSpecializedTmaLean*`).
        FlashWgK(Option<usize>, attn::FlashWgKernel),
        /// `attn::decode` (one query) with this many key splits (`None`: its own plan).
        Decode(Option<usize>),
    }

    /// One case: random q/k/v at the given positions; fast path (workspace `budget`)
    /// vs the CPU and vs the tiled kernel.
    #[allow(clippy::too_many_arguments)]
    fn case<T: Elem>(
        g: &Gpu,
        name: &str,
        q_pos: &[i64],
        kv_pos: &[i64],
        heads: (usize, usize, usize),
        budget: usize,
        seed: u64,
        fails: &mut Failures,
    ) {
        case_path::<T>(
            g,
            name,
            q_pos,
            kv_pos,
            heads,
            Path::Fast(budget),
            seed,
            fails,
        )
    }

    /// One case of the flash kernel (bf16): vs the CPU and vs the tiled kernel.
    #[allow(clippy::too_many_arguments)]
    fn case_flash(
        g: &Gpu,
        name: &str,
        q_pos: &[i64],
        kv_pos: &[i64],
        heads: (usize, usize, usize),
        split: Option<usize>,
        seed: u64,
        fails: &mut Failures,
    ) {
        let opts = attn::FlashOpts { split, tiles: None };
        case_path::<bf16>(
            g,
            name,
            q_pos,
            kv_pos,
            heads,
            Path::Flash(opts),
            seed,
            fails,
        )
    }

    /// One case: random q/k/v at the given positions; the implementation `path` vs the
    /// CPU and vs the tiled kernel; queries that see no key must be exact zeros.
    #[allow(clippy::too_many_arguments)]
    fn case_path<T: Elem>(
        g: &Gpu,
        name: &str,
        q_pos: &[i64],
        kv_pos: &[i64],
        (nh, nkv, hd): (usize, usize, usize),
        path: Path,
        seed: u64,
        fails: &mut Failures,
    ) {
        let (tq, n) = (q_pos.len(), kv_pos.len());
        let mut r = StdRng::seed_from_u64(seed);
        let q = round::<T>(uniform(&mut r, tq * nh * hd));
        let k = round::<T>(uniform(&mut r, n * nkv * hd));
        let v = round::<T>(uniform(&mut r, n * nkv * hd));
        let kv = KvCache {
            k: k.clone(),
            v: v.clone(),
            positions: kv_pos.to_vec(),
        };
        let want = dataplane::model::attention(&q, q_pos, &kv, nh, nkv, hd);
        let (qd, kd, vd) = (up::<T>(g, &q), up::<T>(g, &k), up::<T>(g, &v));
        let qp = g.upload(q_pos).unwrap();
        let kp = g.upload(if n == 0 { &[0i64][..] } else { kv_pos }).unwrap();
        let on = tq * nh * hd;
        let (what, label) = match path {
            Path::Fast(budget) => {
                let (qb, ws) = attn::fast_plan(tq, n, nkv, std::mem::size_of::<T>(), budget);
                let w = format!(
                    "{name} {} {nh}/{nkv}×{hd} tq={tq} n_kv={n} (qb {qb}, workspace {:.1} MiB)",
                    T::SUFFIX,
                    ws as f64 / (1 << 20) as f64
                );
                (w, "fast")
            }
            Path::Flash(opts) => {
                let tl = opts.tiles.unwrap_or_else(|| attn::flash_tiles(hd));
                let sp = match opts.split {
                    Some(s) => format!("split {s}"),
                    None => format!(
                        "split auto = {} at 132 SMs",
                        attn::flash_plan(tq, n, nh, hd, tl, 132, attn::FAST_WORKSPACE_BYTES)
                    ),
                };
                let w = format!(
                    "{name} {} {nh}/{nkv}×{hd} tq={tq} n_kv={n} ({}×{} tiles, {sp})",
                    T::SUFFIX,
                    tl.br,
                    tl.bc
                );
                (w, "flash")
            }
            Path::FlashWg(split) | Path::FlashWgK(split, _) => {
                let sp = match split {
                    Some(s) => format!("split {s}"),
                    None => "split auto".to_string(),
                };
                let (kind, label) = match path {
                    Path::FlashWgK(_, k) => (format!("wgmma, {k:?}"), "flash-wg3"),
                    _ => ("wgmma".to_string(), "flash-wg"),
                };
                let w = format!(
                    "{name} {} {nh}/{nkv}×{hd} tq={tq} n_kv={n} ({kind}, {sp})",
                    T::SUFFIX
                );
                (w, label)
            }
            Path::Decode(split) => {
                let w = format!(
                    "{name} {} {nh}/{nkv}×{hd} tq={tq} n_kv={n} (decode, split {split:?})",
                    T::SUFFIX
                );
                (w, "decode")
            }
        };
        let mut fast = up::<T>(g, &vec![f32::NAN; on.max(1)]);
        let r = match path {
            Path::Fast(budget) => attn::prefill_fast_with(
                g, &qd, &qp, &kd, &vd, &kp, &mut fast, tq, n, nh, nkv, hd, budget,
            ),
            Path::Flash(opts) => attn::prefill_flash_with(
                g, &qd, &qp, &kd, &vd, &kp, &mut fast, tq, n, nh, nkv, hd, opts,
            ),
            Path::FlashWg(split) | Path::FlashWgK(split, _) => {
                let kernel = match path {
                    Path::FlashWgK(_, k) => k,
                    _ => attn::FlashWgKernel::Basic,
                };
                let opts = attn::FlashWgOpts { split, kernel };
                attn::prefill_flash_wg_with(
                    g, &qd, &qp, &kd, &vd, &kp, &mut fast, tq, n, nh, nkv, hd, opts,
                )
            }
            Path::Decode(split) => {
                attn::decode(g, &qd, &qp, &kd, &vd, &kp, &mut fast, n, nh, nkv, hd, split)
            }
        };
        if let Err(e) = r.and_then(|_| g.sync()) {
            return fails.fail(format!("{what}: {label} failed: {e}"));
        }
        let mut old = up::<T>(g, &vec![f32::NAN; on.max(1)]);
        if let Err(e) = attn::prefill(g, &qd, &qp, &kd, &vd, &kp, &mut old, tq, n, nh, nkv, hd)
            .and_then(|_| g.sync())
        {
            return fails.fail(format!("{what}: prefill failed: {e}"));
        }
        let fast = down(g, &fast, on);
        let old = down(g, &old, on);
        // Queries that see no key: exact zeros.
        for (t, &p) in q_pos.iter().enumerate() {
            if kv_pos.iter().all(|&kp| kp > p)
                && fast[t * nh * hd..(t + 1) * nh * hd]
                    .iter()
                    .any(|&x| x != 0.0)
            {
                fails.fail(format!(
                    "{what}: query {t} at {p} sees no key but is not zero"
                ));
            }
        }
        let (tol, tol_max) = tols::<T>();
        if n == 0 {
            // Both sides all zeros: the relative errors are 0/0.
            if fast.iter().any(|&x| x != 0.0) {
                fails.fail(format!("{what}: empty cache but nonzero output"));
            } else {
                println!("{what}: all zeros ok");
            }
            return;
        }
        fails.check(
            &format!("{what} {label} vs CPU"),
            &fast,
            &want,
            tol,
            tol_max,
        );
        fails.check(
            &format!("{what} {label} vs tiled"),
            &fast,
            &old,
            tol,
            tol_max,
        );
    }

    /// `attn::decode` (one query token, split over the keys) vs the CPU and the tiled
    /// kernel: causal caches of 0 to 20,000 keys (splits of its own plan, one split, more
    /// splits than keys), a scattered seam cache with the query in the middle (half the
    /// keys visible), a query that sees nothing, and GQA groups of 1 to 8 heads at head
    /// dims 128 and 256.
    #[test]
    fn decode_bf16() {
        let test = "decode_bf16";
        let Some((g, _l)) = gpu(test) else { return };
        let mut f = Failures::default();
        let heads = [
            (16, 2, 256),
            (16, 2, 128),
            (8, 8, 128),
            (8, 1, 256),
            (4, 4, 256),
        ];
        let mut seed = 900;
        for &h in &heads {
            for n in [0usize, 1, 5, 31, 32, 33, 100, 4096] {
                let kv: Vec<i64> = (0..n as i64).collect();
                for split in [None, Some(1), Some(7), Some(1024)] {
                    seed += 1;
                    case_path::<bf16>(
                        &g,
                        "decode causal",
                        &[n as i64],
                        &kv,
                        h,
                        Path::Decode(split),
                        seed,
                        &mut f,
                    );
                }
            }
        }
        let long: Vec<i64> = (0..20_000i64).collect();
        case_path::<bf16>(
            &g,
            "decode long",
            &[19_999],
            &long,
            heads[0],
            Path::Decode(None),
            950,
            &mut f,
        );
        let (_, kv_pos) = seam_positions();
        for (i, &h) in heads.iter().enumerate() {
            for qp in [230i64, 1050, -3, 100_000] {
                case_path::<bf16>(
                    &g,
                    "decode seam",
                    &[qp],
                    &kv_pos,
                    h,
                    Path::Decode(None),
                    960 + i as u64,
                    &mut f,
                );
            }
        }
        // Shapes it refuses, with an error, not a panic: head dim 64, 16 heads per kv head.
        let q = up::<bf16>(&g, &vec![0.0; 16 * 256]);
        let p = g.upload(&[0i64]).unwrap();
        let mut o = up::<bf16>(&g, &vec![0.0; 16 * 256]);
        if attn::decode(&g, &q, &p, &q, &q, &p, &mut o, 1, 16, 1, 64, None).is_ok() {
            f.fail("decode accepted head dim 64".into());
        }
        if attn::decode(&g, &q, &p, &q, &q, &p, &mut o, 1, 16, 1, 256, None).is_ok() {
            f.fail("decode accepted 16 query heads per kv head".into());
        }
        f.assert_none(test);
    }

    fn seam_positions() -> (Vec<i64>, Vec<i64>) {
        let mut kv_pos: Vec<i64> = Vec::new();
        kv_pos.extend(0..40i64); // system prompt
        kv_pos.extend(1000..1077i64); // segment moved to 1000
        kv_pos.extend(200..261i64); // segment at 200, stored after the one at 1000
                                    // 8-query seam window, then scattered queries; −3 sees nothing.
        let q_pos: Vec<i64> = (1077..1085i64)
            .chain([5i64, 230, 1050, 100_000, -3])
            .collect();
        (q_pos, kv_pos)
    }

    fn seam<T: Elem>(test: &str) {
        let Some((g, _l)) = gpu(test) else { return };
        let mut f = Failures::default();
        let (q_pos, kv_pos) = seam_positions();
        for (i, &h) in HEADS.iter().enumerate() {
            case::<T>(
                &g,
                "seam",
                &q_pos,
                &kv_pos,
                h,
                attn::FAST_WORKSPACE_BYTES,
                10 + i as u64,
                &mut f,
            );
        }
        // A long seam: 100 window queries over the same scattered cache plus their own
        // keys (the window is appended after the cache, as GpuModel does), tiny budget
        // so that the window is split into blocks of 16.
        let mut kv2 = kv_pos.clone();
        kv2.extend(1077..1177i64);
        let q2: Vec<i64> = (1077..1177i64).collect();
        case::<T>(&g, "seam window 100", &q2, &kv2, HEADS[0], 1, 20, &mut f);
        f.assert_none(test);
    }

    fn causal<T: Elem>(test: &str) {
        let Some((g, _l)) = gpu(test) else { return };
        let mut f = Failures::default();
        for (i, &h) in HEADS.iter().enumerate() {
            let pos: Vec<i64> = (0..600).collect();
            case::<T>(
                &g,
                "causal",
                &pos,
                &pos,
                h,
                attn::FAST_WORKSPACE_BYTES,
                30 + i as u64,
                &mut f,
            );
            // T = 2100 with blocks of 992 query rows (two boundaries, last block 116).
            let pos: Vec<i64> = (0..2100).collect();
            let ld = 2100usize.next_multiple_of(8);
            let budget = 1000 * h.1 * ld * (4 + std::mem::size_of::<T>());
            let (qb, _) = attn::fast_plan(2100, 2100, h.1, std::mem::size_of::<T>(), budget);
            assert_eq!(qb, 992, "test plumbing: block rows");
            case::<T>(&g, "causal", &pos, &pos, h, budget, 40 + i as u64, &mut f);
            // Default budget: blocks of FAST_MAX_QB = 1024 (last block 52).
            case::<T>(
                &g,
                "causal",
                &pos,
                &pos,
                h,
                attn::FAST_WORKSPACE_BYTES,
                60 + i as u64,
                &mut f,
            );
        }
        // Unordered positions on both sides (permutations of 0..300), blocks of 64: the
        // per-block key limits see unsorted kv_pos.
        let n = 300usize;
        let kv_pos: Vec<i64> = (0..n).map(|i| ((i * 7919) % n) as i64).collect();
        let q_pos: Vec<i64> = (0..n).map(|i| ((i * 13) % n) as i64).collect();
        let es = std::mem::size_of::<T>();
        let budget = 64 * HEADS[1].1 * n.next_multiple_of(8) * (4 + es);
        case::<T>(
            &g, "shuffled", &q_pos, &kv_pos, HEADS[1], budget, 70, &mut f,
        );
        // Blocks of 16 whose queries see nothing (key limit 0), then a partly visible one.
        let q_pos: Vec<i64> = (-40..30).collect();
        let kv_pos: Vec<i64> = (0..50).rev().collect();
        case::<T>(&g, "blind blocks", &q_pos, &kv_pos, HEADS[2], 1, 80, &mut f);
        // Empty cache: every query gets zeros.
        let pos: Vec<i64> = (0..70).collect();
        case::<T>(
            &g,
            "empty cache",
            &pos,
            &[],
            HEADS[1],
            attn::FAST_WORKSPACE_BYTES,
            50,
            &mut f,
        );
        f.assert_none(test);
    }

    #[test]
    fn fast_seam_f32() {
        seam::<f32>("fast_seam_f32");
    }

    #[test]
    fn fast_seam_bf16() {
        seam::<bf16>("fast_seam_bf16");
    }

    #[test]
    fn fast_causal_f32() {
        causal::<f32>("fast_causal_f32");
    }

    #[test]
    fn fast_causal_bf16() {
        causal::<bf16>("fast_causal_bf16");
    }

    #[test]
    fn fast_shape_errors_are_errors() {
        let Some((g, _l)) = gpu("fast_shape_errors_are_errors") else {
            return;
        };
        let (tq, n, nh, nkv) = (70usize, 70usize, 4usize, 2usize);
        let z = |len: usize| g.zeros::<f32>(len).unwrap();
        let pos = g.upload(&(0..70i64).collect::<Vec<_>>()).unwrap();
        // head_dim 96 is not supported.
        let hd = 96;
        let (q, k, v) = (z(tq * nh * hd), z(n * nkv * hd), z(n * nkv * hd));
        let mut o = z(tq * nh * hd);
        let e = attn::prefill_fast(&g, &q, &pos, &k, &v, &pos, &mut o, tq, n, nh, nkv, hd);
        println!("hd 96: {e:?}");
        assert!(matches!(e, Err(dataplane::cuda::CudaError::Shape(_))));
        // Heads not a multiple of kv heads.
        let hd = 64;
        let (q, k, v) = (z(tq * 3 * hd), z(n * nkv * hd), z(n * nkv * hd));
        let mut o = z(tq * 3 * hd);
        let e = attn::prefill_fast(&g, &q, &pos, &k, &v, &pos, &mut o, tq, n, 3, nkv, hd);
        println!("3/2 heads: {e:?}");
        assert!(matches!(e, Err(dataplane::cuda::CudaError::Shape(_))));
        // Output too short.
        let (q, k, v) = (z(tq * nh * hd), z(n * nkv * hd), z(n * nkv * hd));
        let mut o = z(tq * nh * hd - 1);
        let e = attn::prefill_fast(&g, &q, &pos, &k, &v, &pos, &mut o, tq, n, nh, nkv, hd);
        println!("short o: {e:?}");
        assert!(matches!(e, Err(dataplane::cuda::CudaError::Shape(_))));
        // Positions too short.
        let e = attn::prefill_fast(
            &g,
            &q,
            &pos,
            &k,
            &v,
            &pos,
            &mut z(tq * nh * hd),
            tq + 1,
            n,
            nh,
            nkv,
            hd,
        );
        println!("short q_pos: {e:?}");
        assert!(matches!(e, Err(dataplane::cuda::CudaError::Shape(_))));
    }

    /// Head shapes of the flash tests: GQA 16/2 and 8/1 at head dims 256 and 128, and
    /// 4/4 × 64.
    const FLASH_HEADS: [(usize, usize, usize); 5] = [
        (16, 2, 256),
        (8, 1, 256),
        (16, 2, 128),
        (8, 1, 128),
        (4, 4, 64),
    ];

    #[test]
    fn flash_causal_bf16() {
        let test = "flash_causal_bf16";
        let Some((g, _l)) = gpu(test) else { return };
        let mut f = Failures::default();
        // Causal prefill at positions 0..T, T not a multiple of the 128-query / 64-key
        // tiles (1: one query; 17: one partial tile; 200: a full and a partial query
        // tile; 1000: 8 query tiles, the diagonal tiles masked, the rest unmasked).
        for (i, &h) in FLASH_HEADS.iter().enumerate() {
            for (j, t) in [1usize, 17, 200, 1000].into_iter().enumerate() {
                let pos: Vec<i64> = (0..t as i64).collect();
                let seed = 100 + 10 * i as u64 + j as u64;
                case_flash(&g, "causal", &pos, &pos, h, None, seed, &mut f);
            }
        }
        // Key splits merged by attn_flash_combine_bf16: 3 and 7 splits over 16 key tiles,
        // and more splits than tiles (empty splits).
        let pos: Vec<i64> = (0..1000).collect();
        case_flash(
            &g,
            "causal",
            &pos,
            &pos,
            FLASH_HEADS[0],
            Some(3),
            150,
            &mut f,
        );
        case_flash(
            &g,
            "causal",
            &pos,
            &pos,
            FLASH_HEADS[3],
            Some(7),
            151,
            &mut f,
        );
        let pos: Vec<i64> = (0..200).collect();
        case_flash(
            &g,
            "causal",
            &pos,
            &pos,
            FLASH_HEADS[1],
            Some(64),
            152,
            &mut f,
        );
        // Unordered positions on both sides (permutations of 0..300).
        let n = 300usize;
        let kv_pos: Vec<i64> = (0..n).map(|i| ((i * 7919) % n) as i64).collect();
        let q_pos: Vec<i64> = (0..n).map(|i| ((i * 13) % n) as i64).collect();
        case_flash(
            &g,
            "shuffled",
            &q_pos,
            &kv_pos,
            FLASH_HEADS[3],
            None,
            160,
            &mut f,
        );
        case_flash(
            &g,
            "shuffled",
            &q_pos,
            &kv_pos,
            FLASH_HEADS[0],
            Some(2),
            161,
            &mut f,
        );
        // Queries that see no key (before every key), keys in reverse order.
        let q_pos: Vec<i64> = (-40..30).collect();
        let kv_pos: Vec<i64> = (0..50).rev().collect();
        case_flash(
            &g,
            "blind",
            &q_pos,
            &kv_pos,
            FLASH_HEADS[2],
            None,
            170,
            &mut f,
        );
        // Empty cache: every query gets zeros.
        let pos: Vec<i64> = (0..70).collect();
        case_flash(
            &g,
            "empty cache",
            &pos,
            &[],
            FLASH_HEADS[3],
            None,
            180,
            &mut f,
        );
        // The other tile shapes (gpu_bench times them): causal 1000 and the seam case.
        let pos: Vec<i64> = (0..1000).collect();
        let (sq, skv) = seam_positions();
        for &h in &FLASH_HEADS {
            for &tiles in attn::flash_variants(h.2).iter().skip(1) {
                for (split, seed) in [(None, 190u64), (Some(3), 191)] {
                    let opts = attn::FlashOpts {
                        split,
                        tiles: Some(tiles),
                    };
                    let p = Path::Flash(opts);
                    case_path::<bf16>(&g, "causal", &pos, &pos, h, p, seed, &mut f);
                    case_path::<bf16>(&g, "seam", &sq, &skv, h, p, seed + 2, &mut f);
                }
            }
        }
        f.assert_none(test);
    }

    #[test]
    fn flash_seam_bf16() {
        let test = "flash_seam_bf16";
        let Some((g, _l)) = gpu(test) else { return };
        let mut f = Failures::default();
        // Cached segments out of order with a gap (keys at positions above some queries),
        // an 8-query window after them, scattered queries, one (at −3) that sees no key.
        let (q_pos, kv_pos) = seam_positions();
        for (i, &h) in FLASH_HEADS.iter().enumerate() {
            case_flash(&g, "seam", &q_pos, &kv_pos, h, None, 200 + i as u64, &mut f);
        }
        case_flash(
            &g,
            "seam",
            &q_pos,
            &kv_pos,
            FLASH_HEADS[0],
            Some(2),
            210,
            &mut f,
        );
        // The window appended after the cache (as GpuModel does), 100 queries.
        let mut kv2 = kv_pos.clone();
        kv2.extend(1077..1177i64);
        let q2: Vec<i64> = (1077..1177i64).collect();
        for (i, &h) in FLASH_HEADS.iter().enumerate().take(4) {
            case_flash(
                &g,
                "seam window 100",
                &q2,
                &kv2,
                h,
                None,
                220 + i as u64,
                &mut f,
            );
        }
        // A short span over a long shuffled cache (blocks of 64 positions in a scrambled
        // order, so tiles are neither sorted nor contiguous): few CTAs, so the plan
        // splits the keys; plus the same without splits.
        let blocks = 47usize;
        let mut kv3: Vec<i64> = Vec::new();
        for b in 0..blocks {
            let s = ((b * 29) % blocks) as i64 * 64;
            kv3.extend(s..s + 64);
        }
        kv3.truncate(blocks * 64 - 21); // a partial last tile
        let q3: Vec<i64> = (0..100i64).map(|i| 3008 - 1500 + 15 * i).collect();
        case_flash(
            &g,
            "long cache",
            &q3,
            &kv3,
            FLASH_HEADS[0],
            None,
            230,
            &mut f,
        );
        case_flash(
            &g,
            "long cache",
            &q3,
            &kv3,
            FLASH_HEADS[0],
            Some(1),
            231,
            &mut f,
        );
        case_flash(
            &g,
            "long cache",
            &q3[..8],
            &kv3,
            FLASH_HEADS[3],
            None,
            232,
            &mut f,
        );
        f.assert_none(test);
    }

    #[test]
    fn flash_errors_are_errors() {
        let Some((g, _l)) = gpu("flash_errors_are_errors") else {
            return;
        };
        let (tq, n, nh, nkv, hd) = (70usize, 70usize, 4usize, 2usize, 128usize);
        let pos = g.upload(&(0..70i64).collect::<Vec<_>>()).unwrap();
        // f32 is not supported.
        let z = |len: usize| g.zeros::<f32>(len).unwrap();
        let (q, k, v) = (z(tq * nh * hd), z(n * nkv * hd), z(n * nkv * hd));
        let mut o = z(tq * nh * hd);
        let e = attn::prefill_flash(&g, &q, &pos, &k, &v, &pos, &mut o, tq, n, nh, nkv, hd);
        println!("flash f32: {e:?}");
        assert!(matches!(e, Err(dataplane::cuda::CudaError::Shape(_))));
        // head_dim 96 is not supported.
        let hd = 96;
        let zb = |len: usize| g.zeros::<bf16>(len).unwrap();
        let (q, k, v) = (zb(tq * nh * hd), zb(n * nkv * hd), zb(n * nkv * hd));
        let mut o = zb(tq * nh * hd);
        let e = attn::prefill_flash(&g, &q, &pos, &k, &v, &pos, &mut o, tq, n, nh, nkv, hd);
        println!("flash hd 96: {e:?}");
        assert!(matches!(e, Err(dataplane::cuda::CudaError::Shape(_))));
    }
    /// The device for the wgmma tests; they fail on a device that is not sm_90
    /// (`prefill_flash_wg` is Hopper-only).
    fn gpu_wg(test: &str) -> Option<(Arc<Gpu>, MutexGuard<'static, ()>)> {
        let (g, l) = gpu(test)?;
        assert_eq!(
            g.arch(),
            "sm_90a",
            "{test}: {} is not a Hopper GPU, and prefill_flash_wg needs sm_90",
            g.name()
        );
        Some((g, l))
    }

    /// Head shapes of the wgmma kernel (head dims 256 and 128).
    const FLASH_WG_HEADS: [(usize, usize, usize); 4] =
        [(16, 2, 256), (8, 1, 256), (16, 2, 128), (8, 1, 128)];

    /// `attn::prefill_flash_wg` (kernels/flash_wg.cu) vs the CPU and the tiled kernel:
    /// causal prefill at T = 1, 17, 64, 200, 333, 512, 1000 (partial 128-query / 64-key
    /// tiles, a CTA whose second warpgroup is entirely past tq), key splits (3, 7, more
    /// splits than tiles), permuted positions, blind queries, an empty cache.
    #[test]
    fn flash_wg_causal_bf16() {
        wg_causal_cases("flash_wg_causal_bf16", Path::FlashWg);
    }

    fn wg_causal_cases(test: &str, mk: fn(Option<usize>) -> Path) {
        let Some((g, _l)) = gpu_wg(test) else { return };
        let mut f = Failures::default();
        for (i, &h) in FLASH_WG_HEADS.iter().enumerate() {
            for (j, t) in [1usize, 17, 64, 200, 333, 512, 1000]
                .into_iter()
                .enumerate()
            {
                let pos: Vec<i64> = (0..t as i64).collect();
                let seed = 500 + 10 * i as u64 + j as u64;
                let p = mk(None);
                case_path::<bf16>(&g, "causal", &pos, &pos, h, p, seed, &mut f);
            }
        }
        let pos: Vec<i64> = (0..1000).collect();
        let p3 = mk(Some(3));
        case_path::<bf16>(&g, "causal", &pos, &pos, FLASH_WG_HEADS[0], p3, 550, &mut f);
        let p7 = mk(Some(7));
        case_path::<bf16>(&g, "causal", &pos, &pos, FLASH_WG_HEADS[3], p7, 551, &mut f);
        let pos: Vec<i64> = (0..200).collect();
        let p64 = mk(Some(64));
        case_path::<bf16>(
            &g,
            "causal",
            &pos,
            &pos,
            FLASH_WG_HEADS[1],
            p64,
            552,
            &mut f,
        );
        let n = 300usize;
        let kv_pos: Vec<i64> = (0..n).map(|i| ((i * 7919) % n) as i64).collect();
        let q_pos: Vec<i64> = (0..n).map(|i| ((i * 13) % n) as i64).collect();
        for (i, &h) in FLASH_WG_HEADS.iter().enumerate() {
            let p = mk(if i % 2 == 0 { None } else { Some(2) });
            case_path::<bf16>(
                &g,
                "shuffled",
                &q_pos,
                &kv_pos,
                h,
                p,
                560 + i as u64,
                &mut f,
            );
        }
        let q_pos: Vec<i64> = (-40..30).collect();
        let kv_pos: Vec<i64> = (0..50).rev().collect();
        let p = mk(None);
        case_path::<bf16>(
            &g,
            "blind",
            &q_pos,
            &kv_pos,
            FLASH_WG_HEADS[0],
            p,
            570,
            &mut f,
        );
        case_path::<bf16>(
            &g,
            "blind",
            &q_pos,
            &kv_pos,
            FLASH_WG_HEADS[3],
            p,
            571,
            &mut f,
        );
        let pos: Vec<i64> = (0..70).collect();
        case_path::<bf16>(
            &g,
            "empty cache",
            &pos,
            &[],
            FLASH_WG_HEADS[0],
            p,
            580,
            &mut f,
        );
        f.assert_none(test);
    }

    /// `attn::prefill_flash_wg` on the seam cases of `flash_seam_bf16`: keys out of order
    /// with a gap, queries after it, one query that sees no key; the window appended after
    /// the cache; a short span over a long scrambled cache (split plan and no split).
    #[test]
    fn flash_wg_seam_bf16() {
        wg_seam_cases("flash_wg_seam_bf16", Path::FlashWg);
    }

    /// [`flash_wg_seam_bf16`]'s cases on the warp-specialised TMA kernels (64- and 80-key
    /// tiles).
    #[test]
    fn flash_wg3tmal_seam_bf16() {
        wg_seam_cases("flash_wg3tmal_seam_bf16", |s| {
            Path::FlashWgK(s, attn::FlashWgKernel::WarpSpecializedTmaLean)
        });
        wg_seam_cases("flash_wg3tmalb80_seam_bf16", |s| {
            Path::FlashWgK(s, attn::FlashWgKernel::WarpSpecializedTmaLeanBc80)
        });
    }

    fn wg_seam_cases(test: &str, mk: fn(Option<usize>) -> Path) {
        let Some((g, _l)) = gpu_wg(test) else { return };
        let mut f = Failures::default();
        let (q_pos, kv_pos) = seam_positions();
        for (i, &h) in FLASH_WG_HEADS.iter().enumerate() {
            let p = mk(None);
            case_path::<bf16>(&g, "seam", &q_pos, &kv_pos, h, p, 600 + i as u64, &mut f);
        }
        let p2 = mk(Some(2));
        case_path::<bf16>(
            &g,
            "seam",
            &q_pos,
            &kv_pos,
            FLASH_WG_HEADS[0],
            p2,
            610,
            &mut f,
        );
        let mut kv2 = kv_pos.clone();
        kv2.extend(1077..1177i64);
        let q2: Vec<i64> = (1077..1177i64).collect();
        for (i, &h) in FLASH_WG_HEADS.iter().enumerate() {
            let p = mk(None);
            case_path::<bf16>(
                &g,
                "seam window 100",
                &q2,
                &kv2,
                h,
                p,
                620 + i as u64,
                &mut f,
            );
        }
        let blocks = 47usize;
        let mut kv3: Vec<i64> = Vec::new();
        for b in 0..blocks {
            let s = ((b * 29) % blocks) as i64 * 64;
            kv3.extend(s..s + 64);
        }
        kv3.truncate(blocks * 64 - 21);
        let q3: Vec<i64> = (0..100i64).map(|i| 3008 - 1500 + 15 * i).collect();
        let h0 = FLASH_WG_HEADS[0];
        let (pa, p1) = (mk(None), mk(Some(1)));
        case_path::<bf16>(&g, "long cache", &q3, &kv3, h0, pa, 630, &mut f);
        case_path::<bf16>(&g, "long cache", &q3, &kv3, h0, p1, 631, &mut f);
        let h3 = FLASH_WG_HEADS[3];
        case_path::<bf16>(&g, "long cache", &q3[..8], &kv3, h3, pa, 632, &mut f);
        f.assert_none(test);
    }

    /// `attn::prefill_flash_wg` vs `attn::prefill_flash` at T = 4096 (causal, 16/2 heads ×
    /// 256, the benchmark shape), norm-wise and max-relative as the bf16 CPU tolerances.
    #[test]
    fn flash_wg_vs_flash_4096() {
        wg_vs_flash_4096("flash_wg_vs_flash_4096", attn::FlashWgKernel::Basic);
    }

    /// [`flash_wg_vs_flash_4096`] for the warp-specialised TMA kernels (64- and 80-key
    /// tiles).
    #[test]
    fn flash_wg3tmal_vs_flash_4096() {
        for k in [
            attn::FlashWgKernel::WarpSpecializedTmaLean,
            attn::FlashWgKernel::WarpSpecializedTmaLeanBc80,
        ] {
            wg_vs_flash_4096("flash_wg3tmal_vs_flash_4096", k);
        }
    }

    /// The lean TMA kernel (`attn_flash_wg3tmal_*`) over the causal cases.
    #[test]
    fn flash_wg3tmal_causal_bf16() {
        wg_causal_cases("flash_wg3tmal_causal_bf16", |s| {
            Path::FlashWgK(s, attn::FlashWgKernel::WarpSpecializedTmaLean)
        });
    }

    /// The lean TMA kernel with 80-key tiles (`attn_flash_wg3tmalb80_*`) over the causal
    /// cases.
    #[test]
    fn flash_wg3tmalb80_causal_bf16() {
        wg_causal_cases("flash_wg3tmalb80_causal_bf16", |s| {
            Path::FlashWgK(s, attn::FlashWgKernel::WarpSpecializedTmaLeanBc80)
        });
    }

    fn wg_vs_flash_4096(test: &str, kernel: attn::FlashWgKernel) {
        let Some((g, _l)) = gpu_wg(test) else { return };
        let mut f = Failures::default();
        let (t, nh, nkv, hd) = (4096usize, 16usize, 2usize, 256usize);
        let mut r = StdRng::seed_from_u64(700);
        let q = up::<bf16>(&g, &uniform(&mut r, t * nh * hd));
        let k = up::<bf16>(&g, &uniform(&mut r, t * nkv * hd));
        let v = up::<bf16>(&g, &uniform(&mut r, t * nkv * hd));
        let pos = g.upload(&(0..t as i64).collect::<Vec<_>>()).unwrap();
        let mut a = up::<bf16>(&g, &vec![f32::NAN; t * nh * hd]);
        let mut b = up::<bf16>(&g, &vec![f32::NAN; t * nh * hd]);
        attn::prefill_flash(&g, &q, &pos, &k, &v, &pos, &mut a, t, t, nh, nkv, hd).unwrap();
        let opts = attn::FlashWgOpts {
            split: None,
            kernel,
        };
        attn::prefill_flash_wg_with(&g, &q, &pos, &k, &v, &pos, &mut b, t, t, nh, nkv, hd, opts)
            .unwrap();
        g.sync().unwrap();
        let (a, b) = (down(&g, &a, t * nh * hd), down(&g, &b, t * nh * hd));
        let (tol, tol_max) = tols::<bf16>();
        f.check(
            &format!("causal 4096 16/2×256: flash-wg ({kernel:?}) vs flash"),
            &b,
            &a,
            tol,
            tol_max,
        );
        f.assert_none(test);
    }

    #[test]
    fn flash_wg_errors_are_errors() {
        let Some((g, _l)) = gpu("flash_wg_errors_are_errors") else {
            return;
        };
        let (tq, n, nh, nkv) = (70usize, 70usize, 4usize, 2usize);
        let pos = g.upload(&(0..70i64).collect::<Vec<_>>()).unwrap();
        // f32 is not supported (on any device).
        let hd = 128;
        let z = |len: usize| g.zeros::<f32>(len).unwrap();
        let (q, k, v) = (z(tq * nh * hd), z(n * nkv * hd), z(n * nkv * hd));
        let mut o = z(tq * nh * hd);
        let e = attn::prefill_flash_wg(&g, &q, &pos, &k, &v, &pos, &mut o, tq, n, nh, nkv, hd);
        println!("flash-wg f32: {e:?}");
        assert!(matches!(e, Err(dataplane::cuda::CudaError::Shape(_))));
        // head_dim 64 is not compiled.
        let hd = 64;
        let zb = |len: usize| g.zeros::<bf16>(len).unwrap();
        let (q, k, v) = (zb(tq * nh * hd), zb(n * nkv * hd), zb(n * nkv * hd));
        let mut o = zb(tq * nh * hd);
        let e = attn::prefill_flash_wg(&g, &q, &pos, &k, &v, &pos, &mut o, tq, n, nh, nkv, hd);
        println!("flash-wg hd 64: {e:?}");
        assert!(matches!(e, Err(dataplane::cuda::CudaError::Shape(_))));
        // A supported shape: runs on sm_90, Unavailable on any other device.
        let hd = 256;
        let (q, k, v) = (zb(tq * nh * hd), zb(n * nkv * hd), zb(n * nkv * hd));
        let mut o = zb(tq * nh * hd);
        let e = attn::prefill_flash_wg(&g, &q, &pos, &k, &v, &pos, &mut o, tq, n, nh, nkv, hd);
        println!("flash-wg on {}: {e:?}", g.arch());
        if g.arch() == "sm_90a" {
            assert!(e.is_ok(), "flash-wg hd 256 on sm_90: {e:?}");
        } else {
            assert!(matches!(e, Err(dataplane::cuda::CudaError::Unavailable(_))));
        }
    }
}
