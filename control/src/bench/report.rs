//! Benchmark statistics, Markdown/JSON summaries and SVG plots.
use super::workload::WorkloadSpec;
use super::{ModeSpec, Sample};
use plotters::prelude::*;
use serde::Serialize;
use std::io::Write;
use std::path::Path;

/// Statistics of one (mode, rate) run.
#[derive(Clone, Debug, Serialize)]
pub struct RunStats {
    /// Mode label.
    pub mode: String,
    /// Offered rate, req/s (0: trace timestamps).
    pub rate: f64,
    /// Requests sent.
    pub requests: usize,
    /// Completed.
    pub ok: usize,
    /// Refused with 429.
    pub rejected: usize,
    /// Other failures.
    pub failed: usize,
    /// TTFT percentiles, ms.
    pub ttft_p50_ms: f64,
    /// p95.
    pub ttft_p95_ms: f64,
    /// p99.
    pub ttft_p99_ms: f64,
    /// Mean.
    pub ttft_mean_ms: f64,
    /// Median time per output token after the first, ms: over completed
    /// requests with at least two generated tokens, (end-to-end − TTFT) /
    /// (generated − 1); NaN when there are none.
    pub tpot_p50_ms: f64,
    /// Completed requests per second of wall time.
    pub throughput_rps: f64,
    /// Prompt tokens per second (completed requests).
    pub prompt_tps: f64,
    /// Generated tokens per second.
    pub output_tps: f64,
    /// Context segments (all but the query) served from a cache (public hit or
    /// prefix hit) / context segments.
    pub hit_ratio: f64,
    /// Reused prompt tokens / prompt tokens.
    pub cached_token_ratio: f64,
}

/// Per-mode result of the rate sweep.
#[derive(Clone, Debug, Serialize)]
pub struct ModeSummary {
    /// Mode label.
    pub mode: String,
    /// Highest tested rate whose p50 TTFT ≤ SLO with every request completed
    /// (None: even the lowest rate missed).
    pub max_rate_under_slo: Option<f64>,
    /// True when the highest tested rate still met the SLO (the true limit is higher).
    pub slo_met_at_all_rates: bool,
    /// Highest tested rate whose p99 TTFT ≤ the tail SLO with every request
    /// completed (None: even the lowest rate missed).
    pub max_rate_under_p99_slo: Option<f64>,
}

/// The whole benchmark result.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Where requests went.
    pub target: String,
    /// UTC date of the run.
    pub date: String,
    /// Host.
    pub host: String,
    /// p50 TTFT target, ms.
    pub slo_ms: f64,
    /// p99 TTFT target, ms.
    pub slo_p99_ms: f64,
    /// Workload parameters (generated workloads).
    pub workload: Option<WorkloadSpec>,
    /// Warm-up requests sent before the measured runs (not in any run).
    pub warmup_requests: usize,
    /// Priming requests sent before each measured run (`--prime`; not counted).
    pub primed_requests: usize,
    /// Every run.
    pub runs: Vec<RunStats>,
    /// Per mode.
    pub modes: Vec<ModeSummary>,
}

