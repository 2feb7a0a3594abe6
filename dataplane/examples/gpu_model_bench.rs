//! Whole-model GPU benchmark at real shapes with random weights (issue 6; a report, not
//! a test). Needs `--features cuda` and a CUDA device; run through
//! `scripts/gpu-check.sh` (step `modelbench`).
//!
//! ```text
//! gpu_model_bench --config DIR --random-weights [--dtype bf16|f32] [--seed N] [--reps N] [--quick]
//!   [--profile-decode N]   # only N decode steps (4k context) between cuProfilerStart/Stop, for ncu
//!   [--decode-graphs]      # only the decode-step table, CUDA graphs against eager (below)
//!   [--layers N]           # the first N layers (default: the largest layer cut that fits)
//!   [--headroom-gib G]     # device memory left free for activations when picking the cut (8)
//!   [--dtype-fallback bf16] # when even the smallest cut does not fit in --dtype
//!   [--shapes 4x1024,16x1024] # TTFT prompts (segments x tokens)
//!   [--graph-ctx N] [--batches 1,8,64]
//! ```
//!
//! `DIR/config.json` is an HF config of any registered family (e.g.
//! `benches/configs/qwen3_5_35b_a3b`, `ring_mini_linear_2_0`, `ring_flash_linear_2_0`,
//! `kimi_linear_48b_a3b`); the weights are generated on the device by
//! `GpuModel::random` (no checkpoint, no host copy). `--dtype` defaults to bf16.
//!
//! Layer cut: when the weights, the states of the longest prompt and
//! `--headroom-gib` do not fit the free device memory, the model is cut to its first
//! `n` layers, `n` the largest of `ModelConfig::layer_cuts` that fits (a cut ends on a
//! full-attention layer, so it keeps the family's layer plan: Qwen3.5 every 4th layer,
//! Ring-linear `(i + 1) % layer_group_size == 0`, Kimi-Linear `full_attn_layers`);
//! the header names the kept layers of each kind. When even the smallest cut does not
//! fit, the bench stops with "does not fit", or switches to `--dtype-fallback`.
//! Prints markdown:
//!
//! * parameter counts (total, active per token) and weight bytes, init time;
//! * the bf16 cuBLAS GEMM peak of this device in this run (8192³, `blas::linear`);
//! * TTFT of full-recompute prefill (the whole prompt from an empty state, logits of
//!   the last token) for prompts of 4 segments × 1k / 2k / 4k tokens and 4 / 8 / 16
//!   segments × 1k, with the model FLOPs and MFU against that peak;
//! * `prefix cache` TTFT: only the last segment, from a device snapshot of the state
//!   after the first n−1 segments (`GpuState::try_clone` per run, timed with it);
//! * `hypic` TTFT: `GpuPicEngine::run` in `Mode::hypic_default()` (seam width 8, RoPE
//!   fix) with every segment's public entry prebuilt, and the compose time per
//!   segment derived from it;
//! * decode step latency (one token, host logits) at several context lengths;
//! * a per-layer-kind split (linear-attention layer — GDN, Lightning or KDA — vs
//!   full-attention layer — attention or MLA —, each with its FFN) from two 4-layer
//!   models of the same shapes (skipped, with a note, for a stack of one kind);
//! * the decode step through `GpuModel::decode_sample` (greedy, token ids drawn on the
//!   device) at batch 1 / 8 / 64 over `--graph-ctx` (default 1024) tokens per sequence,
//!   eager against CUDA graphs (`cuda::graph`), in one table with: the eager step,
//!   its host enqueue time and the time until its device work is done
//!   (`decode_enqueue_eager`, no download), the graph step and its host time (inputs
//!   copied, graph launched: `GraphStats::last_host_s`), the device time of one step
//!   (20 replays of the graph back to back, CUDA events), and the weight-read floor:
//!   bytes a step must read or write / the HBM bandwidth measured in the same run (a
//!   1 GiB device-to-device copy, bytes read plus written). Bytes per step: the dense
//!   weights (projections, router, shared expert, LM head) once, the routed experts a
//!   batch of B tokens touches (expected distinct experts per MoE layer
//!   `E·(1 − (1 − k/E)^B)`, uniform routing), the recurrent and conv states read and
//!   written, and the KV cache read. The model is cut as above when the full model
//!   and the states of the largest batch do not fit the device (an H100 at the
//!   Qwen3.5-35B-A3B shape in bf16); the header says which layers were kept.
//!
//! Times are wall-clock milliseconds around the call, which returns host logits and
//! so waits for the stream (CUDA-synchronised); median of `--reps` (default 3, at
//! least 3) runs after one warm-up run of the same shape.
//!
//! Model FLOPs per prompt (counted, not measured): `2·P_active` per token for the
//! matrix products (projections of every layer, router, top-k routed experts, shared
//! expert; `P_active` from `random::ParamCounts` without the LM head), plus
//! `2·vocab·hidden` once for the last token's logits, plus causal attention
//! `4·H·hd·(p+1)` per token at position `p` per full-attention layer (QKᵀ and PV), or
//! `2·H·(qk_head_dim + v_head_dim)·(p+1)` per MLA layer (the attention of the
//! expanded heads; the absorbed form this code runs attends over latent rows and
//! does more), plus `6·Hv·dk·dv` per token per GDN or KDA layer (the three state
//! matrix-vector products of the recurrent form; the chunked kernels do more work
//! than this) and `2·conv_dim·K` for its conv, or `4·H·dk·dv` per token per Lightning
//! layer (state update and read-out; no conv). Norms, activations, gates and softmax
//! are not counted.
#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("gpu_model_bench: build with --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = bench::run() {
        eprintln!("gpu_model_bench: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod bench {
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::time::Instant;

    use cudarc::cublas::{CudaBlas, Gemm};
    use dataplane::config::{MixerKind, ModelConfig};
    use dataplane::cuda::model::{GpuModel, GpuState};
    use dataplane::cuda::pic::GpuPicEngine;
    use dataplane::cuda::random::random_buffer;
    use dataplane::cuda::{blas, Elem, Gpu};
    use dataplane::model::Logits;
    use dataplane::pic::engine::{Mode, SegmentRef};
    use dataplane::random::ParamCounts;
    use half::bf16;

    type Res<T> = std::result::Result<T, String>;

    struct Args {
        config: PathBuf,
        /// `--dtype`; empty: bf16, or f32 for Lightning / KDA / MLA models.
        dtype: String,
        /// `--dtype-fallback`: the dtype to use when no layer cut fits in `dtype`.
        dtype_fallback: Option<String>,
        /// `--headroom-gib`: device memory kept free when picking the layer cut.
        headroom_gib: f64,
        /// `--shapes`: TTFT prompts as (segments, tokens per segment).
        shapes: Option<Vec<(usize, usize)>>,
        seed: u64,
        reps: usize,
        quick: bool,
        /// `--decode-graphs`: only the decode-step table of graphs against eager.
        decode_graphs: bool,
        /// `--layers N` (0: the largest layer cut that fits).
        layers: usize,
        /// `--graph-ctx N`: tokens per sequence before the timed steps.
        graph_ctx: usize,
        /// `--batches`: batch sizes of that table.
        batches: Vec<usize>,
        /// `--profile-decode N`: only N decode steps at a 4k context, between
        /// cuProfilerStart / cuProfilerStop (for `ncu --profile-from-start off`).
        profile_decode: usize,
    }

    fn parse() -> Res<Args> {
        let mut a = Args {
            config: PathBuf::new(),
            dtype: String::new(),
            dtype_fallback: None,
            headroom_gib: 8.0,
            shapes: None,
            seed: 0,
            reps: 3,
            quick: false,
            profile_decode: 0,
            decode_graphs: false,
            layers: 0,
            graph_ctx: 1024,
            batches: vec![1, 8, 64],
        };
        let mut random = false;
        let mut it = std::env::args().skip(1);
        while let Some(k) = it.next() {
            let mut val = |k: &str| it.next().ok_or_else(|| format!("{k} needs a value"));
            match k.as_str() {
                "--config" => a.config = PathBuf::from(val(&k)?),
                "--random-weights" => random = true,
                "--dtype" => a.dtype = val(&k)?,
                "--dtype-fallback" => a.dtype_fallback = Some(val(&k)?),
                "--headroom-gib" => {
                    a.headroom_gib = val(&k)?
                        .parse()
                        .map_err(|e| format!("--headroom-gib: {e}"))?
                }
                "--shapes" => {
                    let v = val(&k)?;
                    let mut out = vec![];
                    for p in v.split(',') {
                        let (n, t) = p
                            .trim()
                            .split_once('x')
                            .ok_or_else(|| format!("--shapes: `{p}` is not NxT"))?;
                        let n: usize = n.parse().map_err(|e| format!("--shapes {p}: {e}"))?;
                        let t: usize = t.parse().map_err(|e| format!("--shapes {p}: {e}"))?;
                        if n == 0 || t == 0 {
                            return Err(format!("--shapes {p}: zero segments or tokens"));
                        }
                        out.push((n, t));
                    }
                    a.shapes = Some(out);
                }
                "--seed" => a.seed = val(&k)?.parse().map_err(|e| format!("--seed: {e}"))?,
                "--reps" => a.reps = val(&k)?.parse().map_err(|e| format!("--reps: {e}"))?,
                "--quick" => a.quick = true,
                "--decode-graphs" => a.decode_graphs = true,
                "--layers" => a.layers = val(&k)?.parse().map_err(|e| format!("--layers: {e}"))?,
                "--graph-ctx" => {
                    a.graph_ctx = val(&k)?.parse().map_err(|e| format!("--graph-ctx: {e}"))?
                }
                "--batches" => {
                    a.batches = val(&k)?
                        .split(',')
                        .map(|b| b.trim().parse::<usize>())
                        .collect::<std::result::Result<_, _>>()
                        .map_err(|e| format!("--batches: {e}"))?
                }
                "--profile-decode" => {
                    a.profile_decode = val(&k)?
                        .parse()
                        .map_err(|e| format!("--profile-decode: {e}"))?
                }
                o => return Err(format!("unknown argument `{o}`")),
            }
        }
        if a.config.as_os_str().is_empty() {
            return Err("--config DIR is required".into());
        }
        if !random {
            return Err("only --random-weights is supported (no checkpoint loading here)".into());
        }
        a.reps = a.reps.max(3);
        Ok(a)
    }

    /// Element bytes of `--dtype` values.
    fn dtype_bytes(d: &str) -> Res<usize> {
        match d {
            "bf16" => Ok(2),
            "f32" => Ok(4),
            o => Err(format!("--dtype {o}: expected bf16 or f32")),
        }
    }

    /// The TTFT prompts (segments, tokens per segment).
    fn ttft_shapes(a: &Args) -> Vec<(usize, usize)> {
        if let Some(s) = &a.shapes {
            s.clone()
        } else if a.quick {
            vec![(4, 1024), (4, 4096), (16, 1024)]
        } else {
            vec![(4, 1024), (4, 2048), (4, 4096), (8, 1024), (16, 1024)]
        }
    }

    /// The decode table's context lengths.
    fn decode_ctxs(a: &Args) -> &'static [usize] {
        if a.quick {
            &[1024, 16384]
        } else {
            &[1024, 4096, 16384, 32768]
        }
    }

    /// Device bytes the TTFT / decode bench needs for `c` in `es`-byte elements: the
    /// weights, four copies of one sequence's states and KV at `tokens` (running state,
    /// prefix snapshot and its clone, PIC entries) and `headroom_gib` for activations.
    fn bench_need(c: &ModelConfig, es: usize, tokens: usize, headroom_gib: f64) -> f64 {
        let (_, st) = step_bytes(c, es, 1, tokens);
        ParamCounts::of(c).bytes(es) as f64 + 4.0 * st + headroom_gib * (1u64 << 30) as f64
    }

    /// One line naming the layers a cut model kept.
    fn kept_layers(c: &ModelConfig, c0: &ModelConfig) -> String {
        if c.num_layers == c0.num_layers {
            format!("all {} layers ({})", c0.num_layers, c0.layer_plan())
        } else {
            format!(
                "layers 0..{} of {} kept ({}; cut after a full-attention layer, so the family's layer plan holds; cuts: {:?})",
                c.num_layers,
                c0.num_layers,
                c.layer_plan(),
                c0.layer_cuts()
            )
        }
    }

    pub fn run() -> Res<()> {
        let mut a = parse()?;
        let c0 = ModelConfig::from_dir(&a.config).map_err(|e| e.to_string())?;
        if a.dtype.is_empty() {
            a.dtype = "bf16".into();
        }
        dtype_bytes(&a.dtype)?;
        if let Some(fb) = &a.dtype_fallback {
            dtype_bytes(fb)?;
        }
        let g = Gpu::new(0).map_err(|e| e.to_string())?;
        g.warm_up().map_err(|e| e.to_string())?;
        println!("# gpu_model_bench\n");
        println!(
            "device: {} ({}); config {} ({}, family {}, {} layers: {}; hidden {}, vocab {}, {} experts top-{}); dtype {}, seed {}",
            g.name(),
            g.arch(),
            a.config.display(),
            c0.model_type,
            c0.family,
            c0.num_layers,
            c0.layer_plan(),
            c0.hidden_size,
            c0.vocab_size,
            c0.num_experts,
            c0.experts_per_tok,
            a.dtype,
            a.seed
        );
        if a.decode_graphs {
            return match a.dtype.as_str() {
                "bf16" => decode_graph_bench::<bf16>(&g, &c0, &a),
                _ => decode_graph_bench::<f32>(&g, &c0, &a),
            };
        }
        // The layer cut: the largest that fits with the longest prompt's states.
        g.context().bind_to_thread().map_err(|x| format!("{x:?}"))?;
        let (free, total) = cudarc::driver::result::mem_get_info().map_err(|x| format!("{x:?}"))?;
        let tokens = ttft_shapes(&a)
            .iter()
            .map(|(n, t)| n * t)
            .chain(decode_ctxs(&a).iter().copied())
            .max()
            .unwrap_or(0)
            + 64;
        let pick = |dtype: &str| -> Res<(usize, bool)> {
            let es = dtype_bytes(dtype)?;
            Ok(if a.layers > 0 {
                let n = a.layers.min(c0.num_layers);
                (n, true)
            } else {
                c0.largest_cut(|c| bench_need(c, es, tokens, a.headroom_gib) <= free as f64)
            })
        };
        let gb = |n: usize, d: &str| -> Res<f64> {
            Ok(bench_need(&c0.first_layers(n), dtype_bytes(d)?, tokens, a.headroom_gib) / 1e9)
        };
        let (mut n, mut fits) = pick(&a.dtype)?;
        if !fits {
            if let Some(fb) = a.dtype_fallback.clone() {
                let (n2, f2) = pick(&fb)?;
                println!(
                    "note: the smallest layer cut ({n} of {} layers) does not fit in {}: {:.1} GB needed (weights, states of {tokens} tokens ×4, {} GiB headroom), {:.1} GB free; --dtype-fallback {fb}: {n2} layers",
                    c0.num_layers,
                    a.dtype,
                    gb(n, &a.dtype)?,
                    a.headroom_gib,
                    free as f64 / 1e9,
                );
                a.dtype = fb;
                (n, fits) = (n2, f2);
            }
        }
        if !fits {
            return Err(format!(
                "the smallest layer cut ({n} of {} layers, cuts {:?}) does not fit in {}: {:.1} GB needed (weights, states of {tokens} tokens ×4, {} GiB headroom), {:.1} GB free of {:.1} GB; use --dtype-fallback bf16, --layers N or --headroom-gib",
                c0.num_layers,
                c0.layer_cuts(),
                a.dtype,
                gb(n, &a.dtype)?,
                a.headroom_gib,
                free as f64 / 1e9,
                total as f64 / 1e9
            ));
        }
        let c = c0.first_layers(n);
        println!(
            "{}; dtype {}; device memory {:.1} GB free of {:.1} GB before the weights, {:.1} GB planned (weights, states of {tokens} tokens ×4, {} GiB headroom)",
            kept_layers(&c, &c0),
            a.dtype,
            free as f64 / 1e9,
            total as f64 / 1e9,
            gb(n, &a.dtype)?,
            a.headroom_gib
        );
        match a.dtype.as_str() {
            "bf16" => bench::<bf16>(&g, c, &a),
            _ => bench::<f32>(&g, c, &a),
        }
    }

    /// Device-to-device copy bandwidth, bytes read plus written per second (1 GiB, median
    /// of 5 copies timed with events).
    fn hbm_bandwidth(g: &Gpu) -> Res<f64> {
        let e = |x: cudarc::driver::DriverError| format!("{x:?}");
        let n = 1usize << 30;
        let st = g.stream();
        let src = st.alloc_zeros::<u8>(n).map_err(e)?;
        let mut dst = st.alloc_zeros::<u8>(n).map_err(e)?;
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut ts = vec![];
        for i in 0..6 {
            let a = g.context().new_event(flags).map_err(e)?;
            let b = g.context().new_event(flags).map_err(e)?;
            a.record(st).map_err(e)?;
            st.memcpy_dtod(&src, &mut dst).map_err(e)?;
            b.record(st).map_err(e)?;
            b.synchronize().map_err(e)?;
            if i > 0 {
                ts.push(a.elapsed_ms(&b).map_err(e)? as f64 / 1e3);
            }
        }
        Ok(2.0 * n as f64 / median(ts))
    }

    /// Bytes a decode step of `bsz` sequences over `ctx` cached tokens must move at
    /// least (see the module docs): `(weights, states and KV)`.
    fn step_bytes(c: &ModelConfig, es: usize, bsz: usize, ctx: usize) -> (f64, f64) {
        let pc = ParamCounts::of(c);
        let (h, e, k, i) = (
            c.hidden_size,
            c.num_experts,
            c.experts_per_tok,
            c.moe_intermediate_size,
        );
        let n_moe = c.layer_is_moe.iter().filter(|m| **m).count();
        let expert = (3 * h * i) as f64;
        let routed_active = n_moe as f64 * k as f64 * expert;
        let distinct = if e > 0 {
            e as f64 * (1.0 - (1.0 - k as f64 / e as f64).powi(bsz as i32))
        } else {
            0.0
        };
        let weights = (pc.active_matmul as f64 - routed_active + n_moe as f64 * distinct * expert)
            * es as f64;
        // Linear layers (GDN, Lightning, KDA): an fp32 state `[Hv, dk, dv]` and conv tail
        // (none for Lightning: kernel 1); full attention and MLA: `num_kv_heads ×
        // head_dim` per token for K and for V (MLA: its latent row, stored as both).
        let n_gdn = c.num_linear_layers();
        let n_attn = c.num_attention_layers();
        let rec = c.linear_v_heads * c.linear_k_dim * c.linear_v_dim;
        let conv = c.conv_dim() * c.conv_kernel.saturating_sub(1);
        let per_seq = n_gdn as f64 * ((rec + conv) * 4 * 2) as f64
            + n_attn as f64 * (ctx * 2 * c.num_kv_heads * c.head_dim * es) as f64;
        (weights, bsz as f64 * per_seq)
    }

    /// The decode-step table of CUDA graphs against eager (module docs).
    fn decode_graph_bench<T: Elem>(g: &Arc<Gpu>, c0: &ModelConfig, a: &Args) -> Res<()>
    where
        CudaBlas: Gemm<T>,
    {
        use dataplane::engine::Decoded;
        use dataplane::sampling::DrawParams;
        let e = |x: dataplane::cuda::CudaError| x.to_string();
        let es = std::mem::size_of::<T>();
        let maxb = a.batches.iter().copied().max().unwrap_or(1);
        g.context().bind_to_thread().map_err(|x| format!("{x:?}"))?;
        let (free, total) = cudarc::driver::result::mem_get_info().map_err(|x| format!("{x:?}"))?;
        let layers = if a.layers > 0 {
            a.layers.min(c0.num_layers)
        } else {
            // Weights plus the states and KV of the largest batch plus 6 GiB of room, on
            // the largest layer cut that keeps the family's layer plan (the smallest
            // cut when none fits).
            c0.largest_cut(|c| {
                let (_, st) = step_bytes(c, es, maxb, a.graph_ctx + 64);
                let need =
                    ParamCounts::of(c).bytes(es) as f64 + st / 2.0 + 6.0 * (1u64 << 30) as f64;
                need <= free as f64
            })
            .0
        };
        let c = c0.first_layers(layers);
        println!(
            "\n## Decode step: CUDA graphs against eager (`decode_sample`, greedy on the device; {} of {} layers; {} tokens of context per sequence)\n",
            layers, c0.num_layers, a.graph_ctx
        );
        println!("{}", kept_layers(&c, c0));
        println!(
            "device memory: {:.1} GiB free of {:.1} GiB before the weights",
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64
        );
        let bw = hbm_bandwidth(g)?;
        println!(
            "HBM bandwidth (1 GiB device-to-device copy, read + written, this run): {:.2} TB/s",
            bw / 1e12
        );
        let t0 = Instant::now();
        let m = GpuModel::<T>::random(g.clone(), c.clone(), a.seed).map_err(e)?;
        g.sync().map_err(e)?;
        println!(
            "random init: {:.2} s, {:.2} GB of weights; CUDA graphs available: {}\n",
            t0.elapsed().as_secs_f64(),
            m.weight_bytes() as f64 / 1e9,
            m.cuda_graphs_enabled()
        );
        println!("| batch | eager step ms | eager host enqueue ms | eager device done ms | graph step ms | graph host ms | graph device ms (replays) | bytes per step GB (weights + states/KV) | floor ms | eager / floor | graph / floor | graph tokens/s |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
        let greedy = DrawParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            step: 0,
        };
        for &bsz in &a.batches {
            let mut states = vec![];
            let mut next = vec![];
            for b in 0..bsz {
                let mut st = m.new_state().map_err(e)?;
                let l = m
                    .prefill(
                        &prompt(a.graph_ctx, c.vocab_size, 1000 + b as u64),
                        &mut st,
                        Logits::Last,
                    )
                    .map_err(e)?;
                let mut best = 0usize;
                for (i, &x) in l.iter().enumerate() {
                    if x > l[best] {
                        best = i;
                    }
                }
                next.push(best as u32);
                states.push(st);
            }
            let draws = vec![Some(greedy); bsz];
            let step =
                |m: &GpuModel<T>, states: &mut Vec<GpuState<T>>, next: &mut Vec<u32>| -> Res<f64> {
                    let mut refs: Vec<&mut GpuState<T>> = states.iter_mut().collect();
                    let t = Instant::now();
                    let out = m.decode_sample(next, &mut refs, &draws).map_err(e)?;
                    let s = t.elapsed().as_secs_f64();
                    for (j, o) in out.into_iter().enumerate() {
                        if let Decoded::Token(t) = o {
                            next[j] = t;
                        }
                    }
                    Ok(s)
                };
            // Eager.
            m.set_cuda_graphs(false);
            let mut ts = vec![];
            for i in 0..12 {
                let s = step(&m, &mut states, &mut next)?;
                if i >= 2 {
                    ts.push(s);
                }
            }
            let eager = median(ts);
            let (mut enq, mut done) = (vec![], vec![]);
            for _ in 0..6 {
                g.sync().map_err(e)?;
                let mut refs: Vec<&mut GpuState<T>> = states.iter_mut().collect();
                let t = Instant::now();
                m.decode_enqueue_eager(&next, &mut refs).map_err(e)?;
                enq.push(t.elapsed().as_secs_f64());
                g.sync().map_err(e)?;
                done.push(t.elapsed().as_secs_f64());
            }
            // Graphs: warm-up, capture, then timed replays.
            m.set_cuda_graphs(true);
            let s0 = m.cuda_graph_stats();
            let (mut ts, mut host) = (vec![], vec![]);
            for i in 0..13 {
                let s = step(&m, &mut states, &mut next)?;
                if i >= 3 {
                    ts.push(s);
                    host.push(m.cuda_graph_stats().last_host_s);
                }
            }
            let s1 = m.cuda_graph_stats();
            let graph = median(ts);
            let dev = m.bench_replay(20).map_err(e)?;
            let (wb, sb) = step_bytes(&c, es, bsz, a.graph_ctx + 30);
            let floor = (wb + sb) / bw;
            let replays = s1.replays - s0.replays;
            println!(
                "| {bsz} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {} | {:.2} ({:.2} + {:.2}) | {:.3} | {:.2}× | {:.2}× | {:.0} |",
                eager * 1e3,
                median(enq) * 1e3,
                median(done) * 1e3,
                graph * 1e3,
                if replays > 0 {
                    format!("{:.3}", median(host) * 1e3)
                } else {
                    "– (no replay)".into()
                },
                dev.map_or("–".into(), |d| format!("{d:.3}")),
                (wb + sb) / 1e9,
                wb / 1e9,
                sb / 1e9,
                floor * 1e3,
                eager / floor,
                graph / floor,
                bsz as f64 / graph
            );
            if replays == 0 {
                println!("\n(batch {bsz}: no graph replay: {s1:?})\n");
            }
            m.clear_cuda_graphs();
        }
        println!("\nstep ms = wall time of `decode_sample` (token ids on the host), median of 10 (after 2 eager warm-up steps; after the graph's warm-up and capture steps). eager host enqueue = the same kernels launched without the download (`decode_enqueue_eager`), until the host returns; eager device done = until the stream is idle. graph host = inputs written and the graph launched (`GraphStats::last_host_s`). graph device = 20 replays back to back timed with events, per replay. floor = bytes per step / the HBM bandwidth above.");
        Ok(())
    }

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        v[v.len() / 2]
    }

    /// Deterministic prompt tokens (a mixing sequence over the vocabulary).
    fn prompt(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
        (0..n as u64)
            .map(|i| {
                (dataplane::random::mix(salt.wrapping_mul(0x1000_0001).wrapping_add(i))
                    % vocab as u64) as u32
            })
            .collect()
    }

    /// Model FLOPs of prefilling `t` tokens after `p0` cached ones, logits of the last
    /// token only (see the module docs).
    fn prefill_flops(c: &ModelConfig, pc: &ParamCounts, p0: usize, t: usize) -> f64 {
        let vh = (c.vocab_size * c.hidden_size) as f64;
        let per_tok = 2.0 * (pc.active_matmul as f64 - vh);
        // Σ_{p=p0}^{p0+t−1} (p+1)
        let keys = (t as f64) * (p0 as f64) + (t as f64) * (t as f64 + 1.0) / 2.0;
        let state = (c.linear_v_heads * c.linear_k_dim * c.linear_v_dim) as f64;
        let mixers: f64 = c
            .mixers
            .iter()
            .map(|m| match m {
                MixerKind::Attention => 4.0 * (c.num_heads * c.head_dim) as f64 * keys,
                MixerKind::Mla => {
                    2.0 * (c.num_heads * (c.mla.qk_head_dim() + c.mla.v_head_dim)) as f64 * keys
                }
                MixerKind::GatedDeltaNet | MixerKind::Kda => {
                    t as f64 * (6.0 * state + 2.0 * (c.conv_dim() * c.conv_kernel) as f64)
                }
                MixerKind::Lightning => t as f64 * 4.0 * state,
            })
            .sum();
        per_tok * t as f64 + 2.0 * vh + mixers
    }

    fn gemm_peak(g: &Gpu) -> Res<f64> {
        let n = 8192usize;
        let e = |x: dataplane::cuda::CudaError| x.to_string();
        let x = random_buffer::<bf16>(g, n * n, 1, 1, 1.0).map_err(e)?;
        let w = random_buffer::<bf16>(g, n * n, 1, 2, 1.0).map_err(e)?;
        let mut y = random_buffer::<bf16>(g, n * n, 1, 3, 1.0).map_err(e)?;
        for _ in 0..3 {
            blas::linear(g, &x, n, n, &w, n, &mut y, bf16::ZERO).map_err(e)?;
        }
        g.sync().map_err(e)?;
        let mut ts = vec![];
        for _ in 0..10 {
            let t = Instant::now();
            blas::linear(g, &x, n, n, &w, n, &mut y, bf16::ZERO).map_err(e)?;
            g.sync().map_err(e)?;
            ts.push(t.elapsed().as_secs_f64());
        }
        let s = median(ts);
        Ok(2.0 * (n as f64).powi(3) / s)
    }

    fn bench<T: Elem>(g: &std::sync::Arc<Gpu>, c: ModelConfig, a: &Args) -> Res<()>
    where
        CudaBlas: Gemm<T>,
    {
        let e = |x: dataplane::cuda::CudaError| x.to_string();
        let pc = ParamCounts::of(&c);
        let es = std::mem::size_of::<T>();
        println!(
            "\n## Model\n\n| parameters | active per token (matmul) | weight bytes (est.) |\n|---|---|---|\n| {:.3} B | {:.3} B | {:.2} GB |",
            pc.total as f64 / 1e9,
            pc.active_matmul as f64 / 1e9,
            pc.bytes(es) as f64 / 1e9
        );
        let peak = gemm_peak(g)?;
        println!(
            "\nbf16 cuBLAS GEMM peak (8192³, this run): {:.1} TFLOP/s",
            peak / 1e12
        );
        let t0 = Instant::now();
        let m = Arc::new(GpuModel::<T>::random(g.clone(), c.clone(), a.seed).map_err(e)?);
        g.sync().map_err(e)?;
        println!(
            "random init on the device: {:.2} s, {:.2} GB of weights",
            t0.elapsed().as_secs_f64(),
            m.weight_bytes() as f64 / 1e9
        );
        if a.profile_decode > 0 {
            let toks = prompt(4096, c.vocab_size, 5);
            let mut st = m.new_state().map_err(e)?;
            m.prefill(&toks, &mut st, Logits::None).map_err(e)?;
            for i in 0..3u32 {
                m.decode(i, &mut st).map_err(e)?;
            }
            g.sync().map_err(e)?;
            // SAFETY: plain driver calls on the current context (bound by the calls above).
            unsafe { cudarc::driver::sys::cuProfilerStart() };
            let t = Instant::now();
            for i in 0..a.profile_decode as u32 {
                m.decode(i % c.vocab_size as u32, &mut st).map_err(e)?;
            }
            g.sync().map_err(e)?;
            // SAFETY: as above.
            unsafe { cudarc::driver::sys::cuProfilerStop() };
            println!(
                "\n{} decode steps at a 4k context between cuProfilerStart/Stop: {:.2} ms each",
                a.profile_decode,
                t.elapsed().as_secs_f64() * 1e3 / a.profile_decode as f64
            );
            return Ok(());
        }

        // TTFT.
        let shapes = ttft_shapes(a);
        println!("\n## TTFT (ms; median of {} after a warm-up)\n", a.reps);
        println!("| segments × tokens | prompt | full recompute | MFU | prefix cache (last segment from a device snapshot) | MFU | snapshot clone | hypic (w = 8, entries prebuilt) | hypic compose per segment (derived) | hypic hits |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        let mut full_by_len: Vec<(usize, f64)> = vec![];
        for (nseg, seg) in shapes {
            let total = nseg * seg;
            let toks = prompt(total, c.vocab_size, (nseg * 1_000_003 + seg) as u64);
            // Full recompute.
            let mut ts = vec![];
            for r in 0..=a.reps {
                let mut st = m.new_state().map_err(e)?;
                g.sync().map_err(e)?;
                let t = Instant::now();
                m.prefill(&toks, &mut st, Logits::Last).map_err(e)?;
                g.sync().map_err(e)?;
                if r > 0 {
                    ts.push(t.elapsed().as_secs_f64());
                }
            }
            let full = median(ts);
            full_by_len.push((total, full));
            let f_full = prefill_flops(&c, &pc, 0, total);
            // Prefix cache: state after n−1 segments, snapshot per run.
            let p0 = total - seg;
            let mut base: GpuState<T> = m.new_state().map_err(e)?;
            m.prefill(&toks[..p0], &mut base, Logits::None).map_err(e)?;
            g.sync().map_err(e)?;
            let (mut ts, mut tc) = (vec![], vec![]);
            for r in 0..=a.reps {
                let t = Instant::now();
                let mut st = base.try_clone().map_err(e)?;
                g.sync().map_err(e)?;
                let clone_s = t.elapsed().as_secs_f64();
                m.prefill(&toks[p0..], &mut st, Logits::Last).map_err(e)?;
                g.sync().map_err(e)?;
                if r > 0 {
                    ts.push(t.elapsed().as_secs_f64());
                    tc.push(clone_s);
                }
            }
            let pref = median(ts);
            let clone = median(tc);
            let f_pref = prefill_flops(&c, &pc, p0, seg);
            drop(base);
            // HYPIC: every segment's entry built by a first run (its own tenant), then
            // timed runs that hit the public pool for segments 0..n−1 and prefill the
            // last one. The private pool gets 1 byte, so no run is a prefix hit (each
            // run still snapshots its running state per segment, as the engine does).
            let engine =
                GpuPicEngine::new(m.clone(), &format!("random-seed{}", a.seed), 1 << 40, 1);
            let segs: Vec<SegmentRef> = toks
                .chunks(seg)
                .map(|ch| SegmentRef {
                    tokens: ch.to_vec(),
                    isolation: "bench".into(),
                })
                .collect();
            let mode = Mode::hypic_default();
            engine
                .run(&segs, mode, "build")
                .map_err(|x| x.to_string())?;
            let (mut ts, mut hits) = (vec![], 0);
            for r in 0..=a.reps {
                g.sync().map_err(e)?;
                let t = Instant::now();
                let out = engine
                    .run(&segs, mode, &format!("run{r}"))
                    .map_err(|x| x.to_string())?;
                g.sync().map_err(e)?;
                if r > 0 {
                    ts.push(t.elapsed().as_secs_f64());
                }
                hits = out.stats.hits;
            }
            let hy = median(ts);
            // Compose per segment ≈ (hypic − last-segment prefill) / (n − 1), with the
            // last-segment prefill time taken from the prefix-cache column minus its clone.
            let compose = (hy - (pref - clone)) / (nseg - 1).max(1) as f64;
            println!(
                "| {nseg} × {seg} | {total} | {:.1} | {:.1}% | {:.1} | {:.1}% | {:.2} | {:.1} | {:.2} | {hits}/{nseg} |",
                full * 1e3,
                100.0 * f_full / full / peak,
                pref * 1e3,
                100.0 * f_pref / pref / peak,
                clone * 1e3,
                hy * 1e3,
                compose * 1e3,
            );
            drop(engine);
        }
        println!("\nMFU = counted model FLOPs (module docs of gpu_model_bench.rs) / time / the bf16 GEMM peak above. The prefix-cache time includes the device-side clone of the snapshot. hypic = `GpuPicEngine::run(Mode::hypic_default())` with every segment's public entry already built (segments 0..n−2 composed: 8-token seam prefill, pair apply, body KV re-rotated and appended; the last segment prefilled); its compose per segment is derived as (hypic − (prefix cache − clone)) / (n − 1), not timed directly.");
        if es != 2 {
            println!("This run is f32 (weights and activations): MFU is still against the bf16 GEMM peak, so it is not comparable to a bf16 run.");
        }

        // Decode.
        let ctxs = decode_ctxs(a);
        println!(
            "\n## Decode step (one token, host logits; ms, median of 10 after 2 warm-up steps)\n"
        );
        println!("| context | step ms | tokens/s | forward without logits: host enqueue ms | … until the device is done ms | 8-token span (a seam window) ms |");
        println!("|---|---|---|---|---|---|");
        for &ctx in ctxs {
            let toks = prompt(ctx, c.vocab_size, 77 + ctx as u64);
            let mut st = m.new_state().map_err(e)?;
            m.prefill(&toks, &mut st, Logits::None).map_err(e)?;
            g.sync().map_err(e)?;
            let mut ts = vec![];
            for i in 0..12u32 {
                let t = Instant::now();
                m.decode(i % c.vocab_size as u32, &mut st).map_err(e)?;
                if i >= 2 {
                    ts.push(t.elapsed().as_secs_f64());
                }
            }
            let s = median(ts);
            // Where the step's time goes: the time to issue one token's forward (no LM
            // head, no download) against the time until the device has finished it.
            // Equal times mean the host's launches are the bottleneck.
            let (mut enq, mut done, mut seam) = (vec![], vec![], vec![]);
            for i in 0..8u32 {
                g.sync().map_err(e)?;
                let t = Instant::now();
                m.prefill(&[i % c.vocab_size as u32], &mut st, Logits::None)
                    .map_err(e)?;
                enq.push(t.elapsed().as_secs_f64());
                g.sync().map_err(e)?;
                done.push(t.elapsed().as_secs_f64());
                let span: Vec<u32> = (0..8u32)
                    .map(|j| (i * 8 + j) % c.vocab_size as u32)
                    .collect();
                let t = Instant::now();
                m.prefill(&span, &mut st, Logits::None).map_err(e)?;
                g.sync().map_err(e)?;
                seam.push(t.elapsed().as_secs_f64());
            }
            println!(
                "| {ctx} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2} |",
                s * 1e3,
                1.0 / s,
                median(enq) * 1e3,
                median(done) * 1e3,
                median(seam) * 1e3
            );
        }
        // The scratch cache (dataplane/src/cuda/scratch.rs) on and off, same run: decode
        // step, its host enqueue time and an 8-token span at a 4k context.
        println!(
            "\n## Scratch cache on / off (4k context; ms, median of 10; `HYPIC_SCRATCH_CACHE_MB` \
             sets the capacity, 0 = off)\n"
        );
        println!("| scratch cache | decode step ms | forward without logits: host enqueue ms | 8-token span ms | cache hits / misses during the rows |");
        println!("|---|---|---|---|---|");
        let cap0 = g.scratch_cache().capacity();
        let toks = prompt(4096, c.vocab_size, 91);
        for (label, cap) in [
            ("off", 0usize),
            ("on", cap0.max(1 << 20)),
            ("off", 0),
            ("on", cap0.max(1 << 20)),
        ] {
            g.scratch_cache().set_capacity(cap);
            let mut st = m.new_state().map_err(e)?;
            m.prefill(&toks, &mut st, Logits::None).map_err(e)?;
            g.sync().map_err(e)?;
            let s0 = g.scratch_cache().stats();
            let (mut step, mut enq, mut seam) = (vec![], vec![], vec![]);
            for i in 0..12u32 {
                let t = Instant::now();
                m.decode(i % c.vocab_size as u32, &mut st).map_err(e)?;
                if i >= 2 {
                    step.push(t.elapsed().as_secs_f64());
                }
                g.sync().map_err(e)?;
                let t = Instant::now();
                m.prefill(&[i % c.vocab_size as u32], &mut st, Logits::None)
                    .map_err(e)?;
                if i >= 2 {
                    enq.push(t.elapsed().as_secs_f64());
                }
                g.sync().map_err(e)?;
                let span: Vec<u32> = (0..8u32)
                    .map(|j| (i * 8 + j) % c.vocab_size as u32)
                    .collect();
                let t = Instant::now();
                m.prefill(&span, &mut st, Logits::None).map_err(e)?;
                g.sync().map_err(e)?;
                if i >= 2 {
                    seam.push(t.elapsed().as_secs_f64());
                }
            }
            let s1 = g.scratch_cache().stats();
            println!(
                "| {label} | {:.2} | {:.2} | {:.2} | {} / {} |",
                median(step) * 1e3,
                median(enq) * 1e3,
                median(seam) * 1e3,
                s1.hits - s0.hits,
                s1.misses - s0.misses
            );
        }
        g.scratch_cache().set_capacity(cap0);
        drop(m);
        layer_split::<T>(g, &c, a, &full_by_len)
    }

    /// Per-layer-kind split: prefill time of two 4-layer models of the same shapes
    /// (all layers of the stack's linear kind — GDN, Lightning or KDA —, all of its
    /// full-attention kind — attention or MLA —; each layer with the FFN most of the
    /// stack's layers have) and a small vocabulary (1024, so embedding and LM head are
    /// negligible), divided by 4; then `n_linear·t_linear + n_full·t_full` against the
    /// whole (or cut) model's full-recompute time. A stack of one kind prints a note.
    fn layer_split<T: Elem>(
        g: &std::sync::Arc<Gpu>,
        c: &ModelConfig,
        a: &Args,
        full_by_len: &[(usize, f64)],
    ) -> Res<()>
    where
        CudaBlas: Gemm<T>,
    {
        let e = |x: dataplane::cuda::CudaError| x.to_string();
        let lin_kind = c.mixers.iter().copied().find(|m| m.is_linear());
        let full_kind = c.mixers.iter().copied().find(|m| !m.is_linear());
        let (Some(lin_kind), Some(full_kind)) = (lin_kind, full_kind) else {
            println!(
                "\n(per-layer-kind split skipped: the model has one kind of layer: {})",
                c.layer_plan()
            );
            return Ok(());
        };
        let n_full = c.num_attention_layers();
        let n_lin = c.num_linear_layers();
        let n_moe = c.layer_is_moe.iter().filter(|m| **m).count();
        let moe = 2 * n_moe >= c.num_layers;
        let mut lens: Vec<usize> = full_by_len.iter().map(|&(l, _)| l).collect();
        lens.sort_unstable();
        lens.dedup();
        let mut per_kind = vec![];
        for kind in [lin_kind, full_kind] {
            let mut cc = c.first_layers(4.min(c.num_layers));
            cc.num_layers = 4;
            cc.mixers = vec![kind; 4];
            cc.layer_is_moe = vec![moe; 4];
            cc.vocab_size = 1024;
            let m = GpuModel::<T>::random(g.clone(), cc.clone(), a.seed).map_err(e)?;
            let mut row = std::collections::HashMap::new();
            for &len in &lens {
                let toks = prompt(len, cc.vocab_size, 5 + len as u64);
                let mut ts = vec![];
                for r in 0..=a.reps {
                    let mut st = m.new_state().map_err(e)?;
                    g.sync().map_err(e)?;
                    let t = Instant::now();
                    m.prefill(&toks, &mut st, Logits::Last).map_err(e)?;
                    g.sync().map_err(e)?;
                    if r > 0 {
                        ts.push(t.elapsed().as_secs_f64());
                    }
                }
                row.insert(len, median(ts) / 4.0);
            }
            per_kind.push(row);
        }
        let (ln, fname) = (lin_kind.name(), full_kind.name());
        println!("\n## Per-layer-kind time split (full-recompute prefill from empty; one layer = mixer + its FFN ({}); ms)\n", if moe { "MoE" } else { "dense MLP" });
        if n_moe != 0 && n_moe != c.num_layers {
            println!(
                "({} of {} layers are MoE; the rest, with a dense MLP, are counted as {} layers here)\n",
                n_moe,
                c.num_layers,
                if moe { "MoE" } else { "dense" }
            );
        }
        println!("| prompt | {ln} layer | {fname} layer | {n_lin}·{ln} + {n_full}·{fname} | whole model | rest (embedding, LM head, gaps) |");
        println!("|---|---|---|---|---|---|");
        let mut seen = std::collections::HashSet::new();
        for &(len, full) in full_by_len {
            if !seen.insert(len) {
                continue;
            }
            let (tl, tf) = (per_kind[0][&len], per_kind[1][&len]);
            let sum = n_lin as f64 * tl + n_full as f64 * tf;
            println!(
                "| {len} | {:.2} | {:.2} | {:.1} ({:.0}% {ln}) | {:.1} | {:.1} |",
                tl * 1e3,
                tf * 1e3,
                sum * 1e3,
                100.0 * n_lin as f64 * tl / sum,
                full * 1e3,
                (full - sum) * 1e3
            );
        }
        Ok(())
    }
}
