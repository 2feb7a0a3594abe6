import { describe, expect, it } from "vitest";
import type { Prefilled, WhyAnswer, WhyEntry } from "./api";
import { policyText, prefillText, reasonTitle, verdict } from "./why";

const entry = (body_start: number, tier: string | null, cacheable = true): WhyEntry => ({
  body_start,
  role: body_start ? "after_another" : "first",
  cacheable,
  tier,
  bytes: tier ? 100 : null,
  hits: tier ? 1 : null,
  inserted_ms: null,
  last_use_ms: null,
  events: [],
});

const answer = (entries: WhyEntry[], reasons: WhyAnswer["reasons"] = []): WhyAnswer => ({
  object: "segment.why",
  segment: "doc",
  address: "~0",
  tenant: "acme",
  model: "tiny",
  version: 1,
  tokens: 20,
  shared: false,
  resident: entries.some((e) => e.tier),
  entries,
  reasons,
  recent: [],
});

describe("why view text", () => {
  it("names a catalog policy with its name and version", () => {
    expect(policyText({ name: "eviction policy #3", policy_id: 3, policy_name: "lru-ui", policy_version: 2 })).toBe(
      "eviction policy #3 (lru-ui v2)",
    );
    expect(policyText({ name: "native default", policy_id: null, policy_name: null, policy_version: null })).toBe("native default");
    expect(policyText(null)).toBe("");
  });

  it("says resident only when every cacheable entry is", () => {
    expect(verdict(answer([entry(0, "host"), entry(8, null, false)]))).toMatch(/^Resident for acme: host/);
    const evicted = {
      code: "evicted",
      message: "evicted for space from the host tier by native default",
      at_ms: 5,
      body_start: 8,
      decided_by: null,
    };
    expect(verdict(answer([entry(0, "host"), entry(8, null)], [evicted]))).toBe(
      "Partly resident; Evicted for space: evicted for space from the host tier by native default",
    );
    expect(verdict(answer([entry(0, null)], []))).toBe("Not resident for acme");
  });

  it("keeps unknown codes verbatim", () => {
    expect(reasonTitle({ code: "something_new", message: "", at_ms: null, body_start: null, decided_by: null })).toBe("something_new");
  });
});

describe("prefillText", () => {
  const r = (entries: Prefilled["prefill"]["entries"], shared = false): Prefilled => ({
    address: "~a", version: 2, tenant: "acme", tokens: 20,
    prefill: { prefill_ms: 12.4, shared, entries },
  });
  it("names each entry's outcome and the namespace", () => {
    expect(prefillText(r([{ body_start: 0, status: "stored", bytes: 2048 }, { body_start: 8, status: "present", bytes: 10 }]))).toBe(
      "v2 for tenant acme, 12 ms — body start 0: stored (2.0 KiB); body start 8: already resident",
    );
    expect(prefillText(r([{ body_start: 0, error: "device lost" }], true))).toBe(
      "v2 for every tenant (shared), 12 ms — body start 0: failed: device lost",
    );
  });
});
