//! GPU-vs-CPU equivalence tests of the CUDA kernels (issue 6).
//!
//! Built only with `--features cuda` (without it this binary has no tests); built
//! with the feature, every test needs a usable CUDA device and fails without one.
//! Run on the GPU machine through `scripts/gpu-check.sh`.
//!
//! Every test draws fresh seeded random inputs (never zeros), runs the kernel on the
//! GPU, and compares with the CPU reference of the same function: it prints and
//! asserts the norm-wise relative error `‖gpu − cpu‖ / ‖cpu‖` and the max relative
//! error `max|gpu − cpu| / max|cpu|` against the tolerance stated in each test.
//! Output buffers are poisoned (NaN) before each kernel, so an unwritten element fails.

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

    use dataplane::cuda::{self, attn, gdr, ops, transition, CudaSlice, Elem, Gpu};
    use dataplane::linear::gdr::{self as cpu_gdr, GdrDims};
    use dataplane::linear::transition::{Pair, TransitionKind};
    use dataplane::state::KvCache;
    use half::bf16;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The device, opened once; tests hold the lock so that they use the stream and
    /// the cuBLAS handle one at a time.
    fn gpu() -> (Arc<Gpu>, MutexGuard<'static, ()>) {
        static G: OnceLock<Arc<Gpu>> = OnceLock::new();
        static L: Mutex<()> = Mutex::new(());
        let guard = L.lock().unwrap_or_else(|e| e.into_inner());
        let g = G
            .get_or_init(|| {
                Gpu::new(0).unwrap_or_else(|e| {
                    panic!("these tests need a CUDA device ({e}); build without --features cuda to skip them")
                })
            })
            .clone();
        (g, guard)
    }

    fn rng(seed: u64) -> StdRng {
        StdRng::seed_from_u64(seed)
    }

    fn uniform(r: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| r.random_range(lo..hi)).collect()
    }

    fn unit_rows(r: &mut StdRng, n: usize, dim: usize, scale: f32) -> Vec<f32> {
        let mut x = uniform(r, n * dim, -1.0, 1.0);
        for row in x.chunks_mut(dim) {
            let nrm = row.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
            row.iter_mut().for_each(|a| *a *= scale / nrm);
        }
        x
    }

    /// (norm-wise relative error, max relative error).
    fn errs(a: &[f32], b: &[f32]) -> (f64, f64) {
        assert_eq!(a.len(), b.len(), "length");
        let mut num = 0f64;
        let mut den = 0f64;
        let mut maxd = 0f64;
        let mut maxb = 0f64;
        for (&x, &y) in a.iter().zip(b) {
            let d = (x as f64 - y as f64).abs();
            if x.is_nan() {
                return (f64::NAN, f64::NAN);
            }
            num += d * d;
            den += (y as f64) * (y as f64);
            maxd = maxd.max(d);
            maxb = maxb.max((y as f64).abs());
        }
        ((num / den.max(1e-300)).sqrt(), maxd / maxb.max(1e-300))
    }

    #[track_caller]
    fn check(what: &str, gpu: &[f32], cpu: &[f32], tol_norm: f64, tol_max: f64) {
        let (n, m) = errs(gpu, cpu);
        println!("{what}: rel {n:.2e} (tol {tol_norm:.0e}), max rel {m:.2e} (tol {tol_max:.0e})");
        assert!(
            n <= tol_norm && m <= tol_max,
            "{what}: rel {n:e} max rel {m:e} over tolerance"
        );
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

    /// The values a bf16 upload really holds (so that the CPU reference sees them).
    fn round_bf16(x: &[f32]) -> Vec<f32> {
        x.iter().map(|&a| bf16::from_f32(a).to_f32()).collect()
    }

    fn poisoned<T: Elem>(g: &Gpu, n: usize) -> CudaSlice<T> {
        up::<T>(g, &vec![f32::NAN; n.max(1)])
    }

    #[test]
    fn kernels_compile_and_cache() {
        let (g, _l) = gpu();
        println!("device {} arch {}", g.name(), g.arch());
        g.warm_up().unwrap();
        for (m, o, s) in g.compile_log() {
            println!("module {m}: {o:?} in {s:.3} s");
        }
        // A fresh cache folder: first compile, then a hit.
        let dir = std::env::temp_dir().join(format!("hypic-kcache-{}", std::process::id()));
        let (a, o1) =
            cuda::compile::compile_cubin(&cuda::compile::NORM, g.arch(), Some(&dir)).unwrap();
        let (b, o2) =
            cuda::compile::compile_cubin(&cuda::compile::NORM, g.arch(), Some(&dir)).unwrap();
        assert_eq!(o1, cuda::compile::Origin::Compiled);
        assert_eq!(o2, cuda::compile::Origin::DiskCache);
        assert_eq!(a, b);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The scratch cache hands a dropped buffer of the same byte size back (same device
    /// address, counted as a hit; data written through it reads back), never caches
    /// past its capacity or when it is 0, forgets buffers taken out with `into_slice`,
    /// and frees everything on `flush`.
    #[test]
    fn scratch_cache_reuses_buffers_by_size() {
        use cudarc::driver::DevicePtr;
        let (g, _l) = gpu();
        let cache = g.scratch_cache().clone();
        let cap0 = cache.capacity();
        cache.set_capacity(64 << 20);
        cache.flush();
        let addr = |b: &CudaSlice<f32>| b.device_ptr(g.stream()).0;
        let s0 = cache.stats();
        let a = g.scratch::<f32>(1000).unwrap();
        let pa = addr(&a);
        drop(a);
        assert_eq!(cache.stats().held_bytes, 4000);
        // Same bytes, another element type: the same buffer.
        let b = g.scratch::<u32>(1000).unwrap();
        assert_eq!(b.device_ptr(g.stream()).0, pa);
        assert_eq!(cache.stats().held_bytes, 0);
        drop(b);
        // Data round trip through a reused buffer.
        let mut c = g.scratch::<f32>(1000).unwrap();
        assert_eq!(addr(&c), pa);
        let want: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        g.stream().memcpy_htod(&want, &mut *c).unwrap();
        assert_eq!(g.download(&c).unwrap(), want);
        // Another size: a miss, a different buffer.
        let d = g.scratch::<f32>(1001).unwrap();
        assert_ne!(addr(&d), pa);
        let s1 = cache.stats();
        assert_eq!(s1.hits - s0.hits, 2);
        assert_eq!(s1.misses - s0.misses, 2);
        // Taken out: not returned.
        let plain = c.into_slice();
        drop(plain);
        drop(d);
        assert_eq!(cache.stats().held_bytes, 1001 * 4);
        // Larger than an eighth of the capacity: freed, not cached.
        drop(g.scratch::<u8>(9 << 20).unwrap());
        assert_eq!(cache.stats().held_bytes, 1001 * 4);
        // Capacity 0: nothing is kept; a smaller capacity frees what is held.
        cache.set_capacity(0);
        assert_eq!(cache.stats().held_bytes, 0);
        drop(g.scratch::<f32>(1000).unwrap());
        assert_eq!(cache.stats().held_bytes, 0);
        cache.set_capacity(64 << 20);
        drop(g.scratch::<f32>(10).unwrap());
        assert_eq!(cache.stats().held_bytes, 40);
        cache.flush();
        assert_eq!(cache.stats().held_bytes, 0);
        g.sync().unwrap();
        cache.set_capacity(cap0);
    }

    #[test]
    fn device_auto_selects_cuda() {
        let (_g, _l) = gpu();
        let b = cuda::device::select(cuda::device::DeviceChoice::Auto).unwrap();
        println!("auto → {}", b.describe());
        assert!(matches!(b, cuda::device::Backend::Cuda(_)));
        assert!(matches!(
            cuda::device::select("cpu".parse().unwrap()).unwrap(),
            cuda::device::Backend::Cpu
        ));
    }

    /// bf16 projections of ≤ 8 rows take the GEMV kernel (`blas::linear`): against an
    /// fp64 product of the same bf16-rounded inputs, and against cuBLAS (the same rows
    /// inside a 9-row product, which cuBLAS computes).
    #[test]
    fn small_batch_linear_matches_cpu_and_cublas() {
        let (g, _l) = gpu();
        let mut r = rng(77);
        for &(inp, out) in &[(64usize, 1usize), (2048, 37), (512, 1000), (4096, 2048)] {
            let x9 = round_bf16(&uniform(&mut r, 9 * inp, -1.0, 1.0));
            let w = round_bf16(&uniform(&mut r, out * inp, -0.1, 0.1));
            let wd = up::<bf16>(&g, &w);
            let mut y9 = poisoned::<bf16>(&g, 9 * out);
            cuda::blas::linear(
                &g,
                &up::<bf16>(&g, &x9),
                9,
                inp,
                &wd,
                out,
                &mut y9,
                bf16::ZERO,
            )
            .unwrap();
            let y9 = down(&g, &y9, 9 * out);
            for t in 1..=cuda::blas::GEMV_MAX_ROWS {
                let x = &x9[..t * inp];
                let mut y = poisoned::<bf16>(&g, t * out);
                cuda::blas::linear(&g, &up::<bf16>(&g, x), t, inp, &wd, out, &mut y, bf16::ZERO)
                    .unwrap();
                let y = down(&g, &y, t * out);
                let cpu: Vec<f32> = (0..t * out)
                    .map(|i| {
                        let (row, o) = (i / out, i % out);
                        (0..inp)
                            .map(|j| x[row * inp + j] as f64 * w[o * inp + j] as f64)
                            .sum::<f64>() as f32
                    })
                    .collect();
                check(
                    &format!("gemv bf16 t={t} {inp}→{out} vs cpu"),
                    &y,
                    &cpu,
                    5e-3,
                    5e-2,
                );
                check(
                    &format!("gemv bf16 t={t} {inp}→{out} vs cublas"),
                    &y,
                    &y9[..t * out],
                    5e-3,
                    5e-2,
                );
            }
        }
    }

    fn rmsnorm_case<T: Elem>(tol: f64) {
        let (g, _l) = gpu();
        for &(rows, d) in &[(37usize, 128usize), (9, 2048)] {
            let mut r = rng(rows as u64 * 31 + d as u64);
            let mut x = uniform(&mut r, rows * d, -2.0, 2.0);
            let mut z = uniform(&mut r, rows * d, -3.0, 3.0);
            let w = uniform(&mut r, d, -0.5, 1.5);
            if T::SUFFIX == "bf16" {
                x = round_bf16(&x);
                z = round_bf16(&z);
            }
            let (xd, zd, wd) = (up::<T>(&g, &x), up::<T>(&g, &z), g.upload(&w).unwrap());
            for kind in [
                ops::NormKind::Plain,
                ops::NormKind::ZeroCentred,
                ops::NormKind::Gated,
            ] {
                let mut y = poisoned::<T>(&g, rows * d);
                ops::rms_norm(&g, kind, &xd, Some(&zd), &wd, &mut y, rows, 1e-6).unwrap();
                let got = down(&g, &y, rows * d);
                let mut want = x.clone();
                match kind {
                    ops::NormKind::Plain => dataplane::ops::rms_norm(&mut want, &w, 1e-6),
                    ops::NormKind::ZeroCentred => {
                        dataplane::ops::rms_norm_zero_centred(&mut want, &w, 1e-6)
                    }
                    ops::NormKind::Gated => {
                        dataplane::ops::rms_norm(&mut want, &w, 1e-6);
                        want.iter_mut()
                            .zip(&z)
                            .for_each(|(o, zi)| *o *= dataplane::ops::silu(*zi));
                    }
                }
                check(
                    &format!("rmsnorm {kind:?} {} rows={rows} d={d}", T::SUFFIX),
                    &got,
                    &want,
                    tol,
                    4.0 * tol,
                );
            }
        }
    }

    #[test]
    fn rmsnorm_f32_matches_cpu() {
        rmsnorm_case::<f32>(1e-6);
    }

    #[test]
    fn rmsnorm_bf16_matches_cpu() {
        // Output rounded to bf16 (8 bits of mantissa): ≤ 2^-9 relative per element.
        rmsnorm_case::<bf16>(4e-3);
    }

    #[test]
    fn rope_and_rerotation_match_cpu() {
        let (g, _l) = gpu();
        // Qwen3-Next attention: 256-dim heads, 64 rotary dims, θ = 1e7; GQA K with 2 heads.
        let (nt, nh, hd, rot, theta) = (50usize, 2usize, 256usize, 64usize, 1.0e7f64);
        let mut r = rng(5);
        let x = uniform(&mut r, nt * nh * hd, -1.0, 1.0);
        let pos: Vec<i64> = (0..nt).map(|_| r.random_range(0..300_000i64)).collect();
        let cpu_rope = dataplane::ops::Rope::new(rot, theta);
        let inv = g.upload(&ops::rope_inv_freq(rot, theta)).unwrap();
        let mut xd = up::<f32>(&g, &x);
        let pd = g.upload(&pos).unwrap();
        ops::rope(&g, &mut xd, Some(&pd), 0, &inv, nt, nh, hd).unwrap();
        let got = down(&g, &xd, x.len());
        let mut want = x.clone();
        for (t, row) in want.chunks_mut(nh * hd).enumerate() {
            cpu_rope.apply(row, hd, pos[t]);
        }
        check("rope f32 (pos < 3e5)", &got, &want, 1e-6, 1e-5);
        // Re-rotation of cached keys from a to b: R(b − a) on keys already at a.
        let delta = -12_345i64;
        ops::rope(&g, &mut xd, None, delta, &inv, nt, nh, hd).unwrap();
        let got2 = down(&g, &xd, x.len());
        for row in want.chunks_mut(nh * hd) {
            cpu_rope.apply(row, hd, delta);
        }
        check("rope re-rotation R(b-a) f32", &got2, &want, 1e-6, 1e-5);
        // bf16 storage.
        let xr = round_bf16(&x);
        let mut xb = up::<bf16>(&g, &xr);
        ops::rope(&g, &mut xb, Some(&pd), 7, &inv, nt, nh, hd).unwrap();
        let got3 = down(&g, &xb, x.len());
        let mut want3 = xr.clone();
        for (t, row) in want3.chunks_mut(nh * hd).enumerate() {
            cpu_rope.apply(row, hd, pos[t] + 7);
        }
        check("rope bf16", &got3, &want3, 4e-3, 1e-2);
    }

    /// CPU causal conv (the code of `model::gdn_inputs`): returns (y [T, C], new tail).
    fn conv_cpu(
        x: &[f32],
        xs: usize,
        w: &[f32],
        tail: &[f32],
        t: usize,
        c: usize,
        k: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let km1 = k - 1;
        let input = |tau: isize, ch: usize| -> f32 {
            if tau >= 0 {
                x[tau as usize * xs + ch]
            } else {
                tail[ch * km1 + (km1 as isize + tau) as usize]
            }
        };
        let mut y = vec![0f32; t * c];
        for ti in 0..t {
            for ch in 0..c {
                let mut acc = 0f32;
                for j in 0..k {
                    acc += w[ch * k + j] * input(ti as isize - km1 as isize + j as isize, ch);
                }
                y[ti * c + ch] = dataplane::ops::silu(acc);
            }
        }
        let mut nt = vec![0f32; c * km1];
        for ch in 0..c {
            for j in 0..km1 {
                nt[ch * km1 + j] = input(t as isize - km1 as isize + j as isize, ch);
            }
        }
        (y, nt)
    }

    #[test]
    fn conv1d_prefill_and_update_match_cpu() {
        let (g, _l) = gpu();
        let (c, k, xs) = (96usize, 4usize, 106usize);
        for &t in &[1usize, 2, 7, 50] {
            let mut r = rng(100 + t as u64);
            let x = uniform(&mut r, t * xs, -2.0, 2.0);
            let w = uniform(&mut r, c * k, -1.0, 1.0);
            let tail0 = uniform(&mut r, c * (k - 1), -1.0, 1.0);
            let (want_y, want_tail) = conv_cpu(&x, xs, &w, &tail0, t, c, k);
            let xd = up::<f32>(&g, &x);
            let wd = g.upload(&w).unwrap();
            let mut td = g.upload(&tail0).unwrap();
            let mut y = poisoned::<f32>(&g, t * c);
            ops::conv1d_prefill(&g, &xd, xs, &wd, &mut td, &mut y, t, c, k, true).unwrap();
            check(
                &format!("conv1d prefill T={t} y"),
                &down(&g, &y, t * c),
                &want_y,
                1e-6,
                1e-5,
            );
            check(
                &format!("conv1d prefill T={t} tail"),
                &g.download(&td).unwrap(),
                &want_tail,
                0.0,
                0.0,
            );
            // Three decode steps from the new tail.
            let mut tail = want_tail.clone();
            for s in 0..3 {
                let xt = uniform(&mut r, c, -2.0, 2.0);
                let (wy, wt) = conv_cpu(&xt, c, &w, &tail, 1, c, k);
                let xtd = up::<f32>(&g, &xt);
                let mut yd = poisoned::<f32>(&g, c);
                ops::conv1d_update(&g, &xtd, &wd, &mut td, &mut yd, c, k, true).unwrap();
                check(
                    &format!("conv1d update step {s} y"),
                    &down(&g, &yd, c),
                    &wy,
                    1e-6,
                    1e-5,
                );
                check(
                    &format!("conv1d update step {s} tail"),
                    &g.download(&td).unwrap(),
                    &wt,
                    0.0,
                    0.0,
                );
                tail = wt;
            }
        }
    }

    struct GdnCase {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
        s0: Vec<f32>,
    }

    fn gdn_case(d: &GdrDims, seed: u64, g_scale: f32, bf: bool) -> GdnCase {
        let mut r = rng(seed);
        let mut q = unit_rows(&mut r, d.t * d.hk, d.dk, (d.dk as f32).powf(-0.5));
        let mut k = unit_rows(&mut r, d.t * d.hk, d.dk, 1.0);
        let mut v = uniform(&mut r, d.t * d.hv * d.dv, -1.0, 1.0);
        let g = uniform(&mut r, d.t * d.hv, -2.0 * g_scale, 0.0);
        let beta = uniform(&mut r, d.t * d.hv, 1e-3, 1.0);
        let s0 = uniform(&mut r, d.state_len(), -1.0, 1.0);
        if bf {
            q = round_bf16(&q);
            k = round_bf16(&k);
            v = round_bf16(&v);
        }
        GdnCase {
            q,
            k,
            v,
            g,
            beta,
            s0,
        }
    }

    struct GdnDev<T: Elem> {
        q: CudaSlice<T>,
        k: CudaSlice<T>,
        v: CudaSlice<T>,
        g: CudaSlice<f32>,
        beta: CudaSlice<f32>,
        s: CudaSlice<f32>,
        o: CudaSlice<T>,
    }

    fn gdn_dev<T: Elem>(gp: &Gpu, d: &GdrDims, c: &GdnCase) -> GdnDev<T> {
        GdnDev {
            q: up(gp, &c.q),
            k: up(gp, &c.k),
            v: up(gp, &c.v),
            g: gp.upload(&c.g).unwrap(),
            beta: gp.upload(&c.beta).unwrap(),
            s: gp.upload(&c.s0).unwrap(),
            o: poisoned(gp, d.t * d.hv * d.dv),
        }
    }

    fn gdr_recurrent_case<T: Elem>(tol_o: f64, tol_s: f64) {
        let (g, _l) = gpu();
        for &(t, dk, dv) in &[
            (1usize, 128usize, 128usize),
            (1, 64, 80),
            (20, 128, 96),
            (7, 256, 64),
        ] {
            let d = GdrDims {
                t,
                hk: 2,
                hv: 4,
                dk,
                dv,
            };
            let c = gdn_case(&d, 11 + t as u64 + dk as u64, 1.0, T::SUFFIX == "bf16");
            let mut dev = gdn_dev::<T>(&g, &d, &c);
            cuda::gdr::recurrent(
                &g, &d, &dev.q, &dev.k, &dev.v, &dev.g, &dev.beta, &mut dev.s, &mut dev.o,
            )
            .unwrap();
            let mut s = c.s0.clone();
            let o = cpu_gdr::recurrent(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s);
            let tag = format!("gdr recurrent {} T={t} dk={dk} dv={dv}", T::SUFFIX);
            check(
                &format!("{tag} out"),
                &down(&g, &dev.o, o.len()),
                &o,
                tol_o,
                10.0 * tol_o,
            );
            check(
                &format!("{tag} state"),
                &g.download(&dev.s).unwrap(),
                &s,
                tol_s,
                10.0 * tol_s,
            );
        }
    }

    #[test]
    fn gdr_recurrent_decode_f32_matches_cpu() {
        gdr_recurrent_case::<f32>(1e-5, 1e-5);
    }

    #[test]
    fn gdr_recurrent_decode_bf16_matches_cpu() {
        // Inputs identical after rounding; the output is rounded to bf16, the state is fp32.
        gdr_recurrent_case::<bf16>(4e-3, 1e-5);
    }

    fn gdr_chunked_case<T: Elem>(tol_o: f64, tol_s: f64) {
        let (g, _l) = gpu();
        let mut ws = gdr::Workspace::new();
        // The fp32 SIMT kernels (bf16 inputs widened); the tensor-core path for bf16 has
        // its own test below.
        ws.force_path(Some(gdr::ChunkedPath::Simt));
        for &t in &[1usize, 63, 64, 65, 200, 1000] {
            let d = GdrDims {
                t,
                hk: 2,
                hv: 4,
                dk: 128,
                dv: 128,
            };
            let c = gdn_case(&d, 40 + t as u64, 1.0, T::SUFFIX == "bf16");
            let mut dev = gdn_dev::<T>(&g, &d, &c);
            gdr::chunked(
                &g, &d, &dev.q, &dev.k, &dev.v, &dev.g, &dev.beta, &mut dev.s, &mut dev.o, None,
                &mut ws,
            )
            .unwrap();
            // Reference: the CPU chunked kernel (itself tested against the recurrence).
            let mut s = c.s0.clone();
            let o = cpu_gdr::chunked(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s, 64);
            let tag = format!("gdr chunked {} T={t}", T::SUFFIX);
            check(
                &format!("{tag} out"),
                &down(&g, &dev.o, o.len()),
                &o,
                tol_o,
                10.0 * tol_o,
            );
            check(
                &format!("{tag} state"),
                &g.download(&dev.s).unwrap(),
                &s,
                tol_s,
                10.0 * tol_s,
            );
        }
    }

    #[test]
    fn gdr_chunked_prefill_f32_matches_cpu() {
        gdr_chunked_case::<f32>(1e-4, 1e-4);
    }

    #[test]
    fn gdr_chunked_prefill_bf16_matches_cpu() {
        gdr_chunked_case::<bf16>(5e-3, 1e-4);
    }

    /// One case of the bf16 tensor-core chunked prefill: runs it and the fp32 SIMT
    /// kernels on the same bf16 inputs from the
    /// same nonzero state, optionally with the transition, and checks both against the
    /// CPU `chunked` / `chunked_with_transition` (fp32, on the bf16-rounded inputs).
    /// Tolerances are norm-wise relative L2 (max relative: 10×): `tol` for output and
    /// state, `tol_t` for `T_C`.
    #[allow(clippy::too_many_arguments)]
    fn gdr_tc_case(
        g: &Gpu,
        ws_tc: &mut gdr::Workspace,
        ws_simt: &mut gdr::Workspace,
        d: &GdrDims,
        gates: (&str, f32, f32),
        with_t: bool,
        seed: u64,
        tol: f64,
        tol_t: f64,
    ) {
        let mut c = gdn_case(d, seed, 1.0, true);
        let mut r = rng(seed ^ 0x9e37);
        c.g = uniform(&mut r, d.t * d.hv, gates.1, gates.2);
        let run = |ws: &mut gdr::Workspace| {
            let mut dev = gdn_dev::<bf16>(g, d, &c);
            let mut tr = with_t.then(|| poisoned::<f32>(g, d.hv * d.dk * d.dk));
            match tr.as_mut() {
                Some(tr) => gdr::chunked_with_transition(
                    g, d, &dev.q, &dev.k, &dev.v, &dev.g, &dev.beta, &mut dev.s, &mut dev.o, tr, ws,
                ),
                None => gdr::chunked(
                    g, d, &dev.q, &dev.k, &dev.v, &dev.g, &dev.beta, &mut dev.s, &mut dev.o, None,
                    ws,
                ),
            }
            .unwrap();
            (
                down(g, &dev.o, d.t * d.hv * d.dv),
                g.download(&dev.s).unwrap(),
                tr.map(|t| g.download(&t).unwrap()),
            )
        };
        let (o_tc, s_tc, t_tc) = run(ws_tc);
        let (o_simt, s_simt, t_simt) = run(ws_simt);
        let mut s = c.s0.clone();
        let (o, tc) = if with_t {
            let (o, tc) =
                cpu_gdr::chunked_with_transition(d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s, 64);
            (o, Some(tc))
        } else {
            (
                cpu_gdr::chunked(d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s, 64),
                None,
            )
        };
        let tag = format!(
            "gdr chunked tc bf16 T={} Hk={} Hv={} g {} [{}, {}]{}",
            d.t,
            d.hk,
            d.hv,
            gates.0,
            gates.1,
            gates.2,
            if with_t { " +T_C" } else { "" },
        );
        check(&format!("{tag} out vs cpu"), &o_tc, &o, tol, 10.0 * tol);
        check(&format!("{tag} state vs cpu"), &s_tc, &s, tol, 10.0 * tol);
        check(
            &format!("{tag} out vs simt"),
            &o_tc,
            &o_simt,
            tol,
            10.0 * tol,
        );
        check(
            &format!("{tag} state vs simt"),
            &s_tc,
            &s_simt,
            tol,
            10.0 * tol,
        );
        if let (Some(t_tc), Some(t_simt), Some(tc)) = (t_tc, t_simt, tc) {
            check(
                &format!("{tag} T_C vs cpu"),
                &t_tc,
                &tc,
                tol_t,
                10.0 * tol_t,
            );
            check(
                &format!("{tag} T_C vs simt"),
                &t_tc,
                &t_simt,
                tol_t,
                10.0 * tol_t,
            );
        }
    }

    /// The bf16 tensor-core path (the default for bf16) against the CPU reference and
    /// the fp32 SIMT kernels: T ∈ {1, 63, 64, 65, 200, 1000, 4096} (partial and whole
    /// chunks), Hk/Hv = 16/32 and 2/4, gates strongly negative (g ∈ [−20, −4]: the
    /// state keeps ~the last token, T_C flushes to 0) and near 0 (g ∈ [−1e-3, 0]), with
    /// and without T_C. dk = dv = 128 only (the chunked prefill is built for that shape;
    /// others return `CudaError::Shape`).
    ///
    /// Tolerances: the path rounds W, U, K̃, Ũ, P, the state snapshots and the state as
    /// an mma operand to bf16 (unit roundoff 2⁻⁹); the host emulation of these kernels
    /// measured relative L2 errors of 2–3.5e-3 on output and state and ≤ 3e-3 on T_C
    /// (T ≤ 200). Output and state: 1e-2. T_C is a product over all chunks whose
    /// rounding errors add up: 3e-2 up to T = 1000, 6e-2 at T = 4096.
    #[test]
    fn gdr_chunked_tc_bf16_matches_cpu_and_simt() {
        let (g, _l) = gpu();
        let mut ws_tc = gdr::Workspace::new();
        assert_eq!(ws_tc.path::<bf16>(), gdr::ChunkedPath::TensorCores);
        assert_eq!(ws_tc.path::<f32>(), gdr::ChunkedPath::Simt);
        let mut ws_simt = gdr::Workspace::new();
        ws_simt.force_path(Some(gdr::ChunkedPath::Simt));
        let mut case = 0u64;
        for &(hk, hv) in &[(16usize, 32usize), (2, 4)] {
            for &t in &[1usize, 63, 64, 65, 200, 1000, 4096] {
                for gates in [("strong", -20.0f32, -4.0f32), ("near 0", -1e-3, 0.0)] {
                    for with_t in [false, true] {
                        case += 1;
                        let d = GdrDims {
                            t,
                            hk,
                            hv,
                            dk: 128,
                            dv: 128,
                        };
                        let tol_t = if t > 1000 { 6e-2 } else { 3e-2 };
                        gdr_tc_case(
                            &g,
                            &mut ws_tc,
                            &mut ws_simt,
                            &d,
                            gates,
                            with_t,
                            500 + case,
                            1e-2,
                            tol_t,
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn gdr_chunked_gva_16_32_matches_recurrent() {
        // The benchmark shape (Hk = 16, Hv = 32) at T = 300, against the token recurrence.
        let (g, _l) = gpu();
        let d = GdrDims {
            t: 300,
            hk: 16,
            hv: 32,
            dk: 128,
            dv: 128,
        };
        let c = gdn_case(&d, 77, 1.0, false);
        let mut dev = gdn_dev::<f32>(&g, &d, &c);
        let mut ws = gdr::Workspace::new();
        gdr::chunked(
            &g, &d, &dev.q, &dev.k, &dev.v, &dev.g, &dev.beta, &mut dev.s, &mut dev.o, None,
            &mut ws,
        )
        .unwrap();
        let mut s = c.s0.clone();
        let o = cpu_gdr::recurrent(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s);
        check(
            "gdr chunked Hk=16 Hv=32 T=300 out vs recurrent",
            &down(&g, &dev.o, o.len()),
            &o,
            1e-4,
            1e-3,
        );
        check(
            "gdr chunked Hk=16 Hv=32 T=300 state vs recurrent",
            &g.download(&dev.s).unwrap(),
            &s,
            1e-4,
            1e-3,
        );
    }

    #[test]
    fn gdr_chunked_transition_matches_cpu() {
        let (g, _l) = gpu();
        let mut ws = gdr::Workspace::new();
        // g×1 over 65 tokens decays T_C to ~e^-65: both sides flush it to exactly 0
        // (entries below 2^-40, linear::gdr FLUSH_UNIT).
        for &(t, gs) in &[(65usize, 1.0f32), (130, 0.1), (200, 0.01), (1000, 0.002)] {
            let d = GdrDims {
                t,
                hk: 2,
                hv: 4,
                dk: 128,
                dv: 128,
            };
            let c = gdn_case(&d, 900 + t as u64, gs, false);
            let mut dev = gdn_dev::<f32>(&g, &d, &c);
            let mut tr = poisoned::<f32>(&g, d.hv * d.dk * d.dk);
            gdr::chunked_with_transition(
                &g, &d, &dev.q, &dev.k, &dev.v, &dev.g, &dev.beta, &mut dev.s, &mut dev.o, &mut tr,
                &mut ws,
            )
            .unwrap();
            let mut s = c.s0.clone();
            let (o, tc) =
                cpu_gdr::chunked_with_transition(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s, 64);
            let tag = format!("gdr chunked+T T={t} g×{gs}");
            check(
                &format!("{tag} T_C"),
                &g.download(&tr).unwrap(),
                &tc,
                1e-4,
                1e-3,
            );
            check(
                &format!("{tag} out"),
                &down(&g, &dev.o, o.len()),
                &o,
                1e-4,
                1e-3,
            );
            check(
                &format!("{tag} state"),
                &g.download(&dev.s).unwrap(),
                &s,
                1e-4,
                1e-3,
            );
        }
    }

    fn random_dense_pair(r: &mut StdRng, hv: usize, dk: usize, dv: usize) -> Pair {
        let t = uniform(r, hv * dk * dk, -0.1, 0.1);
        let b = uniform(r, hv * dk * dv, -1.0, 1.0);
        Pair::from_parts(TransitionKind::Dense, hv, dk, dv, t, b).unwrap()
    }

    #[test]
    fn transition_compose_and_apply_match_cpu() {
        let (g, _l) = gpu();
        let (hv, dk, dv) = (32usize, 128usize, 128usize);
        let mut r = rng(3);
        let pa = random_dense_pair(&mut r, hv, dk, dv);
        let pb = random_dense_pair(&mut r, hv, dk, dv);
        let s0 = uniform(&mut r, hv * dk * dv, -1.0, 1.0);
        let (da, db) = (
            transition::DensePair::upload(&g, &pa).unwrap(),
            transition::DensePair::upload(&g, &pb).unwrap(),
        );
        let comp = db.compose(&g, &da).unwrap().download(&g).unwrap();
        let want = pb.compose(&pa).unwrap();
        check("dense compose T_B T_A", comp.t(), want.t(), 1e-5, 1e-4);
        check(
            "dense compose T_B B_A + B_B",
            comp.b(),
            want.b(),
            1e-5,
            1e-4,
        );
        let sd = g.upload(&s0).unwrap();
        let mut out = poisoned::<f32>(&g, s0.len());
        db.apply_into(&g, &sd, &mut out).unwrap();
        let mut ws = s0.clone();
        pb.apply(&mut ws).unwrap();
        check(
            "dense apply T S + B",
            &g.download(&out).unwrap(),
            &ws,
            1e-5,
            1e-4,
        );
        // Pair from a real GDN segment on the GPU == CPU pair (via the transition kernel).
        let d = GdrDims {
            t: 130,
            hk: 2,
            hv: 4,
            dk: 128,
            dv: 128,
        };
        let c = gdn_case(&d, 8, 0.01, false);
        let mut dev = gdn_dev::<f32>(&g, &d, &c);
        g.stream().memset_zeros(&mut dev.s).unwrap();
        let mut tr = g.zeros::<f32>(d.hv * 128 * 128).unwrap();
        let mut w2 = gdr::Workspace::new();
        gdr::chunked_with_transition(
            &g, &d, &dev.q, &dev.k, &dev.v, &dev.g, &dev.beta, &mut dev.s, &mut dev.o, &mut tr,
            &mut w2,
        )
        .unwrap();
        let gp = transition::DensePair {
            hv: 4,
            dk: 128,
            dv: 128,
            t: tr,
            b: dev.s,
        };
        // Apply to s0 on the GPU and compare with running the segment from s0 on the CPU.
        let s0d = g.upload(&c.s0).unwrap();
        let mut outd = poisoned::<f32>(&g, c.s0.len());
        gp.apply_into(&g, &s0d, &mut outd).unwrap();
        let mut s = c.s0.clone();
        cpu_gdr::recurrent(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s);
        check(
            "GPU pair (T_C, S_C|0) applied to S0 vs CPU recurrence from S0",
            &g.download(&outd).unwrap(),
            &s,
            1e-4,
            1e-3,
        );
    }

    fn attention_case<T: Elem>(nh: usize, nkv: usize, hd: usize, tol: f64) {
        let (g, _l) = gpu();
        let mut r = rng((nh * 1000 + hd) as u64);
        // Seam case: three cached segments placed out of order at arbitrary positions
        // (with a gap), then an 8-token seam window and a query tail at later positions.
        let mut kv_pos: Vec<i64> = Vec::new();
        kv_pos.extend(0..40i64); // system prompt
        kv_pos.extend(1000..1077i64); // segment moved to 1000
        kv_pos.extend(200..261i64); // segment at 200, stored after the one at 1000
        let n = kv_pos.len();
        let q_pos: Vec<i64> = (1077..1085i64)
            .chain([5i64, 230, 1050, 100_000, -3])
            .collect();
        let tq = q_pos.len();
        let mut q = uniform(&mut r, tq * nh * hd, -1.0, 1.0);
        let mut k = uniform(&mut r, n * nkv * hd, -1.0, 1.0);
        let mut v = uniform(&mut r, n * nkv * hd, -1.0, 1.0);
        if T::SUFFIX == "bf16" {
            q = round_bf16(&q);
            k = round_bf16(&k);
            v = round_bf16(&v);
        }
        let kv = KvCache {
            k: k.clone(),
            v: v.clone(),
            positions: kv_pos.clone(),
        };
        let want = dataplane::model::attention(&q, &q_pos, &kv, nh, nkv, hd);
        let (qd, kd, vd) = (up::<T>(&g, &q), up::<T>(&g, &k), up::<T>(&g, &v));
        let (qp, kp) = (g.upload(&q_pos).unwrap(), g.upload(&kv_pos).unwrap());
        let mut o = poisoned::<T>(&g, tq * nh * hd);
        attn::prefill(&g, &qd, &qp, &kd, &vd, &kp, &mut o, tq, n, nh, nkv, hd).unwrap();
        let got = down(&g, &o, tq * nh * hd);
        // The query at −3 sees nothing: zeros on both sides.
        assert!(got[(tq - 1) * nh * hd..].iter().all(|&x| x == 0.0));
        check(
            &format!("attention seam {} {nh}/{nkv} heads × {hd}", T::SUFFIX),
            &got,
            &want,
            tol,
            10.0 * tol,
        );
    }

    #[test]
    fn attention_seam_f32_matches_cpu() {
        attention_case::<f32>(16, 2, 256, 1e-5);
        attention_case::<f32>(8, 2, 128, 1e-5);
        attention_case::<f32>(4, 4, 64, 1e-5);
    }

    #[test]
    fn attention_seam_bf16_matches_cpu() {
        attention_case::<bf16>(16, 2, 256, 4e-3);
        attention_case::<bf16>(8, 2, 128, 4e-3);
    }

    #[test]
    fn attention_long_causal_matches_cpu() {
        // Contiguous causal prefill, 600 tokens (several key tiles, partial last tile).
        let (g, _l) = gpu();
        let (t, nh, nkv, hd) = (600usize, 4usize, 2usize, 128usize);
        let mut r = rng(42);
        let q = uniform(&mut r, t * nh * hd, -1.0, 1.0);
        let k = uniform(&mut r, t * nkv * hd, -1.0, 1.0);
        let v = uniform(&mut r, t * nkv * hd, -1.0, 1.0);
        let pos: Vec<i64> = (0..t as i64).collect();
        let kv = KvCache {
            k: k.clone(),
            v: v.clone(),
            positions: pos.clone(),
        };
        let want = dataplane::model::attention(&q, &pos, &kv, nh, nkv, hd);
        let (qd, kd, vd) = (up::<f32>(&g, &q), up::<f32>(&g, &k), up::<f32>(&g, &v));
        let pd = g.upload(&pos).unwrap();
        let mut o = poisoned::<f32>(&g, t * nh * hd);
        attn::prefill(&g, &qd, &pd, &kd, &vd, &pd, &mut o, t, t, nh, nkv, hd).unwrap();
        check(
            "attention causal T=600 4/2×128 f32",
            &down(&g, &o, t * nh * hd),
            &want,
            1e-5,
            1e-4,
        );
    }

    #[test]
    fn shape_errors_are_errors_not_panics() {
        let (g, _l) = gpu();
        let d = GdrDims {
            t: 10,
            hk: 2,
            hv: 4,
            dk: 64,
            dv: 128,
        };
        let c = gdn_case(&d, 1, 1.0, false);
        let mut dev = gdn_dev::<f32>(&g, &d, &c);
        let mut ws = gdr::Workspace::new();
        assert!(gdr::chunked(
            &g, &d, &dev.q, &dev.k, &dev.v, &dev.g, &dev.beta, &mut dev.s, &mut dev.o, None,
            &mut ws
        )
        .is_err());
        let short = g.zeros::<f32>(3).unwrap();
        let bad = GdrDims {
            t: 10,
            hk: 2,
            hv: 4,
            dk: 64,
            dv: 128,
        };
        assert!(gdr::recurrent(
            &g, &bad, &dev.q, &dev.k, &dev.v, &short, &dev.beta, &mut dev.s, &mut dev.o
        )
        .is_err());
    }
}
