//! Segment parallelism between GPUs of one process (`dataplane::cuda::peer`): the
//! device checksum kernel against its CPU reference, and a combiner with in-process
//! GPU workers over the peer transport against a single GPU engine.
//!
//! Built only with `--features cuda` (without it this binary has no tests); built
//! with the feature, every test needs a usable CUDA device and fails without one,
//! except `peer_across_two_gpus_*`, which needs two and prints
//! `skipped: needs 2 GPUs` (a skip, not a pass: scripts/gpu-check.sh reports it as
//! such) when there is one.
//!
//! Model: the bundled `models/hypic-tiny` in f32 (each engine its own replica, its
//! own `Gpu` handle on device 0). Checked, for a prompt of a system prompt, four
//! unequal documents and a query: bit-identical logits and equal statistics to one
//! engine alone, first cold (every document built by a worker and copied device to
//! device) then reordered (every document a hit, nothing scattered); a device entry
//! damaged after the copy is detected by the receiver's checksum and recomputed,
//! never composed; no driver thread, no segment in flight and the combiner's public
//! pool (entries, bytes, counters) as one engine's afterwards.
//!
//! NCCL (`dataplane::cuda::nccl`, a worker served over TCP in this process with
//! `serve_tcp_with`): with two GPUs a worker on GPU 1 ships to a combiner on GPU 0
//! by ncclSend/ncclRecv (`nccl_across_two_gpus_*`, else `skipped: needs 2 GPUs`); on
//! one GPU both ranks on GPU 0 must fail NCCL's set-up and fall back to wire frames
//! over TCP with the same answer (`nccl_on_one_gpu_falls_back_to_tcp`).
//!
//! Every case prints a line starting with two spaces (collected into the gpu-check
//! report).

