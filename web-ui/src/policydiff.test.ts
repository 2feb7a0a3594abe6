import { describe, expect, it } from "vitest";
import type { PolicyDetail } from "./api";
import { lineDiff } from "./diff";
import { policyLines } from "./policydiff";

function detail(over: Partial<PolicyDetail>): PolicyDetail {
  return {
    id: 1,
    name: "ttl",
    kind: "invalidation",
    module_sha256: "aa",
    params: "{}",
    version: 1,
    created_by: "ops",
    created_at: 0,
    active: false,
    param_schema: { params: [{ name: "ttl_ms", type: "int", min: 0, default: 3600000, description: "age limit" }] },
    effective_params: { ttl_ms: 3600000 },
    module: {
      bytes: 100,
      exports: [{ name: "hypic_invalidate", kind: "func" }],
      imports: 0,
      functions: 4,
      code_bytes: 60,
      memory_min_pages: 17,
      custom_sections: [{ name: "hypic.params", bytes: 80 }],
    },
    ...over,
  };
}

describe("policyLines", () => {
  it("renders values, defaults and the schema", () => {
    const l = policyLines(detail({}));
    expect(l).toContain("  ttl_ms = 3600000 (default)");
    expect(l).toContain("  ttl_ms: int, 0 ≤ x; default 3600000 — age limit");
    expect(l).toContain("  func hypic_invalidate");
  });
  it("a parameter change is the only difference between two versions of one module", () => {
    const a = detail({});
    const b = detail({ id: 2, version: 2, params: '{"ttl_ms":600000}', effective_params: { ttl_ms: 600000 } });
    const changed = lineDiff(policyLines(a).join("\n"), policyLines(b).join("\n")).filter((x) => x.kind !== "same");
    expect(changed).toEqual([
      { kind: "del", text: "  ttl_ms = 3600000 (default)" },
      { kind: "add", text: "  ttl_ms = 600000" },
    ]);
  });
  it("shows a module without a schema", () => {
    const l = policyLines(detail({ param_schema: null, effective_params: null, params: '{"n":2}' }));
    expect(l).toContain("  n = 2");
    expect(l).toContain("parameter schema: none declared (ABI v1 integer parameters)");
  });
});
