//! The one way every command builds its PIC engine and the scheduler over it:
//! `hypic serve`, `hypic generate`, `hypic eval` and the in-process `hypic bench`
//! all pick the backend with [`select_device`] (`--device` / `--dtype`), open the
//! weights with [`open_model`] ([`ModelSource`]: on the host, or streamed from the
//! checkpoint to the GPU), build the engine with [`start`] (the CPU
//! [`PicEngine`] or, in a binary built with the `cuda` feature, the GPU
//! `GpuPicEngine`, with the given pool sizes) and submit every request to its
//! [`Scheduler`].
//!
//! [`open`] is that sequence for the offline commands; [`Runtime::generate`] is a
//! blocking, streaming generation through the scheduler (`hypic generate`).
use anyhow::{bail, Context};
use dataplane::config::ModelConfig;
use dataplane::engine::{BackendInfo, Engine, EnginePools};
use dataplane::model::Model;
use dataplane::pic::{Mode, PicEngine, PicStats, SegmentRef};
use dataplane::sampling::SamplingParams;
use dataplane::scheduler::{FinishReason, GenEvent, GenRequest, Scheduler, SchedulerConfig};
use dataplane::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{select_device, Device, DeviceArg, DtypeArg};

/// The bundled default model folder (`models/hypic-tiny`, relative to the working
/// directory or to the repository the binary was built from).
pub fn default_model_dir() -> Option<PathBuf> {
    let rel = Path::new("models/hypic-tiny");
    [
        PathBuf::from(rel),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel),
    ]
    .into_iter()
    .find(|p| p.join("config.json").exists())
}

/// A per-layer loading bar for `dir` (drawn on a terminal only).
pub(crate) fn progress_bar(dir: &Path) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(1);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "loading {msg} [{bar:30}] {pos}/{len} layers ({elapsed})",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(dir.display().to_string());
    bar
}

/// Loads model and tokenizer (with a progress bar on a terminal).
pub fn load_model(dir: &Path) -> anyhow::Result<(Model, Tokenizer)> {
    let bar = progress_bar(dir);
    let model = Model::load(dir, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("loading model from {}", dir.display()))?;
    bar.finish_and_clear();
    let tok = Tokenizer::from_dir(dir)
        .with_context(|| format!("loading tokenizer from {}", dir.display()))?;
    Ok((model, tok))
}

/// Where the served weights come from.
pub enum ModelSource {
    /// A model already loaded on the host (the CPU backend serves it; the CUDA
    /// backend uploads it, converted to `--dtype`).
    Host(Model),
    /// A checkpoint folder: the CPU backend loads it with [`Model::load`]; the CUDA
    /// backend streams it to the device tensor by tensor in its stored dtype
    /// (`GpuModel::load`), with no host copy of the model.
    Checkpoint {
        /// The folder (config.json + safetensors).
        dir: PathBuf,
        /// Its parsed config.json.
        config: ModelConfig,
    },
    /// Deterministic random weights of `config` ([`Model::random`] on the CPU,
    /// `GpuModel::random` generated on the device).
    Random {
        /// The shape.
        config: ModelConfig,
        /// Generator seed.
        seed: u64,
    },
}

impl From<Model> for ModelSource {
    fn from(m: Model) -> Self {
        ModelSource::Host(m)
    }
}

impl ModelSource {
    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        match self {
            ModelSource::Host(m) => &m.config,
            ModelSource::Checkpoint { config, .. } | ModelSource::Random { config, .. } => config,
        }
    }

    /// The model on the host: as is, loaded from the folder, or generated.
    ///
    /// Errors: as [`load_model`].
    pub fn into_host(self) -> anyhow::Result<Model> {
        Ok(match self {
            ModelSource::Host(m) => m,
            ModelSource::Checkpoint { dir, .. } => load_model(&dir)?.0,
            ModelSource::Random { config, seed } => Model::random(config, seed),
        })
    }
}

