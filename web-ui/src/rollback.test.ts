import { describe, expect, it } from "vitest";
import type { PolicyRecord, PolicyStats } from "./api";
import { policyName, rollbackTarget } from "./rollback";

const rec = (id: number, name: string, version: number): PolicyRecord => ({
  id,
  name,
  version,
  kind: "eviction",
  module_sha256: "00",
  params: "{}",
  created_by: "ops",
  created_at: 0,
  active: false,
});
const all = [rec(1, "lru", 1), rec(2, "lru", 2), rec(3, "ttl", 1)];
const stats = (rollback_to: Record<string, number | null>): PolicyStats => ({
  active: {},
  rollback_to,
  metrics: {},
  module_compiles: 0,
  modules_cached: 0,
});

describe("rollback target", () => {
  it("names the earlier different version the server says it goes to", () => {
    expect(rollbackTarget("eviction", stats({ eviction: 1 }), all)).toEqual({ possible: true, to: "#1 lru v1" });
    expect(rollbackTarget("eviction", stats({ eviction: null }), all)).toEqual({ possible: true, to: "the native default" });
  });
  it("offers none when there is nothing to roll back to, or before the stats load", () => {
    expect(rollbackTarget("admission", stats({ eviction: 1 }), all).possible).toBe(false);
    expect(rollbackTarget("eviction", null, all).possible).toBe(false);
  });
  it("names a version it does not list by id", () => {
    expect(policyName(9, all)).toBe("#9");
    expect(policyName(3, all)).toBe("#3 ttl v1");
  });
});
