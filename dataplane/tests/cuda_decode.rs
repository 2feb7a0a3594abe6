//! The CUDA decode step's serving paths (issue 18): token ids drawn on the device
//! (`GpuModel::decode_sample`, `Engine::decode_sample`) against the host path (logits
//! downloaded, drawn with `sampling::draw`, the CPU sampler's own draw).
//!
//! Built only with `--features cuda` (without it this binary has no tests); built
//! with the feature, every test needs a usable CUDA device and fails without one.
//! Model: the bundled `models/hypic-tiny`, uploaded in fp32 and bf16.
//!
//! * `device_draws_equal_host_draws`: six running sequences with prompts of different
//!   lengths and one draw setting each (greedy; temperature; top-k; top-p; top-k with
//!   top-p; a host-path row) decode 32 steps twice from identical states, once with
//!   `decode_sample` and once with `decode_batch`; every device token must equal
//!   `sampling::draw` on the host logits of the same step, and the host-path row's
//!   logits must equal `decode_batch`'s bit for bit. Both sides feed the host's token,
//!   so one difference does not spread.
//! * `scheduler_device_sampling_equals_host_sampling`: the scheduler over two GPU
//!   engines, device sampling on and off (`set_device_sampling`), serves the same
//!   seeded requests (no logprobs): the tokens must be equal, the device engine's
//!   events must carry NaN log-probabilities (proof the device path ran) and the
//!   host engine's finite ones. The CPU engine's tokens for the same seeded requests
//!   are printed beside them (same draw; equal unless fp32 logit differences move a
//!   draw, which is printed, not asserted).
//!
//! * `gdn_rows_equal_sequence_by_sequence`: the batched Gated DeltaNet decode (one
//!   launch per kernel for the whole batch, states found through a device address
//!   table; `GpuModel::set_gdn_rows(true)`) against the sequence-by-sequence step
//!   (`false`) from identical states: batches of 1, 3 and 6 sequences of different
//!   lengths, 5 steps, graphs off (graphs against the eager step: `cuda_graph.rs`);
//!   logits and final states must be equal bit for bit, in fp32 and bf16.
//!
//! * `attn_rows_equal_sequence_by_sequence`: the batched attention decode (one KV
//!   append and one split-key decode attention for the whole batch, caches found
//!   through a device address table; `GpuModel::set_attn_rows(true)`, bf16) against
//!   the sequence-by-sequence step (`false`), on the synthetic model of
//!   `common/synthetic.rs` with two attention layers (head_dim 256: the decode kernel)
//!   in bf16: batches of 1, 3 and 6 sequences of 3..238 tokens (one to four key
//!   splits; caches that grow on the way), and a batch of four clones of one prefilled
//!   state (`try_clone`: their KV caches share buffers until each claims its row), 12
//!   steps, eagerly and through CUDA graphs; logits and final states must be equal bit
//!   for bit, and the batched models must report the batched path.
//!
//! Every case prints lines starting with two spaces (collected into the gpu-check
//! report). The draws are the same definition on both sides; a difference can only
//! come from fp32 rounding at a top-p boundary or an ulp tie between two Gumbel
//! scores, and none is expected in these few hundred draws: a mismatch fails and is
//! printed with its row, step and parameters.

#[cfg(feature = "cuda")]
#[path = "common/synthetic.rs"]
mod synthetic;

#[cfg(feature = "cuda")]
mod gpu {
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

