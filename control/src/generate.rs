//! `hypic generate`: load a model, prefill a prompt, stream a continuation, all
//! through the engine and scheduler of `hypic serve`.
use anyhow::{bail, Result};
use dataplane::sampling::SamplingParams;
use dataplane::tokenizer::{ChatMessage, DecodeStream, Tokenizer};
pub use hypic_control::backend::{DeviceArg, DtypeArg};
use hypic_control::runtime::{self, PoolSizes};
use std::io::Write;
use std::path::PathBuf;

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

/// Runs `hypic generate`: the prompt as one segment through the engine and
/// scheduler `hypic serve` uses ([`hypic_control::runtime`]), on the backend
/// `--device` / `--dtype` pick.
pub fn run(a: GenerateArgs) -> Result<()> {
    let dir = runtime::model_dir(a.model.clone())?;
    if a.prompt.is_empty() {
        bail!("empty prompt: pass some text with --prompt");
    }
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let (rt, tok) = runtime::open(
        &dir,
        a.device,
        a.dtype,
        PoolSizes::offline(1),
        runtime::offline_scheduler(),
    )?;
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
    let sampling = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        ..Default::default()
    };
    eprintln!("backend: {}", rt.backend.describe);
    let mut printer = Printer::default();
    let stdout = std::io::stdout();
    let g = rt.generate(&ids, sampling, a.max_tokens, &tok.eos_ids, &mut |id| {
        printer.token(&tok, id, &mut stdout.lock())
    })?;
    printer.finish(&tok, &mut stdout.lock())?;
    let dt = g.decode_time.as_secs_f64();
    println!();
    eprintln!(
        "prompt {} tokens, generated {} tokens | TTFT {:.1} ms | decode {:.1} tokens/s",
        ids.len(),
        g.tokens.len(),
        g.ttft.as_secs_f64() * 1e3,
        if dt > 0.0 {
            g.decode_steps as f64 / dt
        } else {
            0.0
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

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
}
