//! CPU benchmark of the data plane's reference backend: prefill tokens/s and greedy
//! decode tokens/s for one model folder.
//!
//! ```text
//! cargo run --release -p hypic-dataplane --example bench_model -- \
//!     --model DIR --prompt-len 128 --decode-tokens 32 --repeats 5 [--warmup 1] [--seed 0] [--threads N]
//! ```
//!
//! Each repeat starts from a fresh state, prefills `prompt-len` pseudo-random token ids
//! (`Logits::Last`), then decodes `decode-tokens` tokens greedily one at a time. The JSON
//! on stdout reports the median over repeats (plus every sample). Prompt ids come from
//! SplitMix64 seeded with `--seed` (ids = next() % vocab), the same generator as
//! `tools/bench_hf_cpu.py`, so both benchmarks see the same prompt and their greedy
//! continuations can be compared.
use dataplane::model::{Logits, Model};
use dataplane::sampling::argmax;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::time::Instant;

struct Args {
    model: PathBuf,
    prompt_len: usize,
    decode_tokens: usize,
    repeats: usize,
    warmup: usize,
    seed: u64,
    threads: Option<usize>,
}

const USAGE: &str = "usage: bench_model --model DIR [--prompt-len N=128] [--decode-tokens M=32] \
[--repeats R=5] [--warmup W=1] [--seed S=0] [--threads T]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        model: PathBuf::new(),
        prompt_len: 128,
        decode_tokens: 32,
        repeats: 5,
        warmup: 1,
        seed: 0,
        threads: None,
    };
    let mut have_model = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let val = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let num = |v: &str| -> Result<usize, String> {
            v.parse::<usize>()
                .map_err(|e| format!("{flag}: {v:?} is not a non-negative integer: {e}"))
        };
        match flag.as_str() {
            "--model" => {
                a.model = PathBuf::from(&val);
                have_model = true;
            }
            "--prompt-len" => a.prompt_len = num(&val)?,
            "--decode-tokens" => a.decode_tokens = num(&val)?,
            "--repeats" => a.repeats = num(&val)?,
            "--warmup" => a.warmup = num(&val)?,
            "--seed" => a.seed = num(&val)? as u64,
            "--threads" => a.threads = Some(num(&val)?),
            _ => return Err(format!("unknown argument {flag:?}\n{USAGE}")),
        }
    }
    if !have_model {
        return Err(format!("--model is required\n{USAGE}"));
    }
    if a.prompt_len == 0 || a.repeats == 0 {
        return Err("--prompt-len and --repeats must be at least 1".into());
    }
    Ok(a)
}

/// SplitMix64 (Steele et al.), shared with tools/bench_hf_cpu.py.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn prompt_ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = SplitMix64(seed);
    (0..n).map(|_| (rng.next() % vocab as u64) as u32).collect()
}

/// Total parameter count from the safetensors headers in `dir` (no tensor data read).
fn count_params(dir: &Path) -> Option<u64> {
    let mut total = 0u64;
    let mut any = false;
    for e in std::fs::read_dir(dir).ok()? {
        let p = e.ok()?.path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let name = p.file_name()?.to_string_lossy().to_string();
        if name.starts_with("golden") {
            continue; // test fixtures, not weights
        }
        use std::io::Read;
        let mut f = std::fs::File::open(&p).ok()?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).ok()?;
        let mut hdr = vec![0u8; u64::from_le_bytes(len) as usize];
        f.read_exact(&mut hdr).ok()?;
        let v: serde_json::Value = serde_json::from_slice(&hdr).ok()?;
        for (k, t) in v.as_object()? {
            if k == "__metadata__" || k.contains("visual") {
                continue; // vision tower of the Qwen3.5 wrappers is not run
            }
            let shape = t.get("shape")?.as_array()?;
            total += shape
                .iter()
                .map(|d| d.as_u64().unwrap_or(0))
                .product::<u64>();
            any = true;
        }
    }
    any.then_some(total)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// CPU time of this process so far (every thread), in seconds, from
/// `/proc/self/task/*/schedstat` (nanoseconds on a CPU); 0 where that is unreadable.
/// On a shared machine wall time depends on the other load; CPU time much less so.
fn cpu_s() -> f64 {
    let Ok(rd) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let ns: u64 = rd
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 * 1e-9
}

/// The 1-minute load average (`/proc/loadavg`).
fn loadavg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

struct Sample {
    prefill_s: f64,
    decode_s: f64,
    prefill_cpu_s: f64,
    decode_cpu_s: f64,
    tokens: Vec<u32>,
}

