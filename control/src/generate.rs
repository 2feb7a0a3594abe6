//! `hypic generate`: load a model, prefill a prompt, stream a continuation.
use anyhow::{bail, Context, Result};
use dataplane::model::{Logits, Model};
use dataplane::sampling::{Sampler, SamplingParams};
use dataplane::state::ModelState;
use dataplane::tokenizer::{ChatMessage, DecodeStream, Tokenizer};
use hypic_control::backend::{select_device, Device};
pub use hypic_control::backend::{DeviceArg, DtypeArg};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Arguments of `hypic generate`.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// Hugging Face model folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "HYPIC_MODEL")]
    pub model: Option<PathBuf>,
    /// Prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k filter (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Top-p (nucleus) filter.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// RNG seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Backend: `cpu` (the reference), `cuda` (GPU 0; an error when unusable) or
    /// `auto` (CUDA when a usable device and driver are found, else the CPU with a
    /// log line saying why). CUDA needs a binary built with `--features cuda`.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto, env = "HYPIC_DEVICE")]
    pub device: DeviceArg,
    /// Weight and activation type on the GPU backend: `f32` (same answers as the CPU
    /// backend to ~1e-6) or `bf16` (half the memory, fp32 accumulation and states).
    #[arg(long, value_enum, default_value_t = DtypeArg::F32, env = "HYPIC_DTYPE")]
    pub dtype: DtypeArg,
}

/// The backend a generation runs on: prefill and one-token decode with its state.
pub enum Runner<'a> {
    /// CPU reference backend.
    Cpu(&'a Model, ModelState),
    /// GPU, fp32.
    #[cfg(feature = "cuda")]
    GpuF32(
        dataplane::cuda::model::GpuModel<f32>,
        dataplane::cuda::model::GpuState<f32>,
    ),
    /// GPU, bf16.
    #[cfg(feature = "cuda")]
    GpuBf16(
        dataplane::cuda::model::GpuModel<half::bf16>,
        dataplane::cuda::model::GpuState<half::bf16>,
    ),
}

impl<'a> Runner<'a> {
    /// Picks the backend per `device` / `dtype` (uploading the weights for CUDA) and
    /// returns it with a one-line description for the log.
    ///
    /// Errors: `cuda` requested but not built in, or no usable device; upload failure.
    pub fn select(model: &'a Model, device: DeviceArg, dtype: DtypeArg) -> Result<(Self, String)> {
        let dev = select_device(device, dtype)?;
        let desc = dev.describe(dtype);
        match dev {
            Device::Cpu => Ok((Runner::Cpu(model, model.new_state()), desc)),
            #[cfg(feature = "cuda")]
            Device::Cuda(gpu) => {
                use dataplane::cuda::model::GpuModel;
                Ok(match dtype {
                    DtypeArg::F32 => {
                        let m =
                            GpuModel::<f32>::upload(gpu, model).context("uploading the weights")?;
                        let s = m.new_state()?;
                        (Runner::GpuF32(m, s), desc)
                    }
                    DtypeArg::Bf16 => {
                        let m = GpuModel::<half::bf16>::upload(gpu, model)
                            .context("uploading the weights")?;
                        let s = m.new_state()?;
                        (Runner::GpuBf16(m, s), desc)
                    }
                })
            }
        }
    }

    /// Prefills `ids` from the runner's state; returns the last token's logits.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        Ok(match self {
            Runner::Cpu(m, s) => m.prefill(ids, s, Logits::Last)?.logits,
            #[cfg(feature = "cuda")]
            Runner::GpuF32(m, s) => m.prefill(ids, s, Logits::Last)?,
            #[cfg(feature = "cuda")]
            Runner::GpuBf16(m, s) => m.prefill(ids, s, Logits::Last)?,
        })
    }

    /// Appends one token; returns the next-token logits.
    pub fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        Ok(match self {
            Runner::Cpu(m, s) => m.decode(token, s)?,
            #[cfg(feature = "cuda")]
            Runner::GpuF32(m, s) => m.decode(token, s)?,
            #[cfg(feature = "cuda")]
            Runner::GpuBf16(m, s) => m.decode(token, s)?,
        })
    }
}

/// The bundled default model folder, relative to the working directory or the
/// repository root the binary was built from.
pub fn default_model_dir() -> Option<PathBuf> {
    let rel = Path::new("models/hypic-tiny");
    [
        PathBuf::from(rel),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel),
    ]
    .into_iter()
    .find(|p| p.join("config.json").exists())
}

/// Loads model and tokenizer with a progress bar.
pub fn load(dir: &Path) -> Result<(Model, Tokenizer)> {
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers ({elapsed})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(dir.display().to_string());
    let model = Model::load(dir, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("loading model from {}", dir.display()))?;
    bar.finish_and_clear();
    let tok = Tokenizer::from_dir(dir)?;
    Ok((model, tok))
}

