// Numbers of the overview, derived from the samples of `GET /v1/metrics/history`.
import type { MetricSample, DryRunResult, SimStats } from "./api";

/** Overview figures over the interval between two samples. */
export interface Rates {
  /** HTTP requests per second. */
  requestsPerS: number;
  /** Completions finished per second. */
  finishedPerS: number;
  /** Share of prompt tokens whose work was reused, 0..1 (null without prompt tokens). */
  cachedShare: number | null;
  /** Segment hits / (hits + misses), 0..1 (null without lookups). */
  hitRatio: number | null;
}

function ratio(a: number, b: number): number | null {
  return b > 0 ? a / b : null;
}

/** Rates between `a` (older) and `b` (newer); counter resets read as 0. */
export function rates(a: MetricSample, b: MetricSample): Rates {
  const d = (f: (s: MetricSample) => number) => Math.max(0, f(b) - f(a));
  const dt = Math.max(0.001, (b.ts_ms - a.ts_ms) / 1000);
  const cached = d((s) => s.prompt_tokens_cached);
  const computed = d((s) => s.prompt_tokens_computed);
  const hits = d((s) => s.segment_hits);
  const misses = d((s) => s.segment_misses);
  return {
    requestsPerS: d((s) => s.requests) / dt,
    finishedPerS: d((s) => s.finished) / dt,
    cachedShare: ratio(cached, cached + computed),
    hitRatio: ratio(hits, hits + misses),
  };
}

/** Since-start totals of the newest sample. */
export function totals(s: MetricSample): Rates {
  return {
    requestsPerS: 0,
    finishedPerS: 0,
    cachedShare: ratio(s.prompt_tokens_cached, s.prompt_tokens_cached + s.prompt_tokens_computed),
    hitRatio: ratio(s.segment_hits, s.segment_hits + s.segment_misses),
  };
}

/** Per-interval series for charts: x in Unix seconds, one y list per name. */
export function series(samples: MetricSample[]): { x: number[]; y: Record<string, (number | null)[]> } {
  const x: number[] = [];
  const y: Record<string, (number | null)[]> = { rps: [], hit: [], cached: [], queue: [], running: [] };
  for (let i = 1; i < samples.length; i++) {
    const r = rates(samples[i - 1], samples[i]);
    x.push(samples[i].ts_ms / 1000);
    y.rps.push(r.requestsPerS);
    y.hit.push(r.hitRatio);
    y.cached.push(r.cachedShare);
    y.queue.push(samples[i].queue_depth);
    y.running.push(samples[i].running);
  }
  return { x, y };
}

/** One row of the dry-run comparison: candidate, active, and which is better. */
export interface CompareRow {
  metric: string;
  candidate: number;
  active: number;
  delta: number;
  /** "candidate", "active" or "same" (higher is better unless `lowerIsBetter`). */
  better: "candidate" | "active" | "same";
}

const COMPARED: { key: keyof SimStats; label: string; lowerIsBetter: boolean }[] = [
  { key: "hit_ratio", label: "hit ratio", lowerIsBetter: false },
  { key: "hits", label: "hits", lowerIsBetter: false },
  { key: "saved_tokens", label: "tokens saved", lowerIsBetter: false },
  { key: "recompute_tokens", label: "tokens recomputed", lowerIsBetter: true },
  { key: "bytes_hit", label: "bytes served from cache", lowerIsBetter: false },
  { key: "bytes_evicted", label: "bytes evicted", lowerIsBetter: true },
  { key: "evictions", label: "evictions", lowerIsBetter: true },
  { key: "rejected", label: "admissions refused", lowerIsBetter: true },
  { key: "invalidations", label: "invalidations", lowerIsBetter: true },
  { key: "policy_faults", label: "policy faults", lowerIsBetter: true },
  { key: "peak_bytes", label: "peak bytes", lowerIsBetter: true },
];

/** The side-by-side rows of a dry run (candidate vs the active policies). */
export function compare(r: DryRunResult): CompareRow[] {
  return COMPARED.map(({ key, label, lowerIsBetter }) => {
    const c = r.candidate[key];
    const a = r.active[key];
    const delta = c - a;
    const better: CompareRow["better"] =
      delta === 0 ? "same" : delta > 0 !== lowerIsBetter ? "candidate" : "active";
    return { metric: label, candidate: c, active: a, delta, better };
  });
}

/** `1234567` → `1.2 MiB`. */
export function bytes(n: number): string {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < u.length - 1) {
    v /= 1024;
    i++;
  }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${u[i]}`;
}

/** A 0..1 share as a percentage, or an em dash. */
export function pct(v: number | null): string {
  return v === null ? "—" : `${(v * 100).toFixed(1)} %`;
}