#[cfg(feature = "cuda")]
mod gpu {
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex, MutexGuard};
    use std::time::{Duration, Instant};

    use dataplane::cuda::device::device_count;
    use dataplane::cuda::model::GpuModel;
    use dataplane::cuda::nccl::{nccl_present, NcclReceiver, NcclSender};
    use dataplane::cuda::peer::{bytes_hash, entry_checksum, peer_transport, PeerPath};
    use dataplane::cuda::pic::{EntryBuffer, GpuBackend, GpuPicEngine};
    use dataplane::cuda::Gpu;
    use dataplane::model::Model;
    use dataplane::parallel::checksum;
    use dataplane::parallel::scatter::{ColdSegment, Scatter, ScatterConfig, ScatterReport};
    use dataplane::parallel::transport::{
        Faults, InProcess, NcclJoin, Tcp, Transport, DEFAULT_MAX_FRAME,
    };
    use dataplane::parallel::worker::{serve_tcp_with, Worker};
    use dataplane::parallel::EntrySource;
    use dataplane::pic::{Mode, PicOutput, SegmentRef};

    type Engine = GpuPicEngine<f32>;

    fn lock() -> MutexGuard<'static, ()> {
        static L: Mutex<()> = Mutex::new(());
        L.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh handle on device `ordinal`; panics (a failure, not a skip) when it
    /// is not usable.
    fn gpu(test: &str, ordinal: usize) -> Arc<Gpu> {
        match std::panic::catch_unwind(|| Gpu::new(ordinal)) {
            Ok(Ok(g)) => g,
            Ok(Err(e)) => panic!(
                "{test}: built with `--features cuda`, so it needs a CUDA device, and device \
                 {ordinal} is not usable: {e}"
            ),
            Err(_) => panic!("{test}: panic while loading the CUDA libraries"),
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

    fn host_model() -> Arc<Model> {
        static M: std::sync::OnceLock<Arc<Model>> = std::sync::OnceLock::new();
        M.get_or_init(|| {
            let dir = repo_root().join("models/hypic-tiny");
            Arc::new(
                Model::load(&dir, &mut |_, _| {})
                    .unwrap_or_else(|e| panic!("load {}: {e}", dir.display())),
            )
        })
        .clone()
    }

    /// An engine with its own replica on its own handle of device `ordinal`.
    fn engine(test: &str, ordinal: usize) -> Arc<Engine> {
        let g = gpu(test, ordinal);
        let m = GpuModel::<f32>::upload(g, &host_model()).expect("upload hypic-tiny");
        Arc::new(GpuPicEngine::new(
            Arc::new(m),
            "hypic-tiny",
            1 << 30,
            1 << 30,
        ))
    }

    fn seg(n: usize, seed: u32, vocab: usize) -> SegmentRef {
        SegmentRef {
            tokens: (0..n as u32)
                .map(|i| ((i * 31 + seed * 17 + 3) as usize % vocab) as u32)
                .collect(),
            isolation: "t".into(),
        }
    }

    /// System prompt, four unequal documents, the query.
    fn request() -> Vec<SegmentRef> {
        let v = host_model().config.vocab_size.min(4096);
        vec![
            seg(10, 1, v),
            seg(40, 2, v),
            seg(70, 3, v),
            seg(25, 4, v),
            seg(55, 5, v),
            seg(12, 6, v),
        ]
    }

    fn reordered(segs: &[SegmentRef]) -> Vec<SegmentRef> {
        let mut again = segs.to_vec();
        again.swap(1, 3);
        again.swap(2, 4);
        again
    }

    struct Shared(Arc<InProcess<GpuBackend<f32>>>);
    impl Transport for Shared {
        fn name(&self) -> String {
            self.0.name()
        }
        fn kind(&self) -> &'static str {
            self.0.kind()
        }
        fn ping(
            &self,
            t: Duration,
        ) -> Result<
            dataplane::parallel::transport::WorkerInfo,
            dataplane::parallel::transport::TransportError,
        > {
            self.0.ping(t)
        }
        fn start(
            &self,
            task: dataplane::parallel::transport::Task,
            t: Duration,
        ) -> Result<
            Box<dyn dataplane::parallel::transport::Replies>,
            dataplane::parallel::transport::TransportError,
        > {
            self.0.start(task, t)
        }
    }

    struct Rig {
        combiner: Arc<Engine>,
        scatter: Arc<Scatter>,
        workers: Vec<Arc<InProcess<GpuBackend<f32>>>>,
    }

    /// A combiner on device `at` and one worker per entry of `devices`, each over
    /// the peer transport.
    fn rig(test: &str, at: usize, devices: &[usize]) -> (Rig, Vec<PeerPath>) {
        let combiner = engine(test, at);
        let dst = combiner.model().gpu().clone();
        let mut paths = vec![];
        let workers: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(k, &d)| {
                let w = Arc::new(Worker::new(engine(test, d)));
                let (t, p) = peer_transport(w, &format!("cuda:{d}/{k}"), dst.clone())
                    .expect("peer transport");
                paths.push(p);
                Arc::new(t)
            })
            .collect();
        let transports: Vec<Box<dyn Transport>> = workers
            .iter()
            .map(|w| Box::new(Shared(w.clone())) as Box<dyn Transport>)
            .collect();
        // A generous floor: a first use may compile kernels; a missed deadline would
        // show as a reassignment, which the tests refuse.
        let cfg = ScatterConfig {
            floor: Duration::from_secs(120),
            ..ScatterConfig::default()
        };
        let scatter = Scatter::new(transports, combiner.model_fingerprint(), cfg);
        assert_eq!(scatter.check_health(), devices.len(), "every worker up");
        for k in 0..devices.len() {
            scatter.set_tokens_per_s(k, 1e6);
        }
        (
            Rig {
                combiner,
                scatter,
                workers,
            },
            paths,
        )
    }

    fn cold(e: &Engine, segs: &[SegmentRef], mode: Mode) -> Vec<ColdSegment> {
        e.cold_segments(segs, mode, "tenant")
            .into_iter()
            .map(|(index, roles)| ColdSegment {
                index,
                tokens: segs[index].tokens.clone(),
                isolation: segs[index].isolation.clone(),
                roles,
            })
            .collect()
    }

    type Out = PicOutput<dataplane::cuda::model::GpuState<f32>>;

    fn scattered(r: &Rig, segs: &[SegmentRef], mode: Mode) -> (Out, ScatterReport) {
        let run = r.scatter.start(cold(&r.combiner, segs, mode));
        let src = run.clone().map(|x| x as Arc<dyn EntrySource>);
        let mut job = r
            .combiner
            .begin_with_source(segs.to_vec(), mode, "tenant", src)
            .unwrap();
        // Unbounded budgets, as `Pic::run` (a build in pieces rounds differently).
        while !job.is_done() {
            r.combiner.advance(&mut job, usize::MAX, true).unwrap();
        }
        let report = run.map(|x| x.report()).unwrap_or_default();
        (job.take_output().unwrap(), report)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// No driver thread, no segment in flight.
    fn drained(s: &Scatter) {
        let t = Instant::now();
        while s.drivers() > 0 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "scatter drivers still running"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let m = s.metrics();
        assert!(
            m.workers.iter().all(|w| w.in_flight == 0),
            "segments still in flight: {m:?}"
        );
    }

    fn raw_bytes(g: &Gpu, b: &EntryBuffer<'_, f32>) -> Vec<u8> {
        let v = match b {
            EntryBuffer::F32(v) | EntryBuffer::Elem(v) => {
                if v.is_empty() {
                    return vec![];
                }
                let x = g.stream().clone_dtoh(v).unwrap();
                g.sync().unwrap();
                x
            }
        };
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// The kernel `hash_word_sum` equals `parallel::checksum` (the CPU reference)
    /// on buffers of every tail length and several seeds, up to 4 MiB.
    #[test]
    fn checksum_kernel_matches_cpu_reference() {
        let _l = lock();
        let g = gpu("checksum_kernel_matches_cpu_reference", 0);
        let mut n_ok = 0;
        for n in [
            0usize,
            1,
            2,
            3,
            4,
            5,
            7,
            8,
            255,
            256,
            1023,
            4097,
            65_537,
            4 << 20,
        ] {
            let b: Vec<u8> = (0..n as u64)
                .map(|i| (checksum::mix64(i ^ 0x5555) >> 17) as u8)
                .collect();
            for seed in [0u64, 1, 17, u64::MAX] {
                let dev = bytes_hash(&g, &b, seed).unwrap();
                let cpu = checksum::buffer_hash(&b, seed);
                assert_eq!(dev, cpu, "{n} bytes, seed {seed}");
                n_ok += 1;
            }
        }
        println!("  checksum kernel = CPU reference on {n_ok} (length, seed) cases, up to 4 MiB");
    }

    /// The device checksum of a built entry equals the CPU reference over the
    /// entry's downloaded buffers, and a copy to the same device has the same
    /// checksum; a damaged copy does not.
    #[test]
    fn entry_checksum_matches_cpu_reference_and_copies_keep_it() {
        let _l = lock();
        let t = "entry_checksum_matches_cpu_reference_and_copies_keep_it";
        let e = engine(t, 0);
        let segs = request();
        let built = e.build_entries(&segs[2].tokens, &[0, 8]).unwrap();
        let other = gpu(t, 0);
        for x in &built {
            let g = x.gpu().clone();
            let bufs: Vec<Vec<u8>> = x.buffers().iter().map(|b| raw_bytes(&g, b)).collect();
            let refs: Vec<&[u8]> = bufs.iter().map(|b| &b[..]).collect();
            let cpu = checksum::entry_checksum(x.len, x.body_start, &refs);
            let dev = entry_checksum(x).unwrap();
            assert_eq!(dev, cpu, "body start {}", x.body_start);
            let mut copy = x.copy_to(&other).unwrap();
            assert_eq!(entry_checksum(&copy).unwrap(), dev);
            assert!(copy.damage().unwrap());
            assert_ne!(entry_checksum(&copy).unwrap(), dev);
            println!(
                "  entry (body start {}, {} buffers, {} bytes): device checksum {dev:016x} = CPU reference; a copy keeps it, a damaged copy does not",
                x.body_start,
                bufs.len(),
                x.bytes()
            );
        }
    }

    /// Two in-process workers on device 0 and a combiner on device 0, over the peer
    /// transport, against one engine alone: bit-identical logits, equal statistics
    /// and an equal public pool, cold then reordered.
    #[test]
    fn peer_scatter_matches_single_engine_f32() {
        let _l = lock();
        let t = "peer_scatter_matches_single_engine_f32";
        let mode = Mode::hypic_default();
        let segs = request();
        // The baseline is deterministic: two engines alone agree bit for bit.
        let single = engine(t, 0);
        let want = single.run(&segs, mode, "tenant").unwrap();
        let again = engine(t, 0).run(&segs, mode, "tenant").unwrap();
        assert_eq!(
            bits(&again.logits),
            bits(&want.logits),
            "two engines alone differ (max |Δ| {}): the GPU path is not deterministic",
            max_abs_diff(&again.logits, &want.logits)
        );
        let (r, paths) = rig(t, 0, &[0, 0]);
        assert!(
            paths.iter().all(|p| *p == PeerPath::SameDevice),
            "{paths:?}"
        );
        let (got, rep) = scattered(&r, &segs, mode);
        assert_eq!(
            bits(&got.logits),
            bits(&want.logits),
            "max |Δ| {}",
            max_abs_diff(&got.logits, &want.logits)
        );
        assert_eq!(got.stats, want.stats);
        assert_eq!(want.stats.misses, 5);
        assert_eq!(rep.segments, 5, "{rep:?}");
        assert_eq!(rep.recomputed + rep.corrupt + rep.reassigned, 0, "{rep:?}");
        assert_eq!(rep.workers.iter().map(|w| w.segments).sum::<usize>(), 5);
        assert_eq!(rep.workers.len(), 2, "LPT uses both workers: {rep:?}");
        assert!(rep.workers.iter().all(|w| w.transport == "peer"), "{rep:?}");
        drained(&r.scatter);
        assert_eq!(r.combiner.public_usage(), single.public_usage());
        println!(
            "  cold: 5 segments over 2 peer workers on GPU 0, logits bit-identical, stats equal; transfer {:.2} ms (copies + checksums)",
            rep.transfer_ms
        );
        // Reordered: hits, nothing to scatter.
        let again = reordered(&segs);
        let want2 = single.run(&again, mode, "tenant").unwrap();
        assert!(cold(&r.combiner, &again, mode).is_empty());
        let (got2, rep2) = scattered(&r, &again, mode);
        assert_eq!(bits(&got2.logits), bits(&want2.logits));
        assert_eq!(got2.stats, want2.stats);
        assert_eq!(rep2, ScatterReport::default());
        drained(&r.scatter);
        assert_eq!(r.combiner.public_usage(), single.public_usage());
        let m = r.scatter.metrics();
        assert_eq!(m.segments, 5);
        assert!(m.workers.iter().all(|w| w.transport == "peer"), "{m:?}");
        assert!(
            m.workers.iter().map(|w| w.segments).sum::<u64>() == 5,
            "{m:?}"
        );
        println!("  reordered: every document a hit, nothing scattered, logits bit-identical");
    }

    /// A device entry damaged after the copy is refused by the receiver's checksum
    /// (counted as corrupt, as a bad TCP frame) and recomputed: the answer and the
    /// statistics are one engine's, nothing leaks.
    #[test]
    fn peer_corrupt_device_entry_is_recomputed() {
        let _l = lock();
        let t = "peer_corrupt_device_entry_is_recomputed";
        let mode = Mode::hypic_default();
        let segs = request();
        let single = engine(t, 0);
        let want = single.run(&segs, mode, "tenant").unwrap();
        let (r, _) = rig(t, 0, &[0]);
        r.workers[0].set_faults(Faults {
            corrupt: Some(0),
            ..Faults::default()
        });
        let (got, rep) = scattered(&r, &segs, mode);
        assert_eq!(
            bits(&got.logits),
            bits(&want.logits),
            "max |Δ| {}",
            max_abs_diff(&got.logits, &want.logits)
        );
        assert_eq!(got.stats, want.stats);
        assert_eq!(rep.corrupt, 1, "{rep:?}");
        // The only worker is not trusted after a bad entry: the rest is built here.
        assert!(rep.recomputed >= 1, "{rep:?}");
        drained(&r.scatter);
        assert_eq!(r.combiner.public_usage(), single.public_usage());
        assert_eq!(r.scatter.metrics().corrupt, 1);
        println!(
            "  a damaged device entry: refused by the checksum, {} segment(s) recomputed, logits bit-identical",
            rep.recomputed
        );
    }

    /// With two GPUs: a worker on GPU 1 ships to a combiner on GPU 0 by
    /// `cuMemcpyPeerAsync` (direct or staged), with the same answer as one engine.
    #[test]
    fn peer_across_two_gpus_matches_single_engine() {
        let _l = lock();
        let t = "peer_across_two_gpus_matches_single_engine";
        let n = device_count();
        if n < 2 {
            println!("  {t}: skipped: needs 2 GPUs ({n} present)");
            return;
        }
        let mode = Mode::hypic_default();
        let segs = request();
        let single = engine(t, 0);
        let want = single.run(&segs, mode, "tenant").unwrap();
        let (r, paths) = rig(t, 0, &[1]);
        let (got, rep) = scattered(&r, &segs, mode);
        assert_eq!(
            bits(&got.logits),
            bits(&want.logits),
            "max |Δ| {}",
            max_abs_diff(&got.logits, &want.logits)
        );
        assert_eq!(got.stats, want.stats);
        assert_eq!(rep.recomputed + rep.corrupt + rep.reassigned, 0, "{rep:?}");
        drained(&r.scatter);
        assert_eq!(r.combiner.public_usage(), single.public_usage());
        println!(
            "  GPU 1 → GPU 0 ({}): 5 segments, logits bit-identical, transfer {:.2} ms",
            paths[0].describe(),
            rep.transfer_ms
        );
    }

    /// A combiner on GPU `at` over a TCP worker in this process on GPU `on` that
    /// takes NCCL offers; the scatter and the transport's kind.
    fn nccl_rig(test: &str, at: usize, on: usize) -> (Arc<Engine>, Arc<Scatter>) {
        let combiner = engine(test, at);
        let w = engine(test, on);
        let fp = w.model_fingerprint();
        let sender: Arc<dyn NcclJoin<GpuBackend<f32>>> =
            Arc::new(NcclSender::<f32>::new(w.model().gpu().clone(), fp));
        let worker = Arc::new(Worker::new(w));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || serve_tcp_with(listener, worker, 8, Some(sender), None));
        let link = Arc::new(NcclReceiver::<f32>::new(
            combiner.model().gpu().clone(),
            host_model().config.clone(),
        ));
        let t = Tcp::new(&addr, DEFAULT_MAX_FRAME).with_nccl(link);
        assert_eq!(t.kind(), "nccl");
        let cfg = ScatterConfig {
            floor: Duration::from_secs(120),
            ..ScatterConfig::default()
        };
        let scatter = Scatter::new(vec![Box::new(t)], combiner.model_fingerprint(), cfg);
        assert_eq!(scatter.check_health(), 1, "the TCP worker is up");
        scatter.set_tokens_per_s(0, 1e6);
        (combiner, scatter)
    }

    fn nccl_case(test: &str, at: usize, on: usize) -> ScatterReport {
        let mode = Mode::hypic_default();
        let segs = request();
        let single = engine(test, at);
        let want = single.run(&segs, mode, "tenant").unwrap();
        let (combiner, scatter) = nccl_rig(test, at, on);
        let r = Rig {
            combiner,
            scatter,
            workers: vec![],
        };
        let (got, rep) = scattered(&r, &segs, mode);
        assert_eq!(
            bits(&got.logits),
            bits(&want.logits),
            "max |Δ| {}",
            max_abs_diff(&got.logits, &want.logits)
        );
        assert_eq!(got.stats, want.stats);
        assert_eq!(rep.recomputed + rep.corrupt + rep.reassigned, 0, "{rep:?}");
        assert_eq!(rep.workers.iter().map(|w| w.segments).sum::<usize>(), 5);
        assert!(rep.workers.iter().all(|w| w.transport == "nccl"), "{rep:?}");
        drained(&r.scatter);
        assert_eq!(r.combiner.public_usage(), single.public_usage());
        rep
    }

    /// With two GPUs: a worker on GPU 1 (served over TCP, NCCL offered) ships its
    /// entries' payloads to the combiner on GPU 0 by ncclSend/ncclRecv; the answer
    /// is one engine's, bit for bit.
    #[test]
    fn nccl_across_two_gpus_matches_single_engine() {
        let _l = lock();
        let t = "nccl_across_two_gpus_matches_single_engine";
        let n = device_count();
        if n < 2 {
            println!("  {t}: skipped: needs 2 GPUs ({n} present)");
            return;
        }
        assert!(
            nccl_present(),
            "{t}: libnccl could not be loaded (set LD_LIBRARY_PATH to the nvidia-nccl wheel's lib)"
        );
        let rep = nccl_case(t, 0, 1);
        println!(
            "  GPU 1 → GPU 0 by NCCL: 5 segments, logits bit-identical, transfer {:.2} ms",
            rep.transfer_ms
        );
    }

    /// On one GPU both NCCL ranks would sit on GPU 0, which NCCL refuses: both
    /// sides fall back to wire frames over TCP for the task (or the offer is never
    /// made without libnccl), and the answer is one engine's.
    #[test]
    fn nccl_on_one_gpu_falls_back_to_tcp() {
        let _l = lock();
        let t = "nccl_on_one_gpu_falls_back_to_tcp";
        let rep = nccl_case(t, 0, 0);
        println!(
            "  NCCL offered with both ranks on GPU 0 (libnccl {}): fell back to TCP, 5 segments, logits bit-identical, transfer {:.2} ms",
            if nccl_present() { "loaded" } else { "absent" },
            rep.transfer_ms
        );
    }
}
