//! `hypic generate`: load a model, prefill a prompt, stream a continuation.
use anyhow::{bail, Context, Result};
use dataplane::model::{Logits, Model};
use dataplane::sampling::{Sampler, SamplingParams};
use dataplane::tokenizer::{ChatMessage, Tokenizer};
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
    });
    let mut state = model.new_state();
    let t0 = Instant::now();
    let out = model.prefill(&ids, &mut state, Logits::Last)?;
    let mut next = sampler.sample(&out.logits);
    let ttft = t0.elapsed();
    let mut generated = vec![];
    let mut printed = String::new();
    let stdout = std::io::stdout();
    let t1 = Instant::now();
    let mut decode_steps = 0usize;
    while generated.len() < a.max_tokens && !tok.eos_ids.contains(&next) {
        generated.push(next);
        let text = tok.decode(&generated)?;
        if let Some(delta) = text.strip_prefix(printed.as_str()) {
            let mut lock = stdout.lock();
            write!(lock, "{delta}")?;
            lock.flush()?;
            printed = text;
        }
        if generated.len() == a.max_tokens {
            break;
        }
        let logits = model.decode(next, &mut state)?;
        decode_steps += 1;
        next = sampler.sample(&logits);
    }
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
