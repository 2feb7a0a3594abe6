// Numbers of the overview, derived from the samples of `GET /v1/metrics/history`.
import type { MetricSample, DryRunResult, PoolSample, SimStats, TenantSimStats } from "./api";

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
  /** Seam-window tokens recomputed per second. */
  seamPerS: number;
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
    seamPerS: d((s) => s.seam_tokens ?? 0) / dt,
  };
}

/** Since-start totals of the newest sample. */
export function totals(s: MetricSample): Rates {
  return {
    requestsPerS: 0,
    finishedPerS: 0,
    cachedShare: ratio(s.prompt_tokens_cached, s.prompt_tokens_cached + s.prompt_tokens_computed),
    hitRatio: ratio(s.segment_hits, s.segment_hits + s.segment_misses),
    seamPerS: 0,
  };
}

/** The storage tiers the overview shows, in this order. */
export const TIERS = ["gpu", "host", "spill"] as const;

/** One cell of the pools-by-tier table: what a tier holds, or `null` when the
 * backend has no such tier (shown as absent, not as 0). */
export interface TierCell {
  tier: (typeof TIERS)[number];
  usage: { bytes: number; entries: number } | null;
}

/** The cells of one pool's row, one per tier in [`TIERS`] order. */
export function tierCells(p: PoolSample): TierCell[] {
  return TIERS.map((tier) => ({ tier, usage: p.tiers?.[tier] ?? null }));
}

/** Per-interval series for charts: x in Unix seconds, one y list per name. */
export function series(samples: MetricSample[]): { x: number[]; y: Record<string, (number | null)[]> } {
  const x: number[] = [];
  const y: Record<string, (number | null)[]> = { rps: [], hit: [], cached: [], queue: [], running: [], seam: [] };
  for (let i = 1; i < samples.length; i++) {
    const r = rates(samples[i - 1], samples[i]);
    x.push(samples[i].ts_ms / 1000);
    y.rps.push(r.requestsPerS);
    y.hit.push(r.hitRatio);
    y.cached.push(r.cachedShare);
    y.queue.push(samples[i].queue_depth);
    y.running.push(samples[i].running);
    y.seam.push(r.seamPerS);
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

const COMPARED: { key: Exclude<keyof SimStats, "tenants">; label: string; lowerIsBetter: boolean }[] = [
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

/** One metric of one tenant, candidate beside active. */
export interface Side {
  candidate: number;
  active: number;
  delta: number;
  better: CompareRow["better"];
}

/** One tenant's row of the dry-run comparison. */
export interface TenantRow {
  tenant: string;
  /** Its requests in the trace (the same on both sides). */
  requests: number;
  hitRatio: Side;
  bytesHit: Side;
  bytesEvicted: Side;
  evictions: Side;
  rejected: Side;
}

function side(c: number, a: number, lowerIsBetter: boolean): Side {
  const delta = c - a;
  const better: Side["better"] = delta === 0 ? "same" : delta > 0 !== lowerIsBetter ? "candidate" : "active";
  return { candidate: c, active: a, delta, better };
}

const NO_TENANT: Omit<TenantSimStats, "tenant"> = {
  requests: 0, lookups: 0, hits: 0, hit_ratio: 0, bytes_hit: 0, bytes_inserted: 0,
  bytes_evicted: 0, recompute_tokens: 0, evictions: 0, rejected: 0, invalidations: 0,
};

/** The per-tenant rows of a dry run: every tenant of either side (one missing on
 * a side counts as zeros there), sorted by how much the candidate changes its
 * hit ratio (largest loss first, so the tenants a policy hurts lead), then name. */
export function compareTenants(r: DryRunResult): TenantRow[] {
  const c = new Map((r.candidate.tenants ?? []).map((t) => [t.tenant, t]));
  const a = new Map((r.active.tenants ?? []).map((t) => [t.tenant, t]));
  const names = [...new Set([...c.keys(), ...a.keys()])];
  const rows = names.map((tenant) => {
    const x = { ...NO_TENANT, ...c.get(tenant) };
    const y = { ...NO_TENANT, ...a.get(tenant) };
    return {
      tenant,
      requests: Math.max(x.requests, y.requests),
      hitRatio: side(x.hit_ratio, y.hit_ratio, false),
      bytesHit: side(x.bytes_hit, y.bytes_hit, false),
      bytesEvicted: side(x.bytes_evicted, y.bytes_evicted, true),
      evictions: side(x.evictions, y.evictions, true),
      rejected: side(x.rejected, y.rejected, true),
    };
  });
  return rows.sort((p, q) => p.hitRatio.delta - q.hitRatio.delta || p.tenant.localeCompare(q.tenant));
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