/// Opens the model of `dir` for serving: the tokenizer and config, and the weights
/// as `cfg.random_weights` and the backend want them (`on_gpu`: left in the folder
/// for the streaming GPU loader; otherwise loaded on the host now).
///
/// Errors: unreadable config, tokenizer or weights.
pub fn open_model(
    dir: &Path,
    on_gpu: bool,
    random_weights: Option<u64>,
) -> anyhow::Result<(ModelSource, Tokenizer)> {
    if random_weights.is_none() && !on_gpu {
        let (m, tok) = load_model(dir)?;
        return Ok((ModelSource::Host(m), tok));
    }
    let config = ModelConfig::from_dir(dir)
        .with_context(|| format!("reading the model config in {}", dir.display()))?;
    let tok = Tokenizer::from_dir(dir)
        .with_context(|| format!("loading tokenizer from {}", dir.display()))?;
    let src = match random_weights {
        Some(seed) => ModelSource::Random { config, seed },
        None => ModelSource::Checkpoint {
            dir: dir.to_path_buf(),
            config,
        },
    };
    Ok((src, tok))
}

/// The weights of `source` on `gpu` in element type `$t`: uploaded (host model),
/// streamed from the checkpoint (logging tensors, bytes, seconds and GB/s), or
/// generated. A macro because the `GpuModel` bound names cuBLAS types.
#[cfg(feature = "cuda")]
macro_rules! gpu_model {
    ($t:ty, $gpu:expr, $source:expr) => {{
        use dataplane::cuda::model::GpuModel;
        let gpu = $gpu;
        match $source {
            $crate::runtime::ModelSource::Host(m) => GpuModel::<$t>::upload(gpu.clone(), &m)
                .context("uploading the weights to the GPU")?,
            $crate::runtime::ModelSource::Checkpoint { dir, config } => {
                let ckpt = dataplane::weights::Checkpoint::open(&dir)
                    .with_context(|| format!("opening the checkpoint in {}", dir.display()))?;
                let bar = $crate::runtime::progress_bar(&dir);
                let (m, st) =
                    GpuModel::<$t>::load(gpu.clone(), config, &ckpt, &mut |done, total| {
                        bar.set_length(total as u64);
                        bar.set_position(done as u64);
                    })
                    .with_context(|| format!("loading {} to the GPU", dir.display()))?;
                bar.finish_and_clear();
                tracing::info!(
                    tensors = st.tensors,
                    bytes = st.bytes,
                    seconds = st.seconds,
                    gb_per_s = st.gb_per_s(),
                    "weights loaded to the GPU: {} tensors, {:.2} GB in {:.2} s ({:.2} GB/s)",
                    st.tensors,
                    st.bytes as f64 / 1e9,
                    st.seconds,
                    st.gb_per_s()
                );
                m
            }
            $crate::runtime::ModelSource::Random { config, seed } => {
                GpuModel::<$t>::random(gpu.clone(), config, seed)
                    .context("generating random weights on the GPU")?
            }
        }
    }};
}
#[cfg(feature = "cuda")]
pub(crate) use gpu_model;

/// Pool sizes of an engine, bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolSizes {
    /// Public pool (segment entries shared across requests).
    pub public_bytes: usize,
    /// Private pool (per-tenant prefix snapshots).
    pub private_bytes: usize,
    /// Host spill tier of each pool (0: none).
    pub spill_bytes: usize,
}

impl PoolSizes {
    /// The pools of the offline commands (`generate`, `eval`, in-process `bench`):
    /// `gib` GiB for each pool, no spill tier.
    pub fn offline(gib: usize) -> Self {
        PoolSizes {
            public_bytes: gib << 30,
            private_bytes: gib << 30,
            spill_bytes: 0,
        }
    }
}

/// A PIC engine and the scheduler over it (see the module docs).
pub struct Runtime {
    /// The engine's pools and model configuration.
    pub engine: Arc<dyn EnginePools>,
    /// The scheduler every request goes through.
    pub sched: Arc<Scheduler>,
    /// Which backend serves.
    pub backend: BackendInfo,
}