/// Percentile (nearest rank) of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn stats(mode: &str, rate: f64, s: &[&Sample]) -> RunStats {
    let ok: Vec<&&Sample> = s.iter().filter(|x| x.ok).collect();
    let mut ttft: Vec<f64> = ok.iter().map(|x| x.ttft_ms).collect();
    ttft.sort_by(|a, b| a.total_cmp(b));
    let wall = s.iter().map(|x| x.done_s).fold(0.0f64, f64::max).max(1e-9);
    let hits: usize = ok
        .iter()
        .map(|x| x.hits.min(x.segments.saturating_sub(1)))
        .sum();
    let context: usize = ok.iter().map(|x| x.segments.saturating_sub(1)).sum();
    let prompt: usize = ok.iter().map(|x| x.prompt_tokens).sum();
    let cached: usize = ok.iter().map(|x| x.cached_tokens).sum();
    let gen: usize = ok.iter().map(|x| x.generated).sum();
    let mut tpot: Vec<f64> = ok
        .iter()
        .filter(|x| x.generated >= 2)
        .map(|x| (x.e2e_ms - x.ttft_ms) / (x.generated - 1) as f64)
        .collect();
    tpot.sort_by(|a, b| a.total_cmp(b));
    RunStats {
        mode: mode.to_string(),
        rate,
        requests: s.len(),
        ok: ok.len(),
        rejected: s.iter().filter(|x| x.status == 429).count(),
        failed: s.iter().filter(|x| !x.ok && x.status != 429).count(),
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p95_ms: percentile(&ttft, 95.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        ttft_mean_ms: if ttft.is_empty() {
            f64::NAN
        } else {
            ttft.iter().sum::<f64>() / ttft.len() as f64
        },
        tpot_p50_ms: percentile(&tpot, 50.0),
        throughput_rps: ok.len() as f64 / wall,
        prompt_tps: prompt as f64 / wall,
        output_tps: gen as f64 / wall,
        hit_ratio: if context > 0 {
            (hits as f64 / context as f64).min(1.0)
        } else {
            0.0
        },
        cached_token_ratio: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
    }
}

fn utc_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    // Civil date from days since the epoch (H. Hinnant's algorithm).
    let z = secs.div_euclid(86400) + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!("{y:04}-{m:02}-{d:02}")
}

/// The latency objectives a run is judged by, in milliseconds of TTFT.
#[derive(Clone, Copy, Debug)]
pub struct Slo {
    /// Bound on the median TTFT.
    pub p50_ms: f64,
    /// Bound on the 99th-percentile TTFT.
    pub p99_ms: f64,
}

/// Builds the summary: one row per (mode, rate) from `samples`, and per mode the
/// highest rate whose every request succeeded within `slo`. `spec` is reported as the
/// workload unless the requests came from a trace (`from_trace`).
pub fn summarize(
    samples: &[Sample],
    modes: &[ModeSpec],
    rates: &[f64],
    slo: Slo,
    target: &str,
    spec: &WorkloadSpec,
    from_trace: bool,
) -> Summary {
    let (slo_ms, slo_p99_ms) = (slo.p50_ms, slo.p99_ms);
    let mut runs = vec![];
    let mut per_mode = vec![];
    for m in modes {
        let mut best = None;
        let mut best_p99 = None;
        let mut all = true;
        for &r in rates {
            let s: Vec<&Sample> = samples
                .iter()
                .filter(|x| x.mode == m.label && x.rate == r)
                .collect();
            let st = stats(&m.label, r, &s);
            let met = st.ok == st.requests && st.ttft_p50_ms <= slo_ms;
            if met && r > 0.0 {
                best = Some(best.map_or(r, |b: f64| b.max(r)));
            }
            if st.ok == st.requests && st.ttft_p99_ms <= slo_p99_ms && r > 0.0 {
                best_p99 = Some(best_p99.map_or(r, |b: f64| b.max(r)));
            }
            all &= met;
            runs.push(st);
        }
        per_mode.push(ModeSummary {
            mode: m.label.clone(),
            max_rate_under_slo: best,
            slo_met_at_all_rates: all,
            max_rate_under_p99_slo: best_p99,
        });
    }
    Summary {
        target: target.to_string(),
        date: utc_date(),
        host: format!(
            "{} cores, {}",
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            std::env::consts::ARCH
        ),
        slo_ms,
        slo_p99_ms,
        workload: if from_trace { None } else { Some(spec.clone()) },
        warmup_requests: 0,
        primed_requests: 0,
        runs,
        modes: per_mode,
    }
}

