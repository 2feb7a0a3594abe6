// Rows of the shadow comparison: the candidate's and the active policy's
// answers to the same live calls, the fields of the shadow's kind only.
import type { DecisionCounts, ShadowView } from "./api";

/** One row: a count of the candidate (counted only) and of the active policy (applied). */
export interface ShadowRow {
  metric: string;
  candidate: number;
  active: number;
}

const FIELDS: Record<string, [keyof DecisionCounts, string][]> = {
  admission: [
    ["admitted", "admitted"],
    ["rejected", "rejected"],
    ["admitted_bytes", "admitted bytes"],
  ],
  eviction: [
    ["evictions", "evictions"],
    ["victim_bytes", "victim bytes"],
    ["victim_recompute_tokens", "victim recompute tokens"],
  ],
  invalidation: [
    ["dropped", "dropped"],
    ["kept", "kept"],
  ],
  isolation: [
    ["shared", "shared namespace"],
    ["private", "per tenant"],
  ],
};

/** The comparison rows of `v`: calls, its kind's answers, faults. */
export function shadowRows(v: ShadowView): ShadowRow[] {
  const row = (k: keyof DecisionCounts, metric: string): ShadowRow => ({
    metric,
    candidate: v.candidate[k],
    active: v.active[k],
  });
  return [row("calls", "calls"), ...(FIELDS[v.kind] ?? []).map(([k, m]) => row(k, m)), row("faults", "faults")];
}

/** Share of calls both answered alike, 0..1 (null before the first call). */
export function agreement(v: ShadowView): number | null {
  const n = v.agreed + v.disagreed;
  return n > 0 ? v.agreed / n : null;
}