/// Gives `engine` its spill tiers, lets `configure` set its pool policies, and
/// starts the scheduler over it.
fn wire<E: Engine + 'static>(
    engine: Arc<E>,
    pools: PoolSizes,
    sched: SchedulerConfig,
    configure: &dyn Fn(&dyn EnginePools),
) -> Runtime {
    engine.enable_spill(pools.spill_bytes, pools.spill_bytes);
    configure(&*engine);
    let backend = engine.backend();
    let sched = Arc::new(Scheduler::start(engine.clone(), sched));
    Runtime {
        engine,
        sched,
        backend,
    }
}

/// Builds the PIC engine of `model` on `device` (the weights on the GPU in `dtype`
/// for CUDA; the CPU backend is always fp32) with pools of `pools`, calls
/// `configure` on it (e.g. to set the public pool's policy) and starts the
/// scheduler over it with `sched`.
///
/// Errors: weights that cannot be loaded, uploaded or generated.
pub fn start(
    device: &Device,
    dtype: DtypeArg,
    model: ModelSource,
    model_id: &str,
    pools: PoolSizes,
    sched: SchedulerConfig,
    configure: &dyn Fn(&dyn EnginePools),
) -> anyhow::Result<Runtime> {
    let (public, private) = (pools.public_bytes, pools.private_bytes);
    match device {
        Device::Cpu => {
            let _ = dtype;
            let engine = PicEngine::new(Arc::new(model.into_host()?), model_id, public, private);
            Ok(wire(Arc::new(engine), pools, sched, configure))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => {
            use dataplane::cuda::pic::GpuPicEngine;
            Ok(match dtype {
                DtypeArg::F32 => {
                    let m = gpu_model!(f32, gpu, model);
                    let e = GpuPicEngine::new(Arc::new(m), model_id, public, private);
                    wire(Arc::new(e), pools, sched, configure)
                }
                DtypeArg::Bf16 => {
                    let m = gpu_model!(half::bf16, gpu, model);
                    let e = GpuPicEngine::new(Arc::new(m), model_id, public, private);
                    wire(Arc::new(e), pools, sched, configure)
                }
            })
        }
    }
}

/// The scheduler settings of the offline commands: one request at a time, no KV
/// budget to speak of (the request is refused only if it can never fit the device),
/// no queue timeout in practice, and each prompt processed in one step (as
/// [`dataplane::pic::Pic::run`] does, so offline results do not depend on a budget).
pub fn offline_scheduler() -> SchedulerConfig {
    SchedulerConfig {
        queue_capacity: 4,
        max_running: 1,
        kv_budget_bytes: usize::MAX / 4,
        queue_timeout: Duration::from_secs(24 * 3600),
        step_tokens: usize::MAX,
        prefill_chunk_tokens: usize::MAX,
        batch_prefills: true,
    }
}

/// The model folder of an offline command: `model`, else the bundled default.
///
/// Errors: no `model` and no bundled model.
pub fn model_dir(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match model.or_else(default_model_dir) {
        Some(d) => Ok(d),
        None => bail!("no --model given and no bundled model found at models/hypic-tiny"),
    }
}

/// The model id of a folder: its name (`hypic-tiny`).
pub fn model_id(dir: &Path) -> String {
    dir.canonicalize()
        .unwrap_or_else(|_| dir.to_path_buf())
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into())
}

/// The offline commands' start: resolves `--device` / `--dtype` first (so `--device
/// cuda` without CUDA fails before any weights are read; `auto` falls back to the
/// CPU with a line on stderr), opens the model of `dir`, and starts the engine and
/// scheduler. Returns them with the tokenizer.
///
/// Errors: as [`select_device`], [`open_model`] and [`start`].
pub fn open(
    dir: &Path,
    device: DeviceArg,
    dtype: DtypeArg,
    pools: PoolSizes,
    sched: SchedulerConfig,
) -> anyhow::Result<(Runtime, Tokenizer)> {
    let dev = select_device(device, dtype)?;
    let (model, tok) = open_model(dir, !matches!(dev, Device::Cpu), None)?;
    let rt = start(&dev, dtype, model, &model_id(dir), pools, sched, &|_| {})?;
    Ok((rt, tok))
}