fn run_once(model: &Model, ids: &[u32], decode_tokens: usize) -> anyhow::Result<Sample> {
    let mut state = model.new_state();
    let (c0, t0) = (cpu_s(), Instant::now());
    let out = model.prefill(ids, &mut state, Logits::Last)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let c1 = cpu_s();
    let mut tok = argmax(&out.logits);
    let mut tokens = vec![tok];
    let t1 = Instant::now();
    for _ in 0..decode_tokens {
        let logits = model.decode(tok, &mut state)?;
        tok = argmax(&logits);
        tokens.push(tok);
    }
    let decode_s = t1.elapsed().as_secs_f64();
    Ok(Sample {
        prefill_s,
        decode_s,
        prefill_cpu_s: c1 - c0,
        decode_cpu_s: cpu_s() - c1,
        tokens,
    })
}

fn main() -> anyhow::Result<()> {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()?;
    }
    let style = ProgressStyle::with_template("{msg:>10} [{bar:30}] {pos}/{len} {elapsed}")
        .expect("static template")
        .progress_chars("=> ");

    let load_bar = ProgressBar::new(1)
        .with_style(style.clone())
        .with_message("load");
    let t_load = Instant::now();
    let model = Model::load(&args.model, &mut |done, total| {
        load_bar.set_length(total as u64);
        load_bar.set_position(done as u64);
    })?;
    load_bar.finish_and_clear();
    let load_s = t_load.elapsed().as_secs_f64();

    let c = &model.config;
    let ids = prompt_ids(args.seed, args.prompt_len, c.vocab_size);

    let load_before = loadavg();
    let bar = ProgressBar::new((args.warmup + args.repeats) as u64)
        .with_style(style)
        .with_message(format!("T={}", args.prompt_len));
    for _ in 0..args.warmup {
        run_once(&model, &ids, args.decode_tokens)?;
        bar.inc(1);
    }
    let mut samples = Vec::with_capacity(args.repeats);
    for _ in 0..args.repeats {
        samples.push(run_once(&model, &ids, args.decode_tokens)?);
        bar.inc(1);
    }
    bar.finish_and_clear();

    let prefill: Vec<f64> = samples
        .iter()
        .map(|s| args.prompt_len as f64 / s.prefill_s)
        .collect();
    let decode: Vec<f64> = samples
        .iter()
        .map(|s| args.decode_tokens as f64 / s.decode_s)
        .collect();
    let threads = rayon::current_num_threads();
    let m = args.decode_tokens as f64;
    let med = |f: &dyn Fn(&Sample) -> f64| median(&samples.iter().map(f).collect::<Vec<_>>());
    let report = serde_json::json!({
        "impl": "hypic-dataplane (CPU reference backend, fp32)",
        "model": args.model.display().to_string(),
        "model_type": c.model_type,
        "params": count_params(&args.model),
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
        "vocab_size": c.vocab_size,
        "prompt_len": args.prompt_len,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "seed": args.seed,
        "threads": threads,
        "load_s": load_s,
        "prefill_tok_s": median(&prefill),
        "decode_tok_s": if args.decode_tokens > 0 { median(&decode) } else { f64::NAN },
        "prefill_ms": median(&samples.iter().map(|s| s.prefill_s * 1e3).collect::<Vec<_>>()),
        "decode_ms_per_tok": if args.decode_tokens > 0 {
            median(&samples.iter().map(|s| s.decode_s * 1e3 / args.decode_tokens as f64).collect::<Vec<_>>())
        } else { f64::NAN },
        "prefill_cpu_s": med(&|s| s.prefill_cpu_s),
        "decode_cpu_s_per_tok": if args.decode_tokens > 0 { med(&|s| s.decode_cpu_s / m) } else { f64::NAN },
        "prefill_tok_per_cpu_s": med(&|s| args.prompt_len as f64 / s.prefill_cpu_s),
        "decode_tok_per_cpu_s": if args.decode_tokens > 0 { med(&|s| m / s.decode_cpu_s) } else { f64::NAN },
        "cpu_util": samples.iter().map(|s| s.prefill_cpu_s + s.decode_cpu_s).sum::<f64>()
            / samples.iter().map(|s| s.prefill_s + s.decode_s).sum::<f64>(),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "prefill_tok_s_samples": prefill,
        "decode_tok_s_samples": decode,
        "greedy_tokens": samples.last().map(|s| s.tokens.clone()).unwrap_or_default(),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
