import { describe, expect, it } from "vitest";
import type { DryRunResult, MetricSample, SimStats, TenantSimStats } from "./api";
import { bytes, compare, compareTenants, pct, rates, series, tierCells } from "./metrics";

function sample(ts: number, o: Partial<MetricSample> = {}): MetricSample {
  return {
    ts_ms: ts, requests: 0, finished: 0, rejected_429: 0, timeouts_408: 0,
    prompt_tokens_cached: 0, prompt_tokens_computed: 0, completion_tokens: 0,
    segment_hits: 0, segment_misses: 0, seam_tokens: 0, queue_depth: 0, running: 0, pools: {},
    policy_calls: 0, policy_faults: 0, policy_fallbacks: 0, ttft_ms: {}, ...o,
  };
}

describe("rates", () => {
  it("diffs counters over the interval", () => {
    const a = sample(1000, { requests: 10, prompt_tokens_cached: 100, prompt_tokens_computed: 100, segment_hits: 1, segment_misses: 1 });
    const b = sample(3000, { requests: 30, prompt_tokens_cached: 400, prompt_tokens_computed: 200, segment_hits: 4, segment_misses: 2 });
    const r = rates(a, b);
    expect(r.requestsPerS).toBe(10);
    expect(r.cachedShare).toBe(0.75);
    expect(r.hitRatio).toBe(0.75);
  });
  it("has no ratio without traffic and treats a reset as zero", () => {
    const r = rates(sample(0, { requests: 5 }), sample(1000, { requests: 2 }));
    expect(r.requestsPerS).toBe(0);
    expect(r.cachedShare).toBeNull();
    expect(r.hitRatio).toBeNull();
  });
  it("gives one point per interval", () => {
    const s = series([sample(0), sample(5000, { requests: 5, queue_depth: 2 }), sample(10000, { requests: 5 })]);
    expect(s.x).toEqual([5, 10]);
    expect(s.y.rps).toEqual([1, 0]);
    expect(s.y.queue).toEqual([2, 0]);
  });
});

function sim(o: Partial<SimStats>): SimStats {
  return {
    requests: 10, lookups: 20, hits: 10, hit_ratio: 0.5, bytes_hit: 0, bytes_inserted: 0,
    bytes_evicted: 0, recompute_tokens: 100, saved_tokens: 0, evictions: 0, rejected: 0,
    invalidations: 0, shared_hits: 0, policy_faults: 0, peak_bytes: 0, tenants: [], ...o,
  };
}

describe("compare", () => {
  it("marks the better side by the direction of each metric", () => {
    const r: DryRunResult = {
      policy_id: 1, kind: "eviction",
      candidate: sim({ hit_ratio: 0.7, recompute_tokens: 50, evictions: 3 }),
      active: sim({ hit_ratio: 0.5, recompute_tokens: 100, evictions: 1 }),
      hit_ratio_delta: 0.2, recompute_tokens_delta: -50,
    };
    const rows = Object.fromEntries(compare(r).map((x) => [x.metric, x]));
    expect(rows["hit ratio"]).toMatchObject({ better: "candidate", candidate: 0.7, active: 0.5 });
    expect(rows["hit ratio"].delta).toBeCloseTo(0.2);
    expect(rows["tokens recomputed"]).toMatchObject({ better: "candidate", delta: -50 });
    expect(rows["evictions"]).toMatchObject({ better: "active", delta: 2 });
    expect(rows["admissions refused"].better).toBe("same");
  });
});

describe("formatting", () => {
  it("formats bytes and shares", () => {
    expect(bytes(512)).toBe("512 B");
    expect(bytes(1536)).toBe("1.5 KiB");
    expect(bytes(3 * 1024 * 1024)).toBe("3.0 MiB");
    expect(pct(0.5)).toBe("50.0 %");
    expect(pct(null)).toBe("—");
  });
});

describe("overview: seam tokens and tiers", () => {
  it("gives the seam-token rate over the interval", () => {
    const r = rates(sample(0, { seam_tokens: 16 }), sample(2000, { seam_tokens: 56 }));
    expect(r.seamPerS).toBe(20);
    const s = series([sample(0), sample(5000, { seam_tokens: 40 })]);
    expect(s.y.seam).toEqual([8]);
  });
  it("marks a tier the backend does not have as absent, an empty one as 0", () => {
    const cells = tierCells({
      bytes: 100, entries: 2, spill_bytes: 0,
      tiers: { host: { bytes: 100, entries: 2 }, spill: { bytes: 0, entries: 0 } },
    });
    expect(cells.map((c) => c.tier)).toEqual(["gpu", "host", "spill"]);
    expect(cells[0].usage).toBeNull();
    expect(cells[1].usage).toEqual({ bytes: 100, entries: 2 });
    expect(cells[2].usage).toEqual({ bytes: 0, entries: 0 });
  });
});

function tenant(name: string, o: Partial<TenantSimStats>): TenantSimStats {
  return {
    tenant: name, requests: 2, lookups: 4, hits: 0, hit_ratio: 0, bytes_hit: 0, bytes_inserted: 0,
    bytes_evicted: 0, recompute_tokens: 0, evictions: 0, rejected: 0, invalidations: 0, ...o,
  };
}

describe("compareTenants", () => {
  const r: DryRunResult = {
    policy_id: 2, kind: "eviction",
    candidate: sim({
      tenants: [
        tenant("t-aaaaaaaaaaaa", { hit_ratio: 0.75, hits: 3, bytes_hit: 300, evictions: 0 }),
        tenant("t-bbbbbbbbbbbb", { hit_ratio: 0.25, hits: 1, bytes_hit: 100, evictions: 3, bytes_evicted: 900, rejected: 1 }),
      ],
    }),
    active: sim({
      tenants: [
        tenant("t-aaaaaaaaaaaa", { hit_ratio: 0.5, hits: 2, bytes_hit: 200, evictions: 1, bytes_evicted: 300 }),
        tenant("t-bbbbbbbbbbbb", { hit_ratio: 0.5, hits: 2, bytes_hit: 200, evictions: 1, bytes_evicted: 300 }),
        tenant("t-cccccccccccc", { requests: 1, hit_ratio: 0 }),
      ],
    }),
    hit_ratio_delta: 0, recompute_tokens_delta: 0,
  };
  const rows = compareTenants(r);
  it("puts the tenant the candidate hurts most first, then by name", () => {
    expect(rows.map((x) => x.tenant)).toEqual(["t-bbbbbbbbbbbb", "t-cccccccccccc", "t-aaaaaaaaaaaa"]);
  });
  it("compares each metric in its direction", () => {
    const [b, , a] = rows;
    expect(b.hitRatio).toEqual({ candidate: 0.25, active: 0.5, delta: -0.25, better: "active" });
    expect(b.evictions).toMatchObject({ candidate: 3, active: 1, better: "active" });
    expect(b.bytesEvicted.delta).toBe(600);
    expect(b.rejected).toMatchObject({ candidate: 1, active: 0, better: "active" });
    expect(a.hitRatio.better).toBe("candidate");
    expect(a.bytesHit).toMatchObject({ delta: 100, better: "candidate" });
    expect(a.evictions).toMatchObject({ candidate: 0, active: 1, better: "candidate" });
  });
  it("counts a tenant missing on one side as zeros there", () => {
    const c = rows[1];
    expect(c.requests).toBe(1);
    expect(c.hitRatio).toMatchObject({ candidate: 0, active: 0, better: "same" });
  });
  it("is empty for an answer without a breakdown", () => {
    expect(compareTenants({ ...r, candidate: sim({}), active: sim({}) })).toEqual([]);
  });
});
