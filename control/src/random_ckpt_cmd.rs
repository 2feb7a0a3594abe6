//! `hypic random-checkpoint`: writes a random-weight checkpoint folder of any shape
//! (`dataplane::random_checkpoint`), whose weights equal `Model::random` /
//! `GpuModel::random` with the same seed, so `hypic serve --model DIR` serves the
//! same greedy output as `hypic serve --model DIR --random-weights SEED`.
use anyhow::{bail, Context};
use dataplane::config::ModelConfig;
use dataplane::random_checkpoint::{self as rc, LargeDtype};
use std::path::{Path, PathBuf};

/// Built-in shapes: (name, config.json text).
const SHAPES: &[(&str, &str)] = &[(
    "qwen3.5-35b-a3b",
    include_str!("../../benches/configs/qwen3_5_35b_a3b/config.json"),
)];

/// Arguments of `hypic random-checkpoint`.
#[derive(clap::Args, Debug)]
pub struct RandomCheckpointArgs {
    /// The shape: a config.json file, a folder holding one, or a built-in name
    /// (qwen3.5-35b-a3b: the Qwen3.5-35B-A3B text model).
    #[arg(long)]
    config: String,
    /// Output folder (created; existing files of the same names are overwritten).
    #[arg(long)]
    out: PathBuf,
    /// Generator seed (the `--random-weights` seed of `hypic serve`).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep only the first N decoder layers (to fit memory or disk).
    #[arg(long)]
    layers: Option<usize>,
    /// Element type of the large tensors: bf16 (as HF releases) or f32.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    dtype: String,
    /// Most tensor bytes per shard file, MiB (a larger single tensor gets its own shard).
    #[arg(long, default_value_t = 4096)]
    shard_mib: u64,
    /// Folder whose tokenizer files (tokenizer.json, tokenizer_config.json,
    /// generation_config.json) are copied so the folder can be served [default: the
    /// bundled models/hypic-tiny, when present].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

fn read_config(spec: &str) -> anyhow::Result<serde_json::Value> {
    let p = Path::new(spec);
    let text = if p.is_dir() {
        let f = p.join("config.json");
        std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?
    } else if p.is_file() {
        std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
    } else if let Some((_, t)) = SHAPES.iter().find(|(n, _)| *n == spec) {
        t.to_string()
    } else {
        let names: Vec<&str> = SHAPES.iter().map(|(n, _)| *n).collect();
        bail!(
            "--config {spec:?}: no such file or folder, and not a built-in shape ({})",
            names.join(", ")
        );
    };
    serde_json::from_str(&text).with_context(|| format!("parsing the config of {spec}"))
}

/// Runs the command.
pub fn run(a: RandomCheckpointArgs) -> anyhow::Result<()> {
    let mut json = read_config(&a.config)?;
    if let Some(n) = a.layers {
        json = rc::slice_layers(&json, n)?;
    }
    let c = ModelConfig::from_json(&json).context("the config")?;
    let large = if a.dtype == "f32" {
        LargeDtype::F32
    } else {
        LargeDtype::Bf16
    };
    let total = rc::total_bytes(&c, large);
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "writing {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    bar.set_message(a.out.display().to_string());
    let t0 = std::time::Instant::now();
    let w = rc::write(
        &c,
        &json,
        &a.out,
        a.seed,
        large,
        a.shard_mib << 20,
        &mut |done, _| bar.set_position(done),
    )
    .with_context(|| format!("writing {}", a.out.display()))?;
    bar.finish_and_clear();
    let tok_dir = a
        .tokenizer
        .clone()
        .or_else(hypic_control::serve::default_model_dir);
    let mut copied = vec![];
    if let Some(d) = &tok_dir {
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            let src = d.join(f);
            if src.exists() {
                std::fs::copy(&src, a.out.join(f))
                    .with_context(|| format!("copying {}", src.display()))?;
                copied.push(f);
            }
        }
    }
    println!(
        "wrote {} tensors, {:.2} GB in {} shard(s) (largest {:.2} GB) to {} in {:.1} s: {} layers, seed {}, {} large tensors",
        w.tensors,
        w.bytes as f64 / 1e9,
        w.files.len(),
        w.largest_shard as f64 / 1e9,
        a.out.display(),
        t0.elapsed().as_secs_f64(),
        c.num_layers,
        a.seed,
        a.dtype
    );
    match &tok_dir {
        Some(d) if !copied.is_empty() => {
            println!(
                "tokenizer files from {}: {}",
                d.display(),
                copied.join(", ")
            )
        }
        _ => println!("no tokenizer copied (pass --tokenizer DIR to serve the folder)"),
    }
    Ok(())
}