/// Prints generated text as its tokens arrive, through the windowed detokeniser
/// the server's streaming uses ([`DecodeStream`]): a character split across tokens
/// is printed once the token completing it arrives.
#[derive(Default)]
struct Printer {
    dec: DecodeStream,
}

impl Printer {
    /// Adds one token and writes the text it completes.
    fn token(&mut self, tok: &Tokenizer, id: u32, out: &mut impl Write) -> Result<()> {
        let delta = self.dec.step(tok, id)?;
        if !delta.is_empty() {
            write!(out, "{delta}")?;
            out.flush()?;
        }
        Ok(())
    }

    /// The sequence is over: writes what is held back (an incomplete last
    /// character as U+FFFD).
    fn finish(&mut self, tok: &Tokenizer, out: &mut impl Write) -> Result<()> {
        write!(out, "{}", self.dec.flush(tok)?)?;
        out.flush()?;
        Ok(())
    }
}

/// Runs `hypic generate`.
pub fn run(a: GenerateArgs) -> Result<()> {
    let dir = match a.model.clone().or_else(default_model_dir) {
        Some(d) => d,
        None => bail!("no --model given and no bundled model found at models/hypic-tiny"),
    };
    if a.prompt.is_empty() {
        bail!("empty prompt: pass some text with --prompt");
    }
    let (model, tok) = load(&dir)?;
    let text = if a.chat {
        tok.apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: a.prompt.clone(),
            }],
            true,
        )?
    } else {
        a.prompt.clone()
    };
    let ids = tok.encode(&text)?;
    if ids.is_empty() {
        bail!("the prompt encodes to zero tokens");
    }
    let mut sampler = Sampler::new(SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        ..Default::default()
    });
    let (mut runner, backend) = Runner::select(&model, a.device, a.dtype)?;
    eprintln!("backend: {backend}");
    let t0 = Instant::now();
    let logits = runner.prefill(&ids)?;
    let mut next = sampler.sample(&logits);
    let ttft = t0.elapsed();
    let mut generated = vec![];
    let mut printer = Printer::default();
    let stdout = std::io::stdout();
    let t1 = Instant::now();
    let mut decode_steps = 0usize;
    while generated.len() < a.max_tokens && !tok.eos_ids.contains(&next) {
        generated.push(next);
        printer.token(&tok, next, &mut stdout.lock())?;
        if generated.len() == a.max_tokens {
            break;
        }
        let logits = runner.decode(next)?;
        decode_steps += 1;
        next = sampler.sample(&logits);
    }
    printer.finish(&tok, &mut stdout.lock())?;
    let dt = t1.elapsed().as_secs_f64();
    println!();
    eprintln!(
        "prompt {} tokens, generated {} tokens | TTFT {:.1} ms | decode {:.1} tokens/s",
        ids.len(),
        generated.len(),
        ttft.as_secs_f64() * 1e3,
        if dt > 0.0 {
            decode_steps as f64 / dt
        } else {
            0.0
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden() -> Model {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../dataplane/tests/fixtures/golden/qwen3_next");
        Model::load(&dir, &mut |_, _| {}).expect("golden model")
    }

    #[test]
    fn cpu_runner_matches_the_model() {
        let m = golden();
        let (mut r, desc) = Runner::select(&m, DeviceArg::Cpu, DtypeArg::F32).unwrap();
        assert_eq!(desc, "cpu");
        let ids = [3u32, 17, 42, 5];
        let got = r.prefill(&ids).unwrap();
        let mut s = m.new_state();
        let want = m.prefill(&ids, &mut s, Logits::Last).unwrap().logits;
        assert_eq!(got, want);
        assert_eq!(r.decode(7).unwrap(), m.decode(7, &mut s).unwrap());
    }

    /// A character split across byte-level BPE tokens (CJK, emoji) does not stop
    /// the printing: everything after it is printed too.
    #[test]
    fn printing_goes_on_after_a_character_split_across_tokens() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/hypic-tiny");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let text = "你好，世界！🙂 then plain English 日本語 and more text.";
        let ids = tok.encode(text).unwrap();
        let mut p = Printer::default();
        let mut out = Vec::new();
        for &id in &ids {
            p.token(&tok, id, &mut out).unwrap();
        }
        p.finish(&tok, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), text);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error_and_auto_falls_back() {
        let m = golden();
        let err = Runner::select(&m, DeviceArg::Cuda, DtypeArg::F32)
            .err()
            .expect("cuda must fail without the feature")
            .to_string();
        assert!(err.contains("without CUDA support"), "{err}");
        let (_, desc) = Runner::select(&m, DeviceArg::Auto, DtypeArg::Bf16).unwrap();
        assert_eq!(desc, "cpu");
    }
}