    use cudarc::cublas::{CudaBlas, Gemm};
    use dataplane::cuda::model::GpuModel;
    use dataplane::cuda::pic::GpuPicEngine;
    use dataplane::cuda::{Elem, Gpu};
    use dataplane::engine::Decoded;
    use dataplane::model::{Logits, Model};
    use dataplane::pic::{Mode, PicEngine, SegmentRef};
    use dataplane::sampling::{draw, DrawParams, SamplingParams};
    use dataplane::scheduler::{GenEvent, GenRequest, Scheduler, SchedulerConfig};
    use half::bf16;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn gpu(test: &str) -> (Arc<Gpu>, MutexGuard<'static, ()>) {
        static G: OnceLock<std::result::Result<Arc<Gpu>, String>> = OnceLock::new();
        static L: Mutex<()> = Mutex::new(());
        let guard = L.lock().unwrap_or_else(|e| e.into_inner());
        let g = G.get_or_init(|| match std::panic::catch_unwind(|| Gpu::new(0)) {
            Ok(Ok(g)) => {
                println!("cuda_decode: device {} ({})", g.name(), g.arch());
                Ok(g)
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("panic while loading the CUDA libraries".into()),
        });
        match g {
            Ok(g) => (g.clone(), guard),
            Err(e) => panic!(
                "{test}: built with `--features cuda`, so it needs a CUDA device, and none is usable: {e}"
            ),
        }
    }

    fn repo_root() -> PathBuf {
        let probe = |p: &Path| p.join("models/hypic-tiny").is_dir();
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

    fn tiny() -> Arc<Model> {
        let dir = repo_root().join("models/hypic-tiny");
        Arc::new(
            Model::load(&dir, &mut |_, _| {})
                .unwrap_or_else(|e| panic!("load {}: {e}", dir.display())),
        )
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

    /// The draw settings of the rows (`None`: the host path).
    fn settings() -> Vec<Option<(f32, usize, f32)>> {
        vec![
            Some((0.0, 0, 1.0)),
            Some((0.8, 0, 1.0)),
            Some((1.0, 20, 1.0)),
            Some((1.2, 0, 0.9)),
            Some((0.9, 50, 0.8)),
            None,
        ]
    }

    fn draws_case<T: Elem>(g: &Arc<Gpu>, m: &Model, rep: &mut Report)
    where
        CudaBlas: Gemm<T>,
    {
        let gm = GpuModel::<T>::upload(g.clone(), m).expect("upload");
        let vocab = m.config.vocab_size;
        let mut rng = StdRng::seed_from_u64(18);
        let rows = settings();
        let prompts: Vec<Vec<u32>> = (0..rows.len())
            .map(|b| {
                (0..5 + 7 * b)
                    .map(|_| rng.random_range(0..vocab.min(300) as u32))
                    .collect()
            })
            .collect();
        let mut dev = vec![];
        let mut host = vec![];
        let mut next = vec![];
        for p in &prompts {
            let mut a = gm.new_state().expect("state");
            let mut b = gm.new_state().expect("state");
            let la = gm.prefill(p, &mut a, Logits::Last).expect("prefill");
            gm.prefill(p, &mut b, Logits::Last).expect("prefill");
            next.push(dataplane::sampling::argmax(&la));
            dev.push(a);
            host.push(b);
        }
        let (mut equal, mut total) = (0usize, 0usize);
        for step in 0..32u64 {
            let draws: Vec<Option<DrawParams>> = rows
                .iter()
                .enumerate()
                .map(|(b, s)| {
                    s.map(|(temperature, top_k, top_p)| DrawParams {
                        temperature,
                        top_k,
                        top_p,
                        seed: 1000 + b as u64,
                        step,
                    })
                })
                .collect();
            let got = {
                let mut st: Vec<&mut _> = dev.iter_mut().collect();
                gm.decode_sample(&next, &mut st, &draws)
                    .expect("decode_sample")
            };
            let want = {
                let mut st: Vec<&mut _> = host.iter_mut().collect();
                gm.decode_batch(&next, &mut st).expect("decode_batch")
            };
            for (b, (got, logits)) in got.iter().zip(&want).enumerate() {
                let host_tok = match draws[b] {
                    Some(p) => draw(logits, &p),
                    None => dataplane::sampling::argmax(logits),
                };
                match (got, draws[b]) {
                    (Decoded::Token(t), Some(p)) => {
                        total += 1;
                        if *t == host_tok {
                            equal += 1;
                        } else {
                            rep.fail(format!(
                                "{}: row {b} step {step} {p:?}: device drew {t}, host {host_tok}",
                                T::SUFFIX
                            ));
                        }
                    }
                    (Decoded::Logits(l), None) => {
                        let same = l.len() == logits.len()
                            && l.iter()
                                .zip(logits)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                        if !same {
                            rep.fail(format!(
                                "{}: row {b} step {step}: host-path logits differ from decode_batch",
                                T::SUFFIX
                            ));
                        }
                    }
                    (d, p) => rep.fail(format!(
                        "{}: row {b} step {step}: draw {p:?} returned {}",
                        T::SUFFIX,
                        match d {
                            Decoded::Token(_) => "a token",
                            Decoded::Logits(_) => "logits",
                        }
                    )),
                }
                next[b] = host_tok;
            }
        }
        println!(
            "  {}: {equal}/{total} device draws equal to the host draw ({} rows, 32 steps)",
            T::SUFFIX,
            rows.len()
        );
        if total == 0 {
            rep.fail(format!("{}: no device draw happened", T::SUFFIX));
        }
    }

    fn gdn_rows_case<T: Elem>(g: &Arc<Gpu>, m: &Model, rep: &mut Report)
    where
        CudaBlas: Gemm<T>,
    {
        let gm = GpuModel::<T>::upload(g.clone(), m).expect("upload");
        gm.set_cuda_graphs(false);
        let vocab = m.config.vocab_size.min(300);
        let mut rng = StdRng::seed_from_u64(21);
        for bsz in [1usize, 3, 6] {
            let mut batched = vec![];
            let mut serial = vec![];
            for b in 0..bsz {
                let p: Vec<u32> = (0..3 + 11 * b)
                    .map(|_| rng.random_range(0..vocab as u32))
                    .collect();
                let mut s = gm.new_state().expect("state");
                gm.prefill(&p, &mut s, Logits::None).expect("prefill");
                serial.push(s.try_clone().expect("clone"));
                batched.push(s);
            }
            let mut differ = 0usize;
            for step in 0..5 {
                let toks: Vec<u32> = (0..bsz)
                    .map(|_| rng.random_range(0..vocab as u32))
                    .collect();
                gm.set_gdn_rows(true);
                if step == 0 && bsz == 1 && !gm.gdn_rows_active() {
                    rep.fail(format!("{}: batched GDN decode is not active", T::SUFFIX));
                }
                let la = gm
                    .decode_batch(&toks, &mut batched.iter_mut().collect::<Vec<_>>())
                    .expect("batched decode");
                gm.set_gdn_rows(false);
                let lb = gm
                    .decode_batch(&toks, &mut serial.iter_mut().collect::<Vec<_>>())
                    .expect("sequence-by-sequence decode");
                for (b, (x, y)) in la.iter().zip(&lb).enumerate() {
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    if bits(x) != bits(y) {
                        differ += 1;
                        rep.fail(format!(
                            "{} batch {bsz} step {step} row {b}: logits differ",
                            T::SUFFIX
                        ));
                    }
                }
            }
            for (b, (x, y)) in batched.iter().zip(&serial).enumerate() {
                if x.to_host().expect("download") != y.to_host().expect("download") {
                    differ += 1;
                    rep.fail(format!(
                        "{} batch {bsz} row {b}: final states differ",
                        T::SUFFIX
                    ));
                }
            }
            println!(
                "  {} batch {bsz}: batched GDN decode vs sequence by sequence, 5 steps: {}",
                T::SUFFIX,
                if differ == 0 {
                    "bit-identical logits and states".to_string()
                } else {
                    format!("{differ} differences")
                }
            );
        }
        gm.set_gdn_rows(true);
    }

    #[test]
    fn gdn_rows_equal_sequence_by_sequence() {
        let test = "gdn_rows_equal_sequence_by_sequence";
        let (g, _l) = gpu(test);
        let m = tiny();
        let mut rep = Report::new();
        gdn_rows_case::<f32>(&g, &m, &mut rep);
        gdn_rows_case::<bf16>(&g, &m, &mut rep);
        rep.finish(test);
    }

    #[test]
    fn attn_rows_equal_sequence_by_sequence() {
        let test = "attn_rows_equal_sequence_by_sequence";
        let (g, _l) = gpu(test);
        let m = super::synthetic::synthetic_model_with(&[
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ])
        .expect("synthetic model");
        let mut rep = Report::new();
        let mk = |rows: bool, graphs: bool| {
            let gm = GpuModel::<bf16>::upload(g.clone(), &m).expect("upload");
            gm.set_attn_rows(rows);
            gm.set_cuda_graphs(graphs);
            gm
        };
        let reference = mk(false, false);
        let sides = [("eager", mk(true, false)), ("graphs", mk(true, true))];
        if reference.attn_rows_active() {
            rep.fail("the reference model reports batched attention".into());
        }
        for (name, side) in &sides {
            if !side.attn_rows_active() {
                rep.fail(format!("{name}: batched attention is not active"));
            }
        }
        let vocab = m.config.vocab_size as u32;
        let mut rng = StdRng::seed_from_u64(33);
        // (batch, clones): `clones` = the batch is copies of one prefilled state.
        for (bsz, clones) in [(1usize, false), (3, false), (6, false), (4, true)] {
            let prompts: Vec<Vec<u32>> = (0..bsz)
                .map(|b| {
                    (0..3 + 47 * b)
                        .map(|_| rng.random_range(0..vocab))
                        .collect()
                })
                .collect();
            let prefill = |gm: &GpuModel<bf16>| {
                if clones {
                    let mut s = gm.new_state().expect("state");
                    gm.prefill(&prompts[bsz - 1], &mut s, Logits::None)
                        .expect("prefill");
                    let mut v: Vec<_> = (1..bsz).map(|_| s.try_clone().expect("clone")).collect();
                    v.push(s);
                    return v;
                }
                prompts
                    .iter()
                    .map(|p| {
                        let mut s = gm.new_state().expect("state");
                        gm.prefill(p, &mut s, Logits::None).expect("prefill");
                        s
                    })
                    .collect::<Vec<_>>()
            };
            let mut ref_states = prefill(&reference);
            let mut side_states: Vec<_> = sides.iter().map(|(_, gm)| prefill(gm)).collect();
            let caps0: Vec<usize> = ref_states.iter().map(kv_cap).collect();
            let mut differ = 0usize;
            for step in 0..12 {
                let toks: Vec<u32> = (0..bsz).map(|_| rng.random_range(0..vocab)).collect();
                let want = reference
                    .decode_batch(&toks, &mut ref_states.iter_mut().collect::<Vec<_>>())
                    .expect("sequence-by-sequence decode");
                for ((name, gm), states) in sides.iter().zip(side_states.iter_mut()) {
                    let got = gm
                        .decode_batch(&toks, &mut states.iter_mut().collect::<Vec<_>>())
                        .expect("batched decode");
                    for (b, (x, y)) in got.iter().zip(&want).enumerate() {
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        if bits(x) != bits(y) {
                            differ += 1;
                            rep.fail(format!(
                                "{name} batch {bsz} step {step} row {b}: logits differ"
                            ));
                        }
                    }
                }
            }
            for ((name, _), states) in sides.iter().zip(&side_states) {
                for (b, (x, y)) in states.iter().zip(&ref_states).enumerate() {
                    if x.to_host().expect("download") != y.to_host().expect("download") {
                        differ += 1;
                        rep.fail(format!("{name} batch {bsz} row {b}: final states differ"));
                    }
                }
            }
            let caps1: Vec<usize> = ref_states.iter().map(kv_cap).collect();
            println!(
                "  bf16 batch {bsz}{}: batched attention decode (eager and graphs) vs sequence \
                 by sequence, 12 steps, KV capacities {caps0:?} -> {caps1:?}: {}",
                if clones { " of clones" } else { "" },
                if differ == 0 {
                    "bit-identical logits and states".to_string()
                } else {
                    format!("{differ} differences")
                }
            );
        }
        let st = sides[1].1.cuda_graph_stats();
        println!(
            "  graph side: {} replays, {} captures, {} failures",
            st.replays, st.captures, st.failures
        );
        if st.replays == 0 || st.failures > 0 {
            rep.fail(format!(
                "graph side: {st:?} (expected replays, no failures)"
            ));
        }
        rep.finish(test);
    }

    /// Capacity of the first attention layer's KV cache.
    fn kv_cap(s: &dataplane::cuda::model::GpuState<bf16>) -> usize {
        s.layers
            .iter()
            .find_map(|l| match l {
                dataplane::cuda::model::GpuLayerState::Full(kv) => Some(kv.capacity()),
                _ => None,
            })
            .unwrap_or(0)
    }

    #[test]
    fn device_draws_equal_host_draws() {
        let test = "device_draws_equal_host_draws";
        let (g, _l) = gpu(test);
        let m = tiny();
        let mut rep = Report::new();
        draws_case::<f32>(&g, &m, &mut rep);
        draws_case::<bf16>(&g, &m, &mut rep);
        rep.finish(test);
    }

    type Served = Vec<(Vec<u32>, Vec<f32>, String)>;

    fn serve(sched: &Scheduler, prompts: &[Vec<SegmentRef>]) -> Served {
        let req = |i: usize, segments: Vec<SegmentRef>| GenRequest {
            segments,
            mode: Mode::hypic_default(),
            tenant: "t".into(),
            sampling: SamplingParams {
                temperature: [0.0, 0.7, 1.0, 1.3][i % 4],
                top_k: [0, 0, 40, 0][i % 4],
                top_p: [1.0, 0.95, 1.0, 0.85][i % 4],
                seed: Some(77 + i as u64),
                ..Default::default()
            },
            max_tokens: 16,
            stop_token_ids: vec![],
            top_logprobs: 0,
            logprobs: false,
            score: None,
        };
        let mut hs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| sched.submit(req(i, p.clone())).expect("submit"))
            .collect();
        hs.iter_mut()
            .map(|h| {
                let (mut toks, mut lps, mut end) = (vec![], vec![], String::new());
                while let Some(e) = h.events.blocking_recv() {
                    match e {
                        GenEvent::Token { id, logprob, .. } => {
                            toks.push(id);
                            lps.push(logprob);
                        }
                        GenEvent::Done { reason, .. } => {
                            end = format!("{reason:?}");
                            break;
                        }
                        GenEvent::Error { kind, message } => {
                            end = format!("error {kind:?}: {message}");
                            break;
                        }
                        _ => {}
                    }
                }
                (toks, lps, end)
            })
            .collect()
    }

    #[test]
    fn scheduler_device_sampling_equals_host_sampling() {
        let test = "scheduler_device_sampling_equals_host_sampling";
        let (g, _l) = gpu(test);
        let m = tiny();
        let mut rep = Report::new();
        let vocab = m.config.vocab_size;
        let mut rng = StdRng::seed_from_u64(5);
        let prompts: Vec<Vec<SegmentRef>> = (0..8)
            .map(|i| {
                vec![SegmentRef {
                    tokens: (0..12 + 9 * i)
                        .map(|_| rng.random_range(0..vocab.min(300) as u32))
                        .collect(),
                    isolation: "t".into(),
                }]
            })
            .collect();
        let gm = Arc::new(GpuModel::<f32>::upload(g.clone(), &m).expect("upload"));
        let mut on = GpuPicEngine::new(gm.clone(), "hypic-tiny", 1 << 30, 1 << 30);
        on.set_device_sampling(true);
        let mut off = GpuPicEngine::new(gm, "hypic-tiny", 1 << 30, 1 << 30);
        off.set_device_sampling(false);
        let cfg = SchedulerConfig::default();
        let dev = serve(&Scheduler::start(Arc::new(on), cfg.clone()), &prompts);
        let host = serve(&Scheduler::start(Arc::new(off), cfg.clone()), &prompts);
        let cpu = serve(
            &Scheduler::start(
                Arc::new(PicEngine::new(m.clone(), "hypic-tiny", 1 << 30, 1 << 30)),
                cfg,
            ),
            &prompts,
        );
        for (i, ((d, h), c)) in dev.iter().zip(&host).zip(&cpu).enumerate() {
            println!(
                "  request {i}: device {} tokens ({}), host {} ({}), cpu {}",
                d.0.len(),
                d.2,
                h.0.len(),
                h.2,
                if c.0 == h.0 {
                    "equal".to_string()
                } else {
                    let j = c.0.iter().zip(&h.0).position(|(a, b)| a != b);
                    format!("differs from token {j:?}")
                }
            );
            if d.2.starts_with("error") || h.2.starts_with("error") {
                rep.fail(format!("request {i}: device {}, host {}", d.2, h.2));
                continue;
            }
            if d.0 != h.0 {
                rep.fail(format!(
                    "request {i}: device tokens {:?} != host tokens {:?}",
                    d.0, h.0
                ));
            }
            // The first token comes from the prompt's logits (always the host path).
            if d.1.iter().skip(1).any(|l| !l.is_nan()) {
                rep.fail(format!(
                    "request {i}: a decode-step token carried a log-probability: the device path did not run"
                ));
            }
            if h.1.iter().any(|l| !l.is_finite()) {
                rep.fail(format!(
                    "request {i}: host-path log-probabilities {:?}",
                    h.1
                ));
            }
        }
        rep.finish(test);
    }
}
