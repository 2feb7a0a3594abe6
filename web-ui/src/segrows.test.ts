import { describe, expect, it } from "vitest";
import { hitsText, residencyText, rowKey, rowRef, segmentLabel } from "./segrows";

const row = (owner: string | null, id: string, address: string) => ({ id, address, owner_tenant: owner });

describe("segment rows", () => {
  it("keys the same id of two owners apart", () => {
    const a = row("acme", "doc", "~aaaa");
    const b = row("globex", "doc", "~bbbb");
    expect(rowKey(a)).not.toEqual(rowKey(b));
    expect(rowKey(a)).toBe("acme/doc");
    // Another tenant's segment, seen by a tenant: no owner, keyed by address.
    expect(rowKey(row(null, "~cccc", "~cccc"))).toBe("~/~cccc");
    const keys = [a, b, row("acme", "notes", "~dddd")].map(rowKey);
    expect(new Set(keys).size).toBe(3);
  });
  it("links a row by id when the viewer owns it, else by address", () => {
    const op = { tenant: "ops", role: "operator" };
    expect(rowRef(row("ops", "kb-doc", "~eeee"), op)).toBe("kb-doc");
    expect(rowRef(row("acme", "doc", "~aaaa"), op)).toBe("~aaaa");
    expect(rowRef(row("globex", "doc", "~bbbb"), op)).toBe("~bbbb");
    expect(rowRef(row(null, "~cccc", "~cccc"), { tenant: "demo", role: "tenant" })).toBe("~cccc");
    expect(segmentLabel(row("acme", "doc", "~aaaa"), op)).toBe("acme/doc");
    expect(segmentLabel(row("ops", "kb-doc", "~eeee"), op)).toBe("kb-doc");
  });
  it("shows residency and hits as the list answers them", () => {
    expect(residencyText(null)).toBe("—");
    expect(residencyText({ resident: true, shared: false, entries: [] })).toBe("resident");
    expect(residencyText({ resident: true, shared: true, entries: [] })).toBe("resident (shared)");
    expect(residencyText({ resident: false, shared: false, entries: [] })).toBe("not resident");
    expect(hitsText({ hits: 3 })).toBe("3");
    expect(hitsText({ hits: 0 })).toBe("0");
    expect(hitsText({ hits: null })).toBe("—");
  });
});