/// What [`Runtime::generate`] produced.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated token ids (without the stop token).
    pub tokens: Vec<u32>,
    /// Why generation ended.
    pub reason: FinishReason,
    /// PIC statistics of the prefill.
    pub stats: PicStats,
    /// Submission to the first token.
    pub ttft: Duration,
    /// Decode steps run (each yields one token's logits, the stop token's included).
    pub decode_steps: usize,
    /// Wall time of the decode steps (first token to the end).
    pub decode_time: Duration,
}

impl Runtime {
    /// Generates from the prompt `ids` (one segment, full recompute) through the
    /// scheduler, calling `on_token` with each token as it arrives; stops at any of
    /// `stop` (not emitted) or after `max_tokens` tokens. Blocks the calling thread:
    /// call it outside an async runtime.
    ///
    /// Errors: an empty prompt, `max_tokens` 0 or a prompt over the context limit
    /// (the scheduler's refusal, as text), a device failure, or an error of
    /// `on_token`.
    pub fn generate(
        &self,
        ids: &[u32],
        sampling: SamplingParams,
        max_tokens: usize,
        stop: &[u32],
        on_token: &mut dyn FnMut(u32) -> anyhow::Result<()>,
    ) -> anyhow::Result<Generation> {
        let mut h = self
            .sched
            .submit(GenRequest {
                segments: vec![SegmentRef {
                    tokens: ids.to_vec(),
                    isolation: "generate".into(),
                }],
                mode: Mode::FullRecompute,
                tenant: "generate".into(),
                sampling,
                max_tokens,
                stop_token_ids: stop.to_vec(),
                top_logprobs: 0,
                logprobs: false,
                score: None,
            })
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let (mut stats, mut ttft) = (PicStats::default(), Duration::ZERO);
        let mut first = None;
        let mut tokens = vec![];
        loop {
            match h.events.blocking_recv() {
                Some(GenEvent::Started {
                    stats: s, ttft: t, ..
                }) => {
                    (stats, ttft) = (s, t);
                    first = Some(Instant::now());
                }
                Some(GenEvent::Scored { .. }) => {}
                Some(GenEvent::Token { id, .. }) => {
                    tokens.push(id);
                    on_token(id)?;
                }
                Some(GenEvent::Done { reason, .. }) => {
                    // Every token after the first took a decode step, and so did a
                    // stop token.
                    let decode_steps = match reason {
                        FinishReason::Stop => tokens.len(),
                        _ => tokens.len().saturating_sub(1),
                    };
                    return Ok(Generation {
                        tokens,
                        reason,
                        stats,
                        ttft,
                        decode_steps,
                        decode_time: first.map_or(Duration::ZERO, |t| t.elapsed()),
                    });
                }
                Some(GenEvent::Error { message, .. }) => bail!("generation failed: {message}"),
                None => bail!("the scheduler dropped the request"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::model::Logits;
    use dataplane::sampling::{argmax, Sampler};

    fn tiny() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/hypic-tiny")
    }

    fn cpu_runtime(dir: &Path) -> (Runtime, Tokenizer) {
        open(
            dir,
            DeviceArg::Cpu,
            DtypeArg::F32,
            PoolSizes::offline(1),
            offline_scheduler(),
        )
        .unwrap()
    }

    /// The reference `hypic generate` loop before it went through the scheduler:
    /// prefill, then one `Model::decode` per token, sampling with one [`Sampler`].
    fn direct(model: &Model, ids: &[u32], p: SamplingParams, max: usize, stop: &[u32]) -> Vec<u32> {
        let mut sampler = Sampler::new(p);
        let mut state = model.new_state();
        let logits = model.prefill(ids, &mut state, Logits::Last).unwrap().logits;
        let mut next = sampler.sample(&logits);
        let mut out = vec![];
        while out.len() < max && !stop.contains(&next) {
            out.push(next);
            if out.len() == max {
                break;
            }
            next = sampler.sample(&model.decode(next, &mut state).unwrap());
        }
        out
    }

    /// `hypic generate` through the engine and scheduler yields the tokens of the
    /// direct prefill + decode loop on the bundled model: greedy (to the end-of-turn
    /// token and to the length limit) and seeded sampling; tokens stream to the
    /// callback in order.
    #[test]
    fn generation_through_the_scheduler_equals_a_direct_greedy_loop() {
        let dir = tiny();
        let (rt, tok) = cpu_runtime(&dir);
        assert_eq!(rt.backend.describe, "cpu");
        let (model, _) = load_model(&dir).unwrap();
        let prompt = tok
            .apply_chat_template(
                &[dataplane::tokenizer::ChatMessage {
                    role: "user".into(),
                    content: "Where is the Eiffel Tower?".into(),
                }],
                true,
            )
            .unwrap();
        let ids = tok.encode(&prompt).unwrap();
        let seeded = SamplingParams {
            temperature: 0.9,
            top_k: 40,
            seed: Some(7),
            ..Default::default()
        };
        let mut ended_by_stop = false;
        for (params, max) in [
            (SamplingParams::default(), 64),
            (SamplingParams::default(), 5),
            (seeded, 24),
        ] {
            let want = direct(&model, &ids, params.clone(), max, &tok.eos_ids);
            assert!(!want.is_empty());
            let mut streamed = vec![];
            let g = rt
                .generate(&ids, params.clone(), max, &tok.eos_ids, &mut |id| {
                    streamed.push(id);
                    Ok(())
                })
                .unwrap();
            assert_eq!(g.tokens, want, "{params:?} max {max}");
            assert_eq!(streamed, want);
            assert_eq!(g.stats.tokens_computed, ids.len());
            let (reason, steps) = if want.len() < max {
                ended_by_stop = true;
                (FinishReason::Stop, want.len())
            } else {
                (FinishReason::Length, want.len() - 1)
            };
            assert_eq!((g.reason, g.decode_steps), (reason, steps), "{params:?}");
        }
        assert!(
            ended_by_stop,
            "greedy reply of the bundled model reaches <|im_end|>"
        );
        // The greedy first token is the prompt's argmax.
        let mut st = model.new_state();
        let l = model.prefill(&ids, &mut st, Logits::Last).unwrap().logits;
        let g = rt
            .generate(&ids, SamplingParams::default(), 1, &[], &mut |_| Ok(()))
            .unwrap();
        assert_eq!(g.tokens, vec![argmax(&l)]);
        assert_eq!(g.decode_steps, 0);
    }

    #[test]
    fn bad_generation_requests_are_clear_errors() {
        let (rt, _) = cpu_runtime(&tiny());
        let e = rt
            .generate(&[1, 2], SamplingParams::default(), 0, &[], &mut |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_tokens"), "{e}");
        let e = rt
            .generate(
                &[1, u32::MAX],
                SamplingParams::default(),
                2,
                &[],
                &mut |_| Ok(()),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");
    }

    /// `--device cuda` in a build without CUDA is the clear startup error of `serve`,
    /// before any weights are read; `auto` falls back to the CPU.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error_and_auto_falls_back() {
        let missing = Path::new("/nonexistent/model");
        let err = open(
            missing,
            DeviceArg::Cuda,
            DtypeArg::F32,
            PoolSizes::offline(1),
            offline_scheduler(),
        )
        .err()
        .expect("cuda must fail without the feature")
        .to_string();
        assert!(
            err.contains("without CUDA support") && err.contains("--device cpu"),
            "{err}"
        );
        let (rt, _) = open(
            &tiny(),
            DeviceArg::Auto,
            DtypeArg::Bf16,
            PoolSizes::offline(1),
            offline_scheduler(),
        )
        .unwrap();
        assert_eq!(rt.backend, BackendInfo::cpu());
    }
}