/// The Markdown report.
pub fn markdown(s: &Summary) -> String {
    let mut o = String::new();
    o.push_str(&format!(
        "hypic bench — {} — {} ({}), SLO p50 TTFT ≤ {} ms, p99 ≤ {} ms, {} warm-up requests not counted{}\n\n",
        s.date,
        s.target,
        s.host,
        s.slo_ms,
        s.slo_p99_ms,
        s.warmup_requests,
        if s.primed_requests > 0 {
            format!(
                ", each run primed with {} documents behind the system prompt (not counted)",
                s.primed_requests
            )
        } else {
            String::new()
        }
    ));
    o.push_str("| mode | rate (req/s) | ok/sent | 429 | TTFT p50 (ms) | p95 | p99 | TPOT p50 (ms) | throughput (req/s) | out tok/s | hit ratio | cached tokens |\n");
    o.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in &s.runs {
        o.push_str(&format!(
            "| {} | {} | {}/{} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {:.2} | {:.0} % |\n",
            r.mode,
            if r.rate > 0.0 {
                format!("{}", r.rate)
            } else {
                "trace".into()
            },
            r.ok,
            r.requests,
            r.rejected,
            r.ttft_p50_ms,
            r.ttft_p95_ms,
            r.ttft_p99_ms,
            r.tpot_p50_ms,
            r.throughput_rps,
            r.output_tps,
            r.hit_ratio,
            100.0 * r.cached_token_ratio
        ));
    }
    o.push_str(&format!(
        "\n| mode | highest rate with p50 TTFT ≤ {} ms | with p99 TTFT ≤ {} ms |\n|---|---:|---:|\n",
        s.slo_ms, s.slo_p99_ms
    ));
    for m in &s.modes {
        let v = match (m.max_rate_under_slo, m.slo_met_at_all_rates) {
            (Some(r), true) => format!("≥ {r} req/s (all tested rates met)"),
            (Some(r), false) => format!("{r} req/s"),
            (None, _) => "below the lowest tested rate".into(),
        };
        let p99 = match m.max_rate_under_p99_slo {
            Some(r) => format!("{r} req/s"),
            None => "below the lowest tested rate".into(),
        };
        o.push_str(&format!("| {} | {} | {} |\n", m.mode, v, p99));
    }
    o
}

/// Writes summary.json, summary.md, samples.jsonl and (optionally) plots.
pub fn write_results(
    dir: &Path,
    s: &Summary,
    samples: &[Sample],
    plots: bool,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("summary.json"), serde_json::to_string_pretty(s)?)?;
    std::fs::write(dir.join("summary.md"), markdown(s))?;
    let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join("samples.jsonl"))?);
    for x in samples {
        writeln!(f, "{}", serde_json::to_string(x)?)?;
    }
    f.flush()?;
    if plots {
        plot_rate(dir, s).map_err(|e| anyhow::anyhow!("plotting: {e}"))?;
        plot_cdf(dir, s, samples).map_err(|e| anyhow::anyhow!("plotting: {e}"))?;
    }
    Ok(())
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// p50 and p99 TTFT against the offered rate, per mode, with the SLO line.
fn plot_rate(dir: &Path, s: &Summary) -> PlotResult {
    let rates: Vec<f64> = s.runs.iter().map(|r| r.rate).filter(|r| *r > 0.0).collect();
    if rates.is_empty() {
        return Ok(());
    }
    let xmax = rates.iter().cloned().fold(0.0, f64::max) * 1.1;
    let ymax = s
        .runs
        .iter()
        .map(|r| r.ttft_p99_ms)
        .filter(|x| x.is_finite())
        .fold(s.slo_ms, f64::max)
        * 1.15;
    let path = dir.join("ttft_vs_rate.svg");
    let root = SVGBackend::new(&path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut ch = ChartBuilder::on(&root)
        .caption(
            format!("TTFT vs offered rate — {} ({})", s.target, s.date),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
    ch.configure_mesh()
        .x_desc("offered rate (req/s)")
        .y_desc("TTFT (ms)")
        .draw()?;
    ch.draw_series(LineSeries::new(
        vec![(0.0, s.slo_ms), (xmax, s.slo_ms)],
        BLACK.stroke_width(1),
    ))?
    .label(format!("SLO {} ms", s.slo_ms))
    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    for (i, m) in s.modes.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let pts = |f: fn(&RunStats) -> f64| -> Vec<(f64, f64)> {
            s.runs
                .iter()
                .filter(|r| r.mode == m.mode && r.rate > 0.0 && f(r).is_finite())
                .map(|r| (r.rate, f(r)))
                .collect()
        };
        let p50 = pts(|r| r.ttft_p50_ms);
        let p99 = pts(|r| r.ttft_p99_ms);
        ch.draw_series(LineSeries::new(p50.clone(), c.stroke_width(2)))?
            .label(format!("{} p50", m.mode))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        ch.draw_series(p50.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
        ch.draw_series(LineSeries::new(p99, c.stroke_width(1)))?
            .label(format!("{} p99", m.mode))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(1)));
    }
    ch.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}

