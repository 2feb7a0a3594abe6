//! GPU benchmark of the HYPIC CUDA kernels (a report, not a test). Needs
//! `--features cuda` and a CUDA device; run through `scripts/gpu-check.sh`.
//!
//! `cargo build --release --features cuda --example gpu_bench`, then
//! `gpu_bench [--quick]`. Prints markdown tables:
//! * gated delta rule chunked prefill, bf16 q/k/v, fp32 state, B = 1, H = 16, HV = 32,
//!   dk = dv = 128 at T = 1k, 4k, 16k, 32k — plain, and with the segment transition
//!   `T_C` (build overhead), per stage, on the default kernels for bf16 (tensor cores),
//!   and per stage on the fp32 SIMT kernels;
//! * one-token recurrent decode step (same heads);
//! * dense pair apply `S ← T S + B` and compose, 32 heads × 128² (per segment cost);
//! * attention prefill (16 q / 2 kv heads × 256, bf16, causal) at 4k and 16k: tiled
//!   kernel, cuBLAS path, flash kernel and, on sm_90, the wgmma kernels `GpuModel` runs
//!   (with each one's output difference to the cuBLAS path);
//! * attention for short spans (1 … 1024 queries) over 16k cached keys, all three;
//! * MoE block, Qwen3.5-35B-A3B shape (hidden 2048, 256 experts, top-8, expert and
//!   shared intermediate 512, bf16) at t = 1, 8, 1024, 4096, with a cuBLAS dense GEMM
//!   of the same total routed rows for comparison.
//!
//! `gpu_bench --moe-grouped` runs only the MoE prefill comparison (gpu-check step
//! `moebench`): the grouped expert GEMMs (`ExpertGemm::TensorCores`, one launch per
//! projection over all experts) against the per-expert cuBLAS loop
//! (`ExpertGemm::PerExpert`) and the `torch._grouped_mm` anchor of issue 18, at
//! t = 1k, 4k, 16k tokens (256 experts, top-8, hidden 2048, expert width 512, no
//! shared expert), with a cuBLAS dense GEMM of the same FLOPs as the GEMM floor.
//!
//! Times are medians of CUDA-event-timed repetitions after warm-up; inputs are
//! random (never zeros).
#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("gpu_bench: build with --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = bench::run() {
        eprintln!("gpu_bench: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod bench {
    use dataplane::cuda::{attn, blas, gdr, moe, transition, CudaSlice, Elem, Gpu, Result};
    use dataplane::linear::gdr::GdrDims;
    use half::bf16;
    use rand::{Rng, SeedableRng};

    fn median(mut v: Vec<f32>) -> f64 {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2] as f64
    }

    /// Median milliseconds of `f` over `reps` event-timed runs after `warm` runs.
    fn time_ms<F: FnMut() -> Result<()>>(
        g: &Gpu,
        warm: usize,
        reps: usize,
        mut f: F,
    ) -> Result<f64> {
        for _ in 0..warm {
            f()?;
        }
        g.sync()?;
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut ts = Vec::with_capacity(reps);
        for _ in 0..reps {
            let a = g.context().new_event(flags)?;
            let b = g.context().new_event(flags)?;
            a.record(g.stream())?;
            f()?;
            b.record(g.stream())?;
            b.synchronize()?;
            ts.push(a.elapsed_ms(&b)?);
        }
        Ok(median(ts))
    }

    fn rand_up<T: Elem>(
        g: &Gpu,
        r: &mut rand::rngs::StdRng,
        n: usize,
        lo: f32,
        hi: f32,
    ) -> Result<CudaSlice<T>> {
        let v: Vec<T> = (0..n)
            .map(|_| T::from_f32(r.random_range(lo..hi)))
            .collect();
        g.upload(&v)
    }

    fn unit_up(
        g: &Gpu,
        r: &mut rand::rngs::StdRng,
        rows: usize,
        dim: usize,
        scale: f32,
    ) -> Result<CudaSlice<bf16>> {
        let mut v: Vec<f32> = (0..rows * dim)
            .map(|_| r.random_range(-1.0f32..1.0))
            .collect();
        for row in v.chunks_mut(dim) {
            let n = row.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
            row.iter_mut().for_each(|a| *a *= scale / n);
        }
        g.upload(&v.iter().map(|&a| bf16::from_f32(a)).collect::<Vec<_>>())
    }

    pub fn run() -> Result<()> {
        let args: Vec<String> = std::env::args().collect();
        if let Some(i) = args.iter().position(|a| a == "--precompile") {
            // Fill the kernel cache ($HYPIC_KERNEL_CACHE) for an architecture without
            // a device (NVRTC only), so the GPU machine does not spend its time compiling.
            let arch = args.get(i + 1).map(String::as_str).unwrap_or("sm_90a");
            let dir = dataplane::cuda::compile::default_cache_dir();
            for s in dataplane::cuda::compile::ALL.iter() {
                let t = std::time::Instant::now();
                let (bin, o) = dataplane::cuda::compile::compile_cubin(s, arch, Some(&dir))?;
                println!(
                    "{} {arch}: {o:?}, {} bytes, {:.1} s",
                    s.name,
                    bin.len(),
                    t.elapsed().as_secs_f64()
                );
            }
            println!("cache: {}", dir.display());
            return Ok(());
        }
        let quick = args.iter().any(|a| a == "--quick");
        let g = Gpu::new(0)?;
        let t0 = std::time::Instant::now();
        g.warm_up()?;
        println!(
            "# gpu_bench\n\ndevice: {} ({}), kernels ready in {:.2} s",
            g.name(),
            g.arch(),
            t0.elapsed().as_secs_f64()
        );
        for (m, o, s) in g.compile_log() {
            println!("- module {m}: {o:?} {s:.3} s");
        }
        if args.iter().any(|a| a == "--moe-grouped") {
            let mut r = rand::rngs::StdRng::seed_from_u64(18);
            return moe_grouped_bench(&g, &mut r);
        }
        if args.iter().any(|a| a == "--kda") {
            let mut r = rand::rngs::StdRng::seed_from_u64(20);
            return kda_bench(&g, &mut r, quick);
        }
        if args.iter().any(|a| a == "--lightning") {
            let mut r = rand::rngs::StdRng::seed_from_u64(19);
            return lightning_bench(&g, &mut r, quick);
        }
        host_costs(&g)?;
        let mut r = rand::rngs::StdRng::seed_from_u64(1);
        let (hk, hv, dk, dv) = (16usize, 32usize, 128usize, 128usize);
        let lens: &[usize] = if quick {
            &[1024, 4096]
        } else {
            &[1024, 4096, 16384, 32768]
        };
        let mut ws = gdr::Workspace::new();
        println!("\n## Gated delta rule chunked prefill (bf16 in, fp32 state; H={hk}, HV={hv}, dk=dv={dk})\n");
        println!(
            "Kernels: {}; the fp32 SIMT kernels in the per-stage table below.\n",
            match ws.path::<bf16>() {
                gdr::ChunkedPath::TensorCores => {
                    "bf16 tensor cores (kernels/gdr_tc.cu: gdr_prep_tc2_bf16, \
                     gdr_state_tc_bf16_32, gdr_output_tc2_bf16)"
                }
                gdr::ChunkedPath::Simt => "fp32 SIMT (kernels/gdr.cu)",
            },
        );
        println!("| T | prefill ms | prefill + T_C ms | T_C overhead | Mtok/s |");
        println!("|---|---|---|---|---|");
        let mut stages: Vec<(usize, f64, f64, f64)> = Vec::new();
        // (T, kernels, prefill ms, stage ms A/B/C) of the other kernels, same inputs.
        let mut others: Vec<(usize, String, f64, [f64; 3])> = Vec::new();
        for &t in lens {
            let d = GdrDims { t, hk, hv, dk, dv };
            let q = unit_up(&g, &mut r, t * hk, dk, (dk as f32).powf(-0.5))?;
            let k = unit_up(&g, &mut r, t * hk, dk, 1.0)?;
            let v = rand_up::<bf16>(&g, &mut r, t * hv * dv, -1.0, 1.0)?;
            let gg = rand_up::<f32>(&g, &mut r, t * hv, -0.1, 0.0)?;
            let beta = rand_up::<f32>(&g, &mut r, t * hv, 0.01, 1.0)?;
            let s0 = rand_up::<f32>(&g, &mut r, hv * dk * dv, -1.0, 1.0)?;
            let mut s = g.stream().clone_dtod(&s0)?;
            let mut o = g.zeros::<bf16>(t * hv * dv)?;
            let mut tr = g.zeros::<f32>(hv * dk * dk)?;
            let reps = if t >= 16384 { 10 } else { 30 };
            let plain = time_ms(&g, 3, reps, || {
                gdr::chunked(
                    &g, &d, &q, &k, &v, &gg, &beta, &mut s, &mut o, None, &mut ws,
                )
            })?;
            let with_t = time_ms(&g, 3, reps, || {
                gdr::chunked_with_transition(
                    &g, &d, &q, &k, &v, &gg, &beta, &mut s, &mut o, &mut tr, &mut ws,
                )
            })?;
            // Plain again, so that clock ramp-up in the first measurement does not
            // flatter the transition build; the smaller of the two is reported.
            let plain2 = time_ms(&g, 3, reps, || {
                gdr::chunked(
                    &g, &d, &q, &k, &v, &gg, &beta, &mut s, &mut o, None, &mut ws,
                )
            })?;
            let plain = plain.min(plain2);
            // Per-stage split (median of 5 event-timed runs of each stage).
            let stage_ms = |ws: &mut gdr::Workspace,
                            s: &mut CudaSlice<f32>,
                            o: &mut CudaSlice<bf16>|
             -> Result<[f64; 3]> {
                let mut st: Vec<[f32; 3]> = Vec::new();
                for _ in 0..5 {
                    st.push(gdr::chunked_stage_ms(
                        &g, &d, &q, &k, &v, &gg, &beta, s, o, None, ws,
                    )?);
                }
                let m = |i: usize| median(st.iter().map(|x| x[i]).collect());
                Ok([m(0), m(1), m(2)])
            };
            let st = stage_ms(&mut ws, &mut s, &mut o)?;
            stages.push((t, st[0], st[1], st[2]));
            println!(
                "| {t} | {plain:.3} | {with_t:.3} | {:+.1} % | {:.1} |",
                100.0 * (with_t / plain - 1.0),
                t as f64 / plain / 1e3
            );
            // The fp32 SIMT kernels on the same inputs.
            {
                let label = "fp32 SIMT".to_string();
                let mut w2 = gdr::Workspace::new();
                w2.force_path(Some(gdr::ChunkedPath::Simt));
                let ms = time_ms(&g, 2, reps.min(10), || {
                    gdr::chunked(
                        &g, &d, &q, &k, &v, &gg, &beta, &mut s, &mut o, None, &mut w2,
                    )
                })?;
                let st = stage_ms(&mut w2, &mut s, &mut o)?;
                others.push((t, label, ms, st));
            }
        }
        println!(
            "\n(workspace: {:.1} MiB)",
            ws.bytes() as f64 / (1 << 20) as f64
        );
        println!("\n| T | A gdr_prep ms | B gdr_state (sequential) ms | C gdr_output ms | B µs per chunk |");
        println!("|---|---|---|---|---|");
        for (t, a, b, c) in &stages {
            println!(
                "| {t} | {a:.3} | {b:.3} | {c:.3} | {:.2} |",
                b * 1e3 / t.div_ceil(64) as f64
            );
        }
        println!("\nOther kernels, same inputs (prefill without T_C):\n");
        println!("| T | kernels | prefill ms | A ms | B ms | C ms | B µs per chunk |");
        println!("|---|---|---|---|---|---|---|");
        for (t, label, ms, st) in &others {
            println!(
                "| {t} | {label} | {ms:.3} | {:.3} | {:.3} | {:.3} | {:.2} |",
                st[0],
                st[1],
                st[2],
                st[1] * 1e3 / t.div_ceil(64) as f64
            );
        }

        println!("\n## One-token recurrent decode step (bf16, H={hk}, HV={hv}, dk=dv={dk})\n");
        {
            let d = GdrDims {
                t: 1,
                hk,
                hv,
                dk,
                dv,
            };
            let q = unit_up(&g, &mut r, hk, dk, (dk as f32).powf(-0.5))?;
            let k = unit_up(&g, &mut r, hk, dk, 1.0)?;
            let v = rand_up::<bf16>(&g, &mut r, hv * dv, -1.0, 1.0)?;
            let gg = rand_up::<f32>(&g, &mut r, hv, -0.1, 0.0)?;
            let beta = rand_up::<f32>(&g, &mut r, hv, 0.01, 1.0)?;
            let mut s = rand_up::<f32>(&g, &mut r, hv * dk * dv, -1.0, 1.0)?;
            let mut o = g.zeros::<bf16>(hv * dv)?;
            let ms = time_ms(&g, 10, 200, || {
                gdr::recurrent(&g, &d, &q, &k, &v, &gg, &beta, &mut s, &mut o)
            })?;
            println!(
                "decode step: {:.1} µs (state read+write {:.1} MiB)",
                ms * 1e3,
                2.0 * (hv * dk * dv * 4) as f64 / (1 << 20) as f64
            );
        }

        println!(
            "\n## Dense pair apply / compose (per segment; HV={hv}, dk=dv={dk}, fp32 cuBLAS)\n"
        );
        {
            let t1 = rand_up::<f32>(&g, &mut r, hv * dk * dk, -0.05, 0.05)?;
            let b1 = rand_up::<f32>(&g, &mut r, hv * dk * dv, -1.0, 1.0)?;
            let t2 = rand_up::<f32>(&g, &mut r, hv * dk * dk, -0.05, 0.05)?;
            let b2 = rand_up::<f32>(&g, &mut r, hv * dk * dv, -1.0, 1.0)?;
            let pa = transition::DensePair {
                hv,
                dk,
                dv,
                t: t1,
                b: b1,
            };
            let pb = transition::DensePair {
                hv,
                dk,
                dv,
                t: t2,
                b: b2,
            };
            let s = rand_up::<f32>(&g, &mut r, hv * dk * dv, -1.0, 1.0)?;
            let mut out = g.zeros::<f32>(hv * dk * dv)?;
            let apply = time_ms(&g, 10, 200, || pa.apply_into(&g, &s, &mut out))?;
            let mut tout = g.zeros::<f32>(hv * dk * dk)?;
            let mut bout = g.zeros::<f32>(hv * dk * dv)?;
            let compose = time_ms(&g, 10, 200, || {
                g.stream().memcpy_dtod(&pb.b, &mut bout)?;
                transition::compose_dense(&g, hv, dk, dv, &pb.t, &pa.t, &pa.b, &mut tout, &mut bout)
            })?;
            println!("| op | µs per layer | µs per segment for 30 GDN layers |");
            println!("|---|---|---|");
            println!(
                "| apply S ← T S + B | {:.1} | {:.0} |",
                apply * 1e3,
                apply * 1e3 * 30.0
            );
            println!(
                "| compose (T_B T_A, T_B B_A + B_B) | {:.1} | {:.0} |",
                compose * 1e3,
                compose * 1e3 * 30.0
            );
        }

        println!(
            "\n## Attention prefill (bf16, 16 q / 2 kv heads × 256, causal, positions 0..T)\n"
        );
        println!(
            "Tiled SIMT kernel `attn::prefill` vs the cuBLAS path `attn::prefill_fast` \
             (query blocks stop at their last visible key: (B + 1) / 2B of the full score work \
             for B blocks) vs the tensor-core flash kernel `attn::prefill_flash` \
             (FlashAttention-2, mma.sync; skips the key tiles above the diagonal) and its \
             Hopper version `attn::prefill_flash_wg` (wgmma, FlashAttention-3 scheme; \
             flash-wg: `FlashWgKernel::Basic`, the fallback without tensor maps; \
             flash-wg3tmal / flash-wg3tmalb80: the warp-specialised TMA kernels GpuModel runs, \
             `FlashWgKernel::WarpSpecializedTmaLean` / `WarpSpecializedTmaLeanBc80`). \
             TFLOP/s count the causal FLOPs; gpu-check's report sets the flash rows against \
             torch SDPA from the same run.\n"
        );
        println!("| T | kernel | ms | TFLOP/s (causal) | workspace MiB |");
        println!("|---|---|---|---|---|");
        let alens: &[usize] = if quick { &[4096] } else { &[4096, 16384] };
        let mut flash_checks = Vec::new();
        let mut wg_checks = Vec::new();
        let mut tma_checks = Vec::new();
        for &t in alens {
            let (nh, nkv, hd) = (16usize, 2usize, 256usize);
            let q = rand_up::<bf16>(&g, &mut r, t * nh * hd, -1.0, 1.0)?;
            let k = rand_up::<bf16>(&g, &mut r, t * nkv * hd, -1.0, 1.0)?;
            let v = rand_up::<bf16>(&g, &mut r, t * nkv * hd, -1.0, 1.0)?;
            let pos: Vec<i64> = (0..t as i64).collect();
            let p = g.upload(&pos)?;
            let mut o = g.zeros::<bf16>(t * nh * hd)?;
            let reps = if t >= 16384 { 3 } else { 10 };
            let flops = 4.0 * (t as f64) * (t as f64) / 2.0 * (nh * hd) as f64;
            let ms = time_ms(&g, 1, reps, || {
                attn::prefill(&g, &q, &p, &k, &v, &p, &mut o, t, t, nh, nkv, hd)
            })?;
            println!("| {t} | tiled | {ms:.3} | {:.1} | 0 |", flops / ms / 1e9);
            let ms = time_ms(&g, 2, reps.max(5), || {
                attn::prefill_fast(&g, &q, &p, &k, &v, &p, &mut o, t, t, nh, nkv, hd)
            })?;
            let (qb, ws) = attn::fast_plan(t, t, nkv, 2, attn::FAST_WORKSPACE_BYTES);
            println!(
                "| {t} | cuBLAS (query blocks of {qb}) | {ms:.3} | {:.1} | {:.0} |",
                flops / ms / 1e9,
                ws as f64 / (1 << 20) as f64
            );
            let want = g.download(&o)?;
            // The default tile shape first (its row is the one gpu-check compares with
            // torch SDPA), then the other compiled shapes as "variant" rows.
            for (i, &tiles) in attn::flash_variants(hd).iter().enumerate() {
                let opts = attn::FlashOpts {
                    split: None,
                    tiles: Some(tiles),
                };
                let ms = time_ms(&g, 3, reps.max(10), || {
                    attn::prefill_flash_with(
                        &g, &q, &p, &k, &v, &p, &mut o, t, t, nh, nkv, hd, opts,
                    )
                })?;
                let kind = if i == 0 { "flash" } else { "variant: flash" };
                println!(
                    "| {t} | {kind} (FA-2, mma.sync, {} × {} tiles) | {ms:.3} | {:.1} | 0 |",
                    tiles.br,
                    tiles.bc,
                    flops / ms / 1e9
                );
                flash_checks.push((t, tiles, rel_diff(&g.download(&o)?, &want)));
            }
            // The Hopper wgmma kernel (sm_90 only; gpu-check reports it as its own column).
            if g.arch() == "sm_90a" {
                let ms = time_ms(&g, 3, reps.max(10), || {
                    attn::prefill_flash_wg(&g, &q, &p, &k, &v, &p, &mut o, t, t, nh, nkv, hd)
                })?;
                println!(
                    "| {t} | flash-wg (wgmma, 128 × 64 tiles) | {ms:.3} | {:.1} | 0 |",
                    flops / ms / 1e9
                );
                wg_checks.push((t, rel_diff(&g.download(&o)?, &want)));
                let stages = attn::flash_wg3_stages(hd);
                for (kernel, label) in [
                    (
                        attn::FlashWgKernel::WarpSpecializedTmaLean,
                        format!("flash-wg3tmal (warp-specialised, TMA, 128 × 64 tiles, {stages} K/V stages)"),
                    ),
                    (
                        attn::FlashWgKernel::WarpSpecializedTmaLeanBc80,
                        format!("flash-wg3tmalb80 (warp-specialised, TMA, 128 × 80 tiles, {stages} K/V stages)"),
                    ),
                ] {
                    let opts = attn::FlashWgOpts {
                        split: None,
                        kernel,
                    };
                    let ms = time_ms(&g, 3, reps.max(10), || {
                        attn::prefill_flash_wg_with(
                            &g, &q, &p, &k, &v, &p, &mut o, t, t, nh, nkv, hd, opts,
                        )
                    })?;
                    println!("| {t} | {label} | {ms:.3} | {:.1} | 0 |", flops / ms / 1e9);
                    tma_checks.push((t, kernel, rel_diff(&g.download(&o)?, &want)));
                }
            }
        }
        println!();
        for (t, tl, d) in flash_checks {
            println!(
                "- T = {t}, flash {}×{}: output vs the cuBLAS path, norm-wise relative \
                 difference {d:.2e}",
                tl.br, tl.bc
            );
        }
        for (t, d) in wg_checks {
            println!(
                "- T = {t}, flash-wg (wgmma): output vs the cuBLAS path, norm-wise relative \
                 difference {d:.2e}"
            );
        }
        for (t, kernel, d) in tma_checks {
            println!(
                "- T = {t}, flash-wg {kernel:?} (wgmma, warp-specialised, TMA): output vs the \
                 cuBLAS path, norm-wise relative difference {d:.2e}"
            );
        }
        if g.arch() != "sm_90a" {
            println!("- flash-wg (wgmma) not timed: {} is not sm_90", g.arch());
        }
        if !quick {
            short_spans(&g, &mut r)?;
        }
        moe_bench(&g, &mut r, quick)?;
        Ok(())
    }

    /// `‖a − b‖ / ‖b‖` over bf16 outputs.
    /// Host cost of the operations a decode step is made of: each issued `N` times in a
    /// row (host time per issue), then one synchronisation (device time per operation
    /// when the device is the slower side). A one-token forward of the 40-layer model
    /// issues about a thousand of these.
    fn host_costs(g: &Gpu) -> Result<()> {
        use dataplane::cuda::ops::{self, NormKind};
        const N: usize = 2000;
        println!(
            "\n## Host cost per device operation ({N} issued back to back, then one sync; µs)\n"
        );
        println!("| operation | host µs per issue | until the device is done, µs per op |");
        println!("|---|---|---|");
        let x: CudaSlice<bf16> = g.zeros(2048)?;
        let w: CudaSlice<bf16> = g.zeros(2048 * 2048)?;
        let nw: CudaSlice<f32> = g.zeros(2048)?;
        let mut y: CudaSlice<bf16> = g.zeros(2048)?;
        let row = |name: &str, f: &mut dyn FnMut() -> Result<()>| -> Result<()> {
            f()?;
            g.sync()?;
            let t = std::time::Instant::now();
            for _ in 0..N {
                f()?;
            }
            let issue = t.elapsed().as_secs_f64();
            g.sync()?;
            let done = t.elapsed().as_secs_f64();
            println!(
                "| {name} | {:.2} | {:.2} |",
                issue * 1e6 / N as f64,
                done * 1e6 / N as f64
            );
            Ok(())
        };
        row("kernel lookup (`Gpu::function`, no launch)", &mut || {
            g.function(&dataplane::cuda::compile::NORM, "rmsnorm_bf16", 0)
                .map(|_| ())
        })?;
        row(
            "scratch buffer 8 KiB: allocate + free (stream-ordered pool)",
            &mut || g.scratch::<bf16>(4096).map(drop),
        )?;
        row("zeroed buffer 8 KiB: allocate + memset + free", &mut || {
            g.zeros::<bf16>(4096).map(drop)
        })?;
        row("kernel launch: RMSNorm of one 2048-wide row", &mut || {
            ops::rms_norm(g, NormKind::ZeroCentred, &x, None, &nw, &mut y, 1, 1e-6)
        })?;
        row(
            "`blas::linear` 1 × 2048 → 2048, bf16 (the GEMV kernel; was cuBLAS: 9.1 µs host)",
            &mut || blas::linear(g, &x, 1, 2048, &w, 2048, &mut y, bf16::ZERO),
        )?;
        row("device copy 4 KiB (memcpy_dtod)", &mut || {
            g.stream().memcpy_dtod(&x, &mut y).map_err(Into::into)
        })?;
        Ok(())
    }

    fn rel_diff(a: &[bf16], b: &[bf16]) -> f64 {
        let (mut num, mut den) = (0f64, 0f64);
        for (x, y) in a.iter().zip(b) {
            let (x, y) = (x.to_f64(), y.to_f64());
            num += (x - y) * (x - y);
            den += y * y;
        }
        (num / den.max(1e-300)).sqrt()
    }

    /// Attention for short query spans at the end of a long cache (decode, PIC seam
    /// windows, a request's final query): the three implementations side by side, so the
    /// `GpuModel` thresholds (`model::ATTN_FLASH_MIN_TQ`, `ATTN_FAST_MIN_TQ`,
    /// `ATTN_FAST_MIN_KV`) can be set from measurements.
    fn short_spans(g: &Gpu, r: &mut rand::rngs::StdRng) -> Result<()> {
        let (nh, nkv, hd, n) = (16usize, 2usize, 256usize, 16384usize);
        println!(
            "\n## Attention: short spans over a long cache (bf16, {nh} q / {nkv} kv heads × {hd}, \
             {n} cached keys at 0..{n}, the span's queries at the last positions)\n"
        );
        println!("| queries | tiled ms | cuBLAS ms | flash ms | flash key splits |");
        println!("|---|---|---|---|---|");
        let k = rand_up::<bf16>(g, r, n * nkv * hd, -1.0, 1.0)?;
        let v = rand_up::<bf16>(g, r, n * nkv * hd, -1.0, 1.0)?;
        let kp = g.upload(&(0..n as i64).collect::<Vec<_>>())?;
        let sms = g.context().attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        for t in [1usize, 8, 64, 128, 1024] {
            let q = rand_up::<bf16>(g, r, t * nh * hd, -1.0, 1.0)?;
            let qp = g.upload(&((n - t) as i64..n as i64).collect::<Vec<_>>())?;
            let mut o = g.zeros::<bf16>(t * nh * hd)?;
            let tiled = if t <= 128 {
                let ms = time_ms(g, 1, 5, || {
                    attn::prefill(g, &q, &qp, &k, &v, &kp, &mut o, t, n, nh, nkv, hd)
                })?;
                format!("{ms:.3}")
            } else {
                "–".to_string()
            };
            let fast = time_ms(g, 2, 10, || {
                attn::prefill_fast(g, &q, &qp, &k, &v, &kp, &mut o, t, n, nh, nkv, hd)
            })?;
            let flash = time_ms(g, 2, 10, || {
                attn::prefill_flash(g, &q, &qp, &k, &v, &kp, &mut o, t, n, nh, nkv, hd)
            })?;
            let tl = attn::flash_tiles(hd);
            let splits = attn::flash_plan(t, n, nh, hd, tl, sms, attn::FAST_WORKSPACE_BYTES);
            println!("| {t} | {tiled} | {fast:.3} | {flash:.3} | {splits} |");
        }
        Ok(())
    }

    /// MoE block at the Qwen3.5-35B-A3B shape. Every expert gets the same random weights
    /// (the timing does not depend on their values; the router is random, so tokens
    /// spread over the experts); FLOPs count router, routed experts and shared expert.
    fn moe_bench(g: &Gpu, r: &mut rand::rngs::StdRng, quick: bool) -> Result<()> {
        let (h, e, k, i, is) = (2048usize, 256usize, 8usize, 512usize, 512usize);
        println!(
            "\n## MoE block (bf16; hidden {h}, {e} experts, top-{k}, expert inter {i}, shared inter {is})\n"
        );
        let rnd = |r: &mut rand::rngs::StdRng, n: usize, s: f32| -> Vec<f32> {
            (0..n).map(|_| r.random_range(-s..s)).collect()
        };
        let sh = 1.0 / (h as f32).sqrt();
        let router = rnd(r, e * h, 3.0 * sh);
        let gu = rnd(r, 2 * i * h, sh);
        let dn = rnd(r, h * i, 1.0 / (i as f32).sqrt());
        let sgu = rnd(r, 2 * is * h, sh);
        let sdn = rnd(r, h * is, 1.0 / (is as f32).sqrt());
        let sg = rnd(r, h, sh);
        let gus: Vec<&[f32]> = vec![&gu[..]; e];
        let dns: Vec<&[f32]> = vec![&dn[..]; e];
        let w = moe::MoeWeights::<bf16>::upload(
            g,
            &router,
            &gus,
            &dns,
            Some((&sgu, &sdn, &sg)),
            h,
            i,
            is,
            k,
            true,
        )?;
        let mut ws = moe::MoeWorkspace::new();
        println!(
            "| t | kernel (auto) | MoE ms | TFLOP/s | GEMV ms | tensor cores ms | SIMT ms | cuBLAS dense same rows ms | TFLOP/s |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        let ts: &[usize] = if quick {
            &[1, 1024]
        } else {
            &[1, 8, 1024, 4096]
        };
        for &t in ts {
            let x = rand_up::<bf16>(g, r, t * h, -1.0, 1.0)?;
            let mut out = g.zeros::<bf16>(t * h)?;
            let reps = if t >= 1024 { 10 } else { 50 };
            ws.force_expert_gemm(None);
            let auto = moe::expert_gemm(&w, &ws, t);
            let ms = time_ms(g, 3, reps, || {
                moe::moe_forward(g, &w, &x, t, &mut ws, &mut out)
            })?;
            let mut per = Vec::new();
            for path in [
                moe::ExpertGemm::Gemv,
                moe::ExpertGemm::TensorCores,
                moe::ExpertGemm::Simt,
            ] {
                if path == moe::ExpertGemm::Gemv && t > 64 {
                    per.push("-".to_string());
                    continue;
                }
                ws.force_expert_gemm(Some(path));
                let m = time_ms(g, 1, reps.min(10), || {
                    moe::moe_forward(g, &w, &x, t, &mut ws, &mut out)
                })?;
                per.push(format!("{m:.3}"));
            }
            ws.force_expert_gemm(None);
            let flops = 2.0 * t as f64 * (e * h + k * 3 * i * h + 3 * is * h) as f64;
            // cuBLAS reference: all t·k routed rows through one expert's matrices.
            let n = t * k;
            let xr = rand_up::<bf16>(g, r, n * h, -1.0, 1.0)?;
            let wgu = rand_up::<bf16>(g, r, 2 * i * h, -sh, sh)?;
            let wdn = rand_up::<bf16>(g, r, h * i, -0.04, 0.04)?;
            let mut y1 = g.zeros::<bf16>(n * 2 * i)?;
            let mut y2 = g.zeros::<bf16>(n * h)?;
            let dense = time_ms(g, 3, reps, || {
                blas::linear(g, &xr, n, h, &wgu, 2 * i, &mut y1, bf16::from_f32(0.0))?;
                blas::linear(g, &y1, n, i, &wdn, h, &mut y2, bf16::from_f32(0.0))
            })?;
            let dflops = 2.0 * n as f64 * (3 * i * h) as f64;
            println!(
                "| {t} | {auto:?} | {ms:.3} | {:.2} | {} | {} | {} | {dense:.3} | {:.2} |",
                flops / ms / 1e9,
                per[0],
                per[1],
                per[2],
                dflops / dense / 1e9
            );
        }
        println!(
            "\n(MoE workspace {:.1} MiB; weights {:.2} GiB)",
            ws.bytes() as f64 / (1 << 20) as f64,
            2.0 * (e * 3 * i * h + 3 * is * h + (e + 1) * h) as f64 / (1u64 << 30) as f64
        );
        Ok(())
    }

    /// Lightning attention prefill at 16 heads × 128 with the ALiBi log decays
    /// `−slope_h` and a random initial state, the shape of issue 19's FLA
    /// `chunk_simple_gla` (per-head `g_gamma`, bf16 q/k/v) anchor in gpu-check's step
    /// `fla`: the fp32 kernels of `kernels/lightning.cu` (`chunked`, `chunked_two_pass`,
    /// the per-token recurrence at 1k for scale; `span` is what an f32 model's layer
    /// takes) and the tensor-core kernel of `kernels/lightning_tc.cu` (`chunked_tc`,
    /// bf16 q/k/v/o, fp32 state: what a bf16 model's layer takes, in its default form;
    /// then each form, `TcForm::Fused`, `TcForm::Split` and `TcForm::TwoPass`), with and
    /// without outputs.
    fn lightning_bench(g: &Gpu, r: &mut rand::rngs::StdRng, quick: bool) -> Result<()> {
        use dataplane::cuda::lightning as lt;
        use dataplane::mixers::lightning::LightningDims;
        let (h, d) = (16usize, 128usize);
        let lens: &[usize] = if quick {
            &[1024, 4096]
        } else {
            &[1024, 4096, 16384, 32768]
        };
        println!(
            "\n## Lightning attention prefill (fp32 kernels of kernels/lightning.cu: fp32 q/k/v/o and state; \
             tensor-core kernel of kernels/lightning_tc.cu: bf16 q/k/v/o, fp32 state, as FLA's anchor; \
             H={h}, dk=dv={d}, log decay −ALiBi slope per head)\n"
        );
        println!("| T | chunked ms | two-pass ms | state-only ms | per-token ms | Mtok/s (best fp32) | span (f32 layer) ms | tensor-core bf16 ms | tensor-core state-only ms | tensor-core fused ms | tensor-core split ms | tensor-core two-pass ms | tensor-core two-pass state-only ms |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        let log_decay: Vec<f32> = dataplane::mixers::lightning::alibi_slopes(h)
            .iter()
            .map(|s| -(*s as f32))
            .collect();
        let ld = g.upload(&log_decay)?;
        let scale = (d as f32).powf(-0.5);
        for &t in lens {
            let dims = LightningDims { t, h, dk: d, dv: d };
            let q = rand_up::<f32>(g, r, t * h * d, -0.1, 0.1)?;
            let k = rand_up::<f32>(g, r, t * h * d, -0.1, 0.1)?;
            let v = rand_up::<f32>(g, r, t * h * d, -1.0, 1.0)?;
            let mut s = rand_up::<f32>(g, r, h * d * d, -1.0, 1.0)?;
            let mut o = g.zeros::<f32>(t * h * d)?;
            let reps = if t >= 16384 { 5 } else { 20 };
            let chunked = time_ms(g, 2, reps, || {
                lt::chunked(g, &dims, &q, &k, &v, &ld, scale, &mut s, Some(&mut o))
            })?;
            let two_pass = time_ms(g, 2, reps, || {
                lt::chunked_two_pass(g, &dims, &q, &k, &v, &ld, scale, &mut s, &mut o)
            })?;
            let state_only = time_ms(g, 2, reps, || {
                lt::chunked(g, &dims, &q, &k, &v, &ld, scale, &mut s, None)
            })?;
            let per_token = if t <= 1024 {
                let ms = time_ms(g, 1, 3, || {
                    lt::recurrent(g, &dims, &q, &k, &v, &ld, scale, &mut s, &mut o)
                })?;
                format!("{ms:.3}")
            } else {
                "-".into()
            };
            let span = time_ms(g, 2, reps, || {
                lt::span(g, &dims, &q, &k, &v, &ld, scale, &mut s, &mut o)
            })?;
            let qb = rand_up::<bf16>(g, r, t * h * d, -0.1, 0.1)?;
            let kb = rand_up::<bf16>(g, r, t * h * d, -0.1, 0.1)?;
            let vb = rand_up::<bf16>(g, r, t * h * d, -1.0, 1.0)?;
            let mut ob = g.zeros::<bf16>(t * h * d)?;
            let tc = time_ms(g, 3, reps.max(20), || {
                lt::chunked_tc(g, &dims, &qb, &kb, &vb, &ld, scale, &mut s, Some(&mut ob))
            })?;
            let tc_state = time_ms(g, 3, reps.max(20), || {
                lt::chunked_tc(g, &dims, &qb, &kb, &vb, &ld, scale, &mut s, None)
            })?;
            let tc_state2 = time_ms(g, 3, reps.max(20), || {
                lt::chunked_tc_with(
                    lt::TcForm::TwoPass,
                    g,
                    &dims,
                    &qb,
                    &kb,
                    &vb,
                    &ld,
                    scale,
                    &mut s,
                    None,
                )
            })?;
            let mut forms = [0f64; 3];
            for (f, form) in
                forms
                    .iter_mut()
                    .zip([lt::TcForm::Fused, lt::TcForm::Split, lt::TcForm::TwoPass])
            {
                *f = time_ms(g, 3, reps.max(20), || {
                    lt::chunked_tc_with(
                        form,
                        g,
                        &dims,
                        &qb,
                        &kb,
                        &vb,
                        &ld,
                        scale,
                        &mut s,
                        Some(&mut ob),
                    )
                })?;
            }
            println!(
                "| {t} | {chunked:.3} | {two_pass:.3} | {state_only:.3} | {per_token} | {:.1} | {span:.3} | {tc:.4} | {tc_state:.4} | {:.4} | {:.4} | {:.4} | {tc_state2:.4} |",
                t as f64 / chunked.min(two_pass) / 1e3,
                forms[0],
                forms[1],
                forms[2]
            );
        }
        Ok(())
    }

    /// `--kda`: the chunked KDA prefill (`cuda::kda::chunked`, bf16 in, fp32 state,
    /// 32 heads × 128, as FLA's `chunk_kda` in gpu-check's step `fla`) with and
    /// without the transition `T_C`, and the per-token kernel at 1k.
    fn kda_bench(g: &Gpu, r: &mut rand::rngs::StdRng, quick: bool) -> Result<()> {
        use dataplane::cuda::kda;
        let (h, dk) = (32usize, 128usize);
        let lens: &[usize] = if quick {
            &[1024, 4096]
        } else {
            &[1024, 4096, 16384, 32768]
        };
        println!(
            "\n## KDA chunked prefill (kernels/kda.cu SIMT, kernels/kda_tc.cu tensor cores; bf16 in, fp32 state; H={h}, dk=dv={dk})\n"
        );
        println!("| T | prefill ms | tc ms | prefill + T_C ms | per-token kernel ms |");
        println!("|---|---|---|---|---|");
        for &t in lens {
            let d = GdrDims {
                t,
                hk: h,
                hv: h,
                dk,
                dv: dk,
            };
            let q = unit_up(g, r, t * h, dk, (dk as f32).powf(-0.5))?;
            let k = unit_up(g, r, t * h, dk, 1.0)?;
            let v = rand_up::<bf16>(g, r, t * h * dk, -1.0, 1.0)?;
            let gg = rand_up::<f32>(g, r, t * h * dk, -0.1, 0.0)?;
            let beta = rand_up::<f32>(g, r, t * h, 0.01, 1.0)?;
            let mut s = rand_up::<f32>(g, r, h * dk * dk, -1.0, 1.0)?;
            let mut o = g.zeros::<bf16>(t * h * dk)?;
            let mut tr = g.zeros::<f32>(h * dk * dk)?;
            let reps = if t >= 16384 { 3 } else { 10 };
            let plain = time_ms(g, 1, reps, || {
                kda::chunked(
                    g,
                    &d,
                    &q,
                    &k,
                    &v,
                    &gg,
                    &beta,
                    &mut s,
                    &mut o,
                    None,
                    kda::CHUNK,
                )
            })?;
            let tc = time_ms(g, 1, reps, || {
                kda::chunked_tc(g, &d, &q, &k, &v, &gg, &beta, &mut s, &mut o)
            })?;
            let with_t = time_ms(g, 1, reps, || {
                kda::chunked(
                    g,
                    &d,
                    &q,
                    &k,
                    &v,
                    &gg,
                    &beta,
                    &mut s,
                    &mut o,
                    Some(&mut tr),
                    kda::CHUNK,
                )
            })?;
            let rec = if t <= 1024 {
                let ms = time_ms(g, 1, 3, || {
                    kda::recurrent(g, &d, &q, &k, &v, &gg, &beta, &mut s, &mut o)
                })?;
                format!("{ms:.3}")
            } else {
                "–".into()
            };
            println!("| {t} | {plain:.3} | {tc:.3} | {with_t:.3} | {rec} |");
        }
        Ok(())
    }

    /// The MoE prefill's expert GEMMs: grouped (one launch per projection) against the
    /// per-expert cuBLAS loop, the issue's `torch._grouped_mm` anchor, and a dense
    /// cuBLAS GEMM of the same FLOPs (the GEMM floor of this run). 256 experts, top-8,
    /// hidden 2048, expert width 512, no shared expert; distinct random weights per
    /// expert would not change the timing, so every expert shares one set. FLOPs count
    /// the expert GEMMs only (`2 · t · k · 3 · I · H`, as the anchor); our times
    /// include the router GEMM, routing, plan and combine as well.
    fn moe_grouped_bench(g: &Gpu, r: &mut rand::rngs::StdRng) -> Result<()> {
        let (h, e, k, i) = (2048usize, 256usize, 8usize, 512usize);
        println!(
            "\n## MoE prefill: grouped expert GEMMs vs per-expert cuBLAS (bf16; hidden {h}, {e} experts, top-{k}, expert width {i}, no shared expert)\n"
        );
        let rnd = |r: &mut rand::rngs::StdRng, n: usize, s: f32| -> Vec<f32> {
            (0..n).map(|_| r.random_range(-s..s)).collect()
        };
        let sh = 1.0 / (h as f32).sqrt();
        let router = rnd(r, e * h, 3.0 * sh);
        let gu = rnd(r, 2 * i * h, sh);
        let dn = rnd(r, h * i, 1.0 / (i as f32).sqrt());
        let gus: Vec<&[f32]> = vec![&gu[..]; e];
        let dns: Vec<&[f32]> = vec![&dn[..]; e];
        let w = moe::MoeWeights::<bf16>::upload(g, &router, &gus, &dns, None, h, i, 0, k, true)?;
        let mut ws = moe::MoeWorkspace::new();
        // torch._grouped_mm on the same shape (issue 18, H200, 2026-12-01), ms.
        let anchor = |t: usize| match t {
            4096 => Some(0.84),
            16384 => Some(1.98),
            _ => None,
        };
        println!(
            "| t | grouped 128×128 ms | TFLOP/s | grouped 64×64 ms | TFLOP/s | per-expert cuBLAS ms | per-expert / grouped | anchor ms | grouped / anchor | dense cuBLAS same FLOPs ms | TFLOP/s | grouped / dense |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
        for &t in &[1024usize, 4096, 16384] {
            let x = rand_up::<bf16>(g, r, t * h, -1.0, 1.0)?;
            let mut out = g.zeros::<bf16>(t * h)?;
            let reps = if t >= 16384 { 10 } else { 20 };
            ws.force_expert_gemm(Some(moe::ExpertGemm::TensorCoresLarge));
            let grouped = time_ms(g, 3, reps, || {
                moe::moe_forward(g, &w, &x, t, &mut ws, &mut out)
            })?;
            ws.force_expert_gemm(Some(moe::ExpertGemm::TensorCores));
            let small = time_ms(g, 3, reps, || {
                moe::moe_forward(g, &w, &x, t, &mut ws, &mut out)
            })?;
            ws.force_expert_gemm(Some(moe::ExpertGemm::PerExpert));
            let per = time_ms(g, 2, reps.min(10), || {
                moe::moe_forward(g, &w, &x, t, &mut ws, &mut out)
            })?;
            ws.force_expert_gemm(None);
            let n = t * k;
            let flops = 2.0 * n as f64 * (3 * i * h) as f64;
            let xr = rand_up::<bf16>(g, r, n * h, -1.0, 1.0)?;
            let wgu = rand_up::<bf16>(g, r, 2 * i * h, -sh, sh)?;
            let wdn = rand_up::<bf16>(g, r, h * i, -0.04, 0.04)?;
            let mut y1 = g.zeros::<bf16>(n * 2 * i)?;
            let mut y2 = g.zeros::<bf16>(n * h)?;
            let dense = time_ms(g, 3, reps, || {
                blas::linear(g, &xr, n, h, &wgu, 2 * i, &mut y1, bf16::from_f32(0.0))?;
                blas::linear(g, &y1, n, i, &wdn, h, &mut y2, bf16::from_f32(0.0))
            })?;
            let (a, ratio) = match anchor(t) {
                Some(a) => (format!("{a:.2}"), format!("{:.2}", grouped / a)),
                None => ("-".into(), "-".into()),
            };
            println!(
                "| {t} | {grouped:.3} | {:.0} | {small:.3} | {:.0} | {per:.3} | {:.2} | {a} | {ratio} | {dense:.3} | {:.0} | {:.2} |",
                flops / grouped / 1e9,
                flops / small / 1e9,
                per / grouped,
                flops / dense / 1e9,
                grouped / dense
            );
        }
        println!(
            "\n(grouped 128×128 = ExpertGemm::TensorCoresLarge, 64×64 = ExpertGemm::TensorCores, per-expert = ExpertGemm::PerExpert; each time is the whole moe_forward: router GEMM, routing, plan, expert GEMMs, combine; TFLOP/s counts the expert GEMMs only; MoE workspace {:.1} MiB)",
            ws.bytes() as f64 / (1 << 20) as f64
        );
        Ok(())
    }
}
