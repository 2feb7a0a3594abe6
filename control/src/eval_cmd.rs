//! `hypic eval`: held-out multi-document QA through every PIC mode; writes a table
//! (Markdown + JSON) and a plot of quality against TTFT. Every request goes through
//! the engine and scheduler `hypic serve` uses, on the backend `--device` /
//! `--dtype` pick.
use anyhow::{bail, Context, Result};
use dataplane::eval::{evaluate_modes, load_items, merge_reports, ModeReport};
use dataplane::pic::Mode;
use hypic_control::backend::{DeviceArg, DtypeArg};
use hypic_control::runtime::{self, PoolSizes};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};

/// Arguments of `hypic eval`.
#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// Model folder (default: the bundled models/hypic-tiny).
    #[arg(long, env = "HYPIC_MODEL")]
    pub model: Option<PathBuf>,
    /// Held-out JSONL (default: MODEL/eval/heldout.jsonl).
    #[arg(long)]
    pub heldout: Option<PathBuf>,
    /// Skip the first N selected items (to split one held-out set into shards that
    /// run in parallel; combine their reports with `--merge`).
    #[arg(long, default_value_t = 0)]
    pub skip: usize,
    /// Evaluate only the first N items (after `--skip`).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Only single-hop (1) or two-hop (2) items.
    #[arg(long)]
    pub hop: Option<u8>,
    /// Modes, comma-separated: full, prefix, naive, hypicW (e.g. hypic8), hypicW-norope;
    /// `all` = full,prefix,naive,hypic0,1,2,4,8,16,32 and hypic8-norope.
    #[arg(long, default_value = "all")]
    pub modes: String,
    /// Maximum reply tokens (a two-hop reply names the bridge entity first, ≤ 20 tokens).
    #[arg(long, default_value_t = 24)]
    pub max_new_tokens: usize,
    /// Instead of evaluating, merge these `report.json` files of disjoint shards (see
    /// `--skip`) into one report in `--out`.
    #[arg(long, num_args = 1.., value_name = "REPORT_JSON")]
    pub merge: Vec<PathBuf>,
    /// Output folder for report.md, report.json and quality_vs_ttft.svg.
    #[arg(long, default_value = "eval-results")]
    pub out: PathBuf,
    /// No progress bar (it is drawn on stderr only when it is a terminal).
    #[arg(long, short)]
    pub quiet: bool,
    /// Backend: `cpu` (the reference), `cuda` (GPU 0; an error when unusable) or
    /// `auto` (CUDA when usable, else the CPU with a log line saying why), as for
    /// `hypic serve`.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto, env = "HYPIC_DEVICE")]
    pub device: DeviceArg,
    /// Weight and activation type on the GPU backend: `f32` or `bf16` (the CPU
    /// backend always runs f32).
    #[arg(long, value_enum, default_value_t = DtypeArg::F32, env = "HYPIC_DTYPE")]
    pub dtype: DtypeArg,
}

/// Parses the `--modes` list.
pub fn parse_modes(s: &str) -> Result<Vec<Mode>> {
    if s == "all" {
        let mut v = vec![Mode::FullRecompute, Mode::PrefixCache, Mode::NaiveAddition];
        v.extend([0, 1, 2, 4, 8, 16, 32].map(|w| Mode::Hypic {
            seam_width: w,
            rope_fix: true,
        }));
        v.push(Mode::Hypic {
            seam_width: 8,
            rope_fix: false,
        });
        return Ok(v);
    }
    s.split(',')
        .map(|m| {
            let m = m.trim();
            Ok(match m {
                "full" => Mode::FullRecompute,
                "prefix" => Mode::PrefixCache,
                "naive" => Mode::NaiveAddition,
                _ => {
                    let Some(rest) = m.strip_prefix("hypic") else {
                        bail!("unknown mode `{m}`")
                    };
                    let (w, rope_fix) = match rest.strip_suffix("-norope") {
                        Some(w) => (w, false),
                        None => (rest, true),
                    };
                    let seam_width = w.parse().with_context(|| format!("seam width in `{m}`"))?;
                    Mode::Hypic {
                        seam_width,
                        rope_fix,
                    }
                }
            })
        })
        .collect()
}

/// Runs `hypic eval`.
pub fn run(a: EvalArgs) -> Result<()> {
    if !a.merge.is_empty() {
        return merge(&a.merge, &a.out);
    }
    let dir = runtime::model_dir(a.model.clone())?;
    let heldout = a
        .heldout
        .clone()
        .unwrap_or_else(|| dir.join("eval/heldout.jsonl"));
    let mut items = load_items(&heldout)?;
    if let Some(h) = a.hop {
        items.retain(|i| i.hop == h);
    }
    if a.skip > 0 && a.skip >= items.len() {
        bail!(
            "--skip {} is past the end: {} has {} items{}",
            a.skip,
            heldout.display(),
            items.len(),
            a.hop.map_or(String::new(), |h| format!(" with --hop {h}"))
        );
    }
    items.drain(..a.skip.min(items.len()));
    if let Some(n) = a.limit {
        items.truncate(n);
    }
    if items.is_empty() {
        bail!("no held-out items selected from {}", heldout.display());
    }
    let modes = parse_modes(&a.modes)?;
    if a.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    let (rt, tok) = runtime::open(
        &dir,
        a.device,
        a.dtype,
        PoolSizes::offline(4),
        runtime::offline_scheduler(),
    )?;
    eprintln!("backend: {}", rt.backend.describe);
    let bar = ProgressBar::with_draw_target(
        Some(items.len() as u64),
        hypic_control::progress_target(a.quiet),
    );
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} items ({eta})")
            .expect("static")
            .progress_chars("=> "),
    );
    bar.set_message(format!("{} modes", modes.len()));
    let reports = evaluate_modes(
        &rt.sched,
        &tok,
        &items,
        &modes,
        a.max_new_tokens,
        &mut |i| bar.set_position(i as u64),
    )?;
    bar.finish_and_clear();
    for r in &reports {
        eprintln!(
            "{:>22}: EM single {:.3} two {:.3} | F1 single {:.3} two {:.3} | TTFT {:.1} ms",
            r.label, r.em_single, r.em_two, r.f1_single, r.f1_two, r.mean_ttft_ms
        );
    }
    let source = format!("{} (from item {})", heldout.display(), a.skip);
    write_reports(&reports, items.len(), &source, &a.out)
}