/// TTFT CDF per mode at the lowest tested rate.
fn plot_cdf(dir: &Path, s: &Summary, samples: &[Sample]) -> PlotResult {
    let Some(rate) = s.runs.iter().map(|r| r.rate).reduce(f64::min) else {
        return Ok(());
    };
    let ok: Vec<&Sample> = samples.iter().filter(|x| x.ok && x.rate == rate).collect();
    if ok.is_empty() {
        return Ok(());
    }
    let xmax = ok.iter().map(|x| x.ttft_ms).fold(0.0, f64::max) * 1.05 + 1e-3;
    let path = dir.join("ttft_cdf.svg");
    let root = SVGBackend::new(&path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = if rate > 0.0 {
        format!("TTFT CDF at {rate} req/s — {}", s.target)
    } else {
        format!("TTFT CDF (trace times) — {}", s.target)
    };
    let mut ch = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..xmax, 0.0..1.0)?;
    ch.configure_mesh()
        .x_desc("TTFT (ms)")
        .y_desc("fraction of requests")
        .draw()?;
    for (i, m) in s.modes.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let mut v: Vec<f64> = ok
            .iter()
            .filter(|x| x.mode == m.mode)
            .map(|x| x.ttft_ms)
            .collect();
        if v.is_empty() {
            continue;
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len() as f64;
        let pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .map(|(k, &t)| (t, (k + 1) as f64 / n))
            .collect();
        ch.draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(m.mode.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    ch.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(rate: f64, ttft_ms: f64, e2e_ms: f64, generated: usize) -> Sample {
        Sample {
            mode: "hypic".into(),
            rate,
            index: 0,
            arrival_s: 0.0,
            ok: true,
            status: 200,
            error: None,
            ttft_ms,
            e2e_ms,
            done_s: 1.0,
            prompt_tokens: 10,
            cached_tokens: 0,
            hits: 0,
            misses: 0,
            segments: 2,
            generated,
        }
    }

    #[test]
    fn tpot_and_the_tail_slo_rate() {
        let modes = super::super::parse_modes("hypic").unwrap();
        let spec = WorkloadSpec {
            requests: 6,
            docs: 1,
            docs_per_request: 1,
            zipf_s: 1.0,
            doc_words: 1,
            system_words: 1,
            query_words: 1,
            multi_turn: 0.0,
            seed: 0,
        };
        // Rate 1: TPOT 10 ms and 20 ms (one-token answers do not count), p99 900 ms.
        // Rate 2: p50 under 1 s but p99 2.5 s.
        let samples = vec![
            sample(1.0, 100.0, 100.0 + 9.0 * 10.0, 10),
            sample(1.0, 900.0, 900.0 + 3.0 * 20.0, 4),
            sample(1.0, 500.0, 500.0, 1),
            sample(2.0, 200.0, 300.0, 2),
            sample(2.0, 300.0, 400.0, 2),
            sample(2.0, 2500.0, 2600.0, 2),
        ];
        let s = summarize(
            &samples,
            &modes,
            &[1.0, 2.0],
            Slo {
                p50_ms: 1000.0,
                p99_ms: 2000.0,
            },
            "x",
            &spec,
            true,
        );
        assert_eq!(s.runs[0].tpot_p50_ms, 10.0);
        assert_eq!(s.runs[1].tpot_p50_ms, 100.0);
        assert_eq!(s.modes[0].max_rate_under_slo, Some(2.0));
        assert_eq!(s.modes[0].max_rate_under_p99_slo, Some(1.0));
        let md = markdown(&s);
        assert!(md.contains("with p99 TTFT ≤ 2000 ms"), "{md}");
        assert!(
            md.contains("| hypic | ≥ 2 req/s (all tested rates met) | 1 req/s |"),
            "{md}"
        );
    }
}
