//! CUDA graphs of the decode step (`dataplane::cuda::graph`, issue 18 item 3): a model
//! whose decode steps replay recorded graphs must give the eager model's logits and
//! tokens bit for bit.
//!
//! Built only with `--features cuda`. Without a usable CUDA device every test prints
//! `skipped: …` and returns (it has not run then, and is not a pass).
//!
//! Models: the golden fixtures `qwen3_next`, `qwen3_5_moe` (MoE) and `qwen3_5`
//! (head_dim 32: the generic attention kernel), the bundled `models/hypic-tiny`
//! (head_dim 64: the tiled kernel) and the synthetic model of `common/synthetic.rs`
//! (head_dim 256: in bf16 the split-key decode kernel), each in f32 and bf16.
//!
//! Per model and dtype (`graph_decode_equals_eager`): two `GpuModel`s on one device
//! from the same weights, one with graphs off (the eager reference) and one with them
//! on; eight sequences with prompts of 5..40 tokens prefilled on both; then 60 decode
//! steps in phases that change the batch (1 → 3 → 8 → 3 with other members → 8 again):
//! sequences join and leave, rows are greedy, seeded samples (temperature, top-k,
//! top-p) or host-logit rows, and a phase runs `decode_batch` (logits only). Each KV
//! cache grows past its capacity on the way (printed). Midway, five sequences are
//! dropped on both sides and five new ones prefilled (their buffers may reuse the
//! dropped ones' addresses): the graphs recorded for the old states must not give
//! stale results. Every step compares token ids and logits bit for bit; both sides
//! are fed the eager side's tokens. The graph model's counters must show replays and
//! captures (proof the graph path ran).
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

#[cfg(feature = "cuda")]
#[path = "common/synthetic.rs"]
mod synthetic;

#[cfg(feature = "cuda")]
mod gpu {
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

    use cudarc::cublas::{CudaBlas, Gemm};
    use dataplane::cuda::model::{GpuModel, GpuState};
    use dataplane::cuda::{Elem, Gpu};
    use dataplane::engine::Decoded;
    use dataplane::model::{Logits, Model};
    use dataplane::sampling::DrawParams;
    use half::bf16;

