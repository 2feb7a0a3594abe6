import { describe, expect, it } from "vitest";
import type { DecisionCounts, ShadowView } from "./api";
import { agreement, shadowRows } from "./shadow";

const zero: DecisionCounts = {
  calls: 0, faults: 0, admitted: 0, rejected: 0, admitted_bytes: 0, evictions: 0, victim_bytes: 0,
  victim_recompute_tokens: 0, dropped: 0, kept: 0, shared: 0, private: 0,
};

const view = (kind: ShadowView["kind"], c: Partial<DecisionCounts>, a: Partial<DecisionCounts>, agreed: number, disagreed: number): ShadowView => ({
  kind, policy_id: 3, params: {}, started_at: 0, started_by: "ops", active_policy_id: null,
  candidate: { ...zero, ...c }, active: { ...zero, ...a }, agreed, disagreed, tripped: false,
});

describe("shadowRows", () => {
  it("shows the admission answers side by side", () => {
    const v = view("admission", { calls: 4, admitted: 1, rejected: 3, admitted_bytes: 10 }, { calls: 4, admitted: 4, admitted_bytes: 40 }, 1, 3);
    expect(shadowRows(v)).toEqual([
      { metric: "calls", candidate: 4, active: 4 },
      { metric: "admitted", candidate: 1, active: 4 },
      { metric: "rejected", candidate: 3, active: 0 },
      { metric: "admitted bytes", candidate: 10, active: 40 },
      { metric: "faults", candidate: 0, active: 0 },
    ]);
    expect(agreement(v)).toBe(0.25);
  });
  it("only the kind's fields", () => {
    const v = view("eviction", { calls: 2, evictions: 2, victim_bytes: 5 }, { calls: 2, evictions: 2, victim_bytes: 9 }, 0, 0);
    expect(shadowRows(v).map((r) => r.metric)).toEqual(["calls", "evictions", "victim bytes", "victim recompute tokens", "faults"]);
    expect(agreement(v)).toBeNull();
  });
});