/// `hypic eval --merge`: combines shard reports (dataplane `merge_reports`).
fn merge(files: &[PathBuf], out: &Path) -> Result<()> {
    let mut shards = vec![];
    for f in files {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        let r: Vec<ModeReport> =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", f.display()))?;
        if r.is_empty() {
            bail!(
                "{} holds no mode reports: not a `hypic eval` report.json",
                f.display()
            );
        }
        shards.push(r);
    }
    let reports = merge_reports(&shards).with_context(|| {
        let names: Vec<String> = files
            .iter()
            .enumerate()
            .map(|(k, f)| format!("shard {k} = {}", f.display()))
            .collect();
        format!("merging {}", names.join(", "))
    })?;
    let n = reports.first().map_or(0, |r| r.n_single + r.n_two);
    let source = format!("{} merged shard reports", files.len());
    write_reports(&reports, n, &source, out)
}

fn write_reports(reports: &[ModeReport], n: usize, source: &str, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let md = table(reports, n, source);
    std::fs::write(out.join("report.md"), &md)?;
    std::fs::write(
        out.join("report.json"),
        serde_json::to_string_pretty(reports)?,
    )?;
    plot(reports, &out.join("quality_vs_ttft.svg"))?;
    println!("{md}");
    eprintln!("wrote {}", out.display());
    Ok(())
}

/// Markdown table of the reports.
pub fn table(reports: &[ModeReport], n: usize, source: &str) -> String {
    let mut s = format!(
        "Held-out QA ({} items from {}; {} single-hop, {} two-hop), greedy answers.\n\n",
        n,
        source,
        reports.first().map_or(0, |r| r.n_single),
        reports.first().map_or(0, |r| r.n_two)
    );
    s.push_str("| mode | EM single | F1 single | EM two-hop | F1 two-hop | answer NLL | first-token KL vs full | mean TTFT ms | TTFT speed-up vs full | prompt tokens computed | reused |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    let full = reports
        .iter()
        .find(|r| r.label == "full_recompute")
        .map(|r| r.mean_ttft_ms);
    for r in reports {
        let ratio = full.map_or("-".to_string(), |f| {
            format!("{:.2}×", f / r.mean_ttft_ms.max(1e-9))
        });
        s.push_str(&format!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.4} | {} | {:.1} | {} | {:.0} | {:.0} |\n",
            r.label,
            r.em_single,
            r.f1_single,
            r.em_two,
            r.f1_two,
            r.mean_answer_nll,
            r.mean_first_token_kl
                .map_or("-".to_string(), |k| format!("{k:.2e}")),
            r.mean_ttft_ms,
            ratio,
            r.mean_tokens_computed,
            r.mean_tokens_reused
        ));
    }
    s
}

fn plot(reports: &[ModeReport], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let max_t = reports.iter().map(|r| r.mean_ttft_ms).fold(1.0, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption("Exact match vs mean TTFT (hot cache)", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..max_t, 0.0..1.05)?;
    chart
        .configure_mesh()
        .x_desc("mean TTFT (ms)")
        .y_desc("exact match")
        .draw()?;
    for (series, color, pick) in [
        (
            "single-hop",
            BLUE,
            (|r: &ModeReport| r.em_single) as fn(&ModeReport) -> f64,
        ),
        ("two-hop", RED, |r: &ModeReport| r.em_two),
    ] {
        chart
            .draw_series(
                reports
                    .iter()
                    .map(|r| Circle::new((r.mean_ttft_ms, pick(r)), 5, color.filled())),
            )?
            .label(series)
            .legend(move |(x, y)| Circle::new((x, y), 5, color.filled()));
        chart.draw_series(reports.iter().map(|r| {
            Text::new(
                r.label.clone(),
                (r.mean_ttft_ms, pick(r)),
                ("sans-serif", 12).into_font().color(&BLACK),
            )
        }))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mode_lists() {
        assert_eq!(parse_modes("all").unwrap().len(), 11);
        assert_eq!(
            parse_modes("full, hypic8-norope,hypic0").unwrap(),
            vec![
                Mode::FullRecompute,
                Mode::Hypic {
                    seam_width: 8,
                    rope_fix: false
                },
                Mode::Hypic {
                    seam_width: 0,
                    rope_fix: true
                }
            ]
        );
        assert!(parse_modes("fast")
            .unwrap_err()
            .to_string()
            .contains("fast"));
        assert!(parse_modes("hypicX").is_err());
    }
}