    fn gpu(test: &str) -> Option<(Arc<Gpu>, MutexGuard<'static, ()>)> {
        static G: OnceLock<std::result::Result<Arc<Gpu>, String>> = OnceLock::new();
        static L: Mutex<()> = Mutex::new(());
        let guard = L.lock().unwrap_or_else(|e| e.into_inner());
        let g = G.get_or_init(|| match std::panic::catch_unwind(|| Gpu::new(0)) {
            Ok(Ok(g)) => {
                println!("cuda_graph: device {} ({})", g.name(), g.arch());
                Ok(g)
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("panic while loading the CUDA libraries".into()),
        });
        match g {
            Ok(g) => Some((g.clone(), guard)),
            Err(e) => {
                println!("skipped: {test}: no usable CUDA device ({e})");
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

    fn models() -> Vec<(String, Model)> {
        let root = repo_root();
        let mut v = vec![];
        for n in ["qwen3_next", "qwen3_5_moe", "qwen3_5"] {
            let d = root.join("dataplane/tests/fixtures/golden").join(n);
            v.push((
                n.to_string(),
                Model::load(&d, &mut |_, _| {}).unwrap_or_else(|e| panic!("load {n}: {e}")),
            ));
        }
        let d = root.join("models/hypic-tiny");
        v.push((
            "hypic-tiny".into(),
            Model::load(&d, &mut |_, _| {}).unwrap_or_else(|e| panic!("load hypic-tiny: {e}")),
        ));
        v.push((
            "synthetic-hd256".into(),
            super::synthetic::synthetic_model().expect("synthetic model"),
        ));
        v
    }

    /// A deterministic prompt of `n` tokens for sequence `s`.
    fn prompt(s: usize, n: usize, vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|i| ((s * 7919 + i * 104_729 + 13) % vocab) as u32)
            .collect()
    }

    /// Draw setting of row `j` at step `step` of phase `ph` (`None`: host logits).
    fn draw_for(ph: usize, j: usize, step: u64) -> Option<DrawParams> {
        let d = |temperature: f32, top_k: usize, top_p: f32, seed: u64| DrawParams {
            temperature,
            top_k,
            top_p,
            seed,
            step,
        };
        match (ph + j) % 5 {
            0 => Some(d(0.0, 0, 1.0, 0)),
            1 => Some(d(0.8, 0, 1.0, 11 + j as u64)),
            2 => Some(d(1.0, 20, 1.0, 29 + j as u64)),
            3 => Some(d(0.7, 0, 0.9, 37 + j as u64)),
            _ => None,
        }
    }

    fn argmax(l: &[f32]) -> u32 {
        let mut b = 0usize;
        for (i, &x) in l.iter().enumerate() {
            if x > l[b] {
                b = i;
            }
        }
        b as u32
    }

    struct Side<T: Elem> {
        model: GpuModel<T>,
        states: Vec<Option<GpuState<T>>>,
    }

    fn kv_caps<T: Elem>(s: &GpuState<T>) -> Vec<usize> {
        s.layers
            .iter()
            .filter_map(|l| match l {
                dataplane::cuda::model::GpuLayerState::Full(kv) => Some(kv.capacity()),
                _ => None,
            })
            .collect()
    }

    #[allow(clippy::needless_range_loop)]
    fn run<T: Elem>(g: &Arc<Gpu>, label: &str, m: &Model) -> Vec<String>
    where
        CudaBlas: Gemm<T>,
    {
        let vocab = m.config.vocab_size;
        let mut fails = vec![];
        let mk = |graphs: bool| {
            let model = GpuModel::<T>::upload(g.clone(), m).expect("upload");
            model.set_cuda_graphs(graphs);
            Side {
                model,
                states: (0..8).map(|_| None).collect(),
            }
        };
        let mut eager = mk(false);
        let mut graph = mk(true);
        if !graph.model.cuda_graphs_enabled() {
            println!(
                "  {label} {}: graphs unavailable on this device stream",
                T::SUFFIX
            );
        }
        let mut next: Vec<u32> = vec![0; 8];
        // Prefills prompt `p` (n tokens) into slot `s`.
        let start = |side: &mut Side<T>, s: usize, p: usize, n: usize| -> Vec<f32> {
            let mut st = side.model.new_state().expect("state");
            let l = side
                .model
                .prefill(&prompt(p, n, vocab), &mut st, Logits::Last)
                .expect("prefill");
            side.states[s] = Some(st);
            l
        };
        for s in 0..8 {
            let n = 5 + 5 * s;
            let le = start(&mut eager, s, s, n);
            let lg = start(&mut graph, s, s, n);
            if le.iter().zip(&lg).any(|(a, b)| a.to_bits() != b.to_bits()) {
                fails.push(format!("{label}: prefill of sequence {s} differs"));
            }
            next[s] = argmax(&le);
        }
        let caps0: Vec<Vec<usize>> = eager
            .states
            .iter()
            .map(|s| kv_caps(s.as_ref().expect("state")))
            .collect();
        // (members, steps, logits only)
        let phases: [(&[usize], usize, bool); 6] = [
            (&[0], 10, false),
            (&[0, 1, 2], 10, false),
            (&[0, 1, 2, 3, 4, 5, 6, 7], 10, false),
            (&[2, 5, 7], 10, true),
            (&[4, 0, 6], 10, false),
            (&[0, 1, 2, 3, 4, 5, 6, 7], 10, false),
        ];
        let mut step = 0u64;
        let mut compared = 0usize;
        for (ph, &(members, steps, logits_only)) in phases.iter().enumerate() {
            if ph == 4 {
                // Drop five sequences and start five new ones (buffers may be reused).
                for s in 3..8 {
                    eager.states[s] = None;
                    graph.states[s] = None;
                }
                for s in 3..8 {
                    let n = 7 + 3 * s;
                    let le = start(&mut eager, s, s + 8, n);
                    let lg = start(&mut graph, s, s + 8, n);
                    if le.iter().zip(&lg).any(|(a, b)| a.to_bits() != b.to_bits()) {
                        fails.push(format!("{label}: prefill of new sequence {s} differs"));
                    }
                    next[s] = argmax(&le);
                }
            }
            for _ in 0..steps {
                let toks: Vec<u32> = members.iter().map(|&s| next[s]).collect();
                let draws: Vec<Option<DrawParams>> = members
                    .iter()
                    .enumerate()
                    .map(|(j, _)| {
                        if logits_only {
                            None
                        } else {
                            draw_for(ph, j, step)
                        }
                    })
                    .collect();
                let mut outs = vec![];
                for side in [&mut eager, &mut graph] {
                    let mut refs: Vec<&mut GpuState<T>> = vec![];
                    let mut pool: Vec<Option<&mut GpuState<T>>> =
                        side.states.iter_mut().map(|s| s.as_mut()).collect();
                    for &s in members {
                        refs.push(pool[s].take().expect("member state"));
                    }
                    let out = if logits_only {
                        side.model
                            .decode_batch(&toks, &mut refs)
                            .expect("decode_batch")
                            .into_iter()
                            .map(Decoded::Logits)
                            .collect::<Vec<_>>()
                    } else {
                        side.model
                            .decode_sample(&toks, &mut refs, &draws)
                            .expect("decode_sample")
                    };
                    outs.push(out);
                }
                let (oe, og) = (&outs[0], &outs[1]);
                for (j, &s) in members.iter().enumerate() {
                    match (&oe[j], &og[j]) {
                        (Decoded::Token(a), Decoded::Token(b)) => {
                            if a != b {
                                fails.push(format!(
                                    "{label}: phase {ph} step {step} seq {s}: token {a} eager, {b} graph"
                                ));
                            }
                            next[s] = *a;
                        }
                        (Decoded::Logits(a), Decoded::Logits(b)) => {
                            let bad = a.len() != b.len()
                                || a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits());
                            if bad {
                                let d = a
                                    .iter()
                                    .zip(b)
                                    .map(|(x, y)| (x - y).abs())
                                    .fold(0f32, f32::max);
                                fails.push(format!(
                                    "{label}: phase {ph} step {step} seq {s}: logits differ (max |Δ| {d:e})"
                                ));
                            }
                            next[s] = argmax(a);
                        }
                        _ => fails.push(format!(
                            "{label}: phase {ph} step {step} seq {s}: different row kinds"
                        )),
                    }
                    compared += 1;
                }
                step += 1;
            }
        }
        let grew = eager
            .states
            .iter()
            .zip(&caps0)
            .take(3)
            .filter(|(s, c)| kv_caps(s.as_ref().expect("state")) != **c)
            .count();
        let st = graph.model.cuda_graph_stats();
        println!(
            "  {label} {}: {step} steps, {compared} rows compared, KV capacity grew in {grew} of \
             sequences 0..3; graph stats {st:?}; failures {}",
            T::SUFFIX,
            fails.len()
        );
        let off_on_purpose = std::env::var("HYPIC_CUDA_GRAPHS").is_ok_and(|v| v == "0");
        if !graph.model.cuda_graphs_enabled() && !off_on_purpose {
            fails.push(format!(
                "{label}: CUDA graphs are unavailable (the comparison was eager against eager)"
            ));
        }
        if graph.model.cuda_graphs_enabled() && (st.replays == 0 || st.captures == 0) {
            fails.push(format!("{label}: the graph path never replayed ({st:?})"));
        }
        if grew == 0 {
            fails.push(format!("{label}: no KV capacity growth happened"));
        }
        for f in fails.iter().take(10) {
            println!("  FAIL {f}");
        }
        fails
    }

    #[test]
    fn graph_decode_equals_eager() {
        let Some((g, _guard)) = gpu("graph_decode_equals_eager") else {
            return;
        };
        let mut fails = vec![];
        for (label, m) in models() {
            fails.extend(run::<f32>(&g, &label, &m));
            fails.extend(run::<bf16>(&g, &label, &m));
        }
        assert!(
            fails.is_empty(),
            "{} failure(s):\n{}",
            fails.len(),
            fails.join("\n")
        );
    }
}
