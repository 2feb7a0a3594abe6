import { describe, expect, it } from "vitest";
import { diffStat, lineDiff } from "./diff";

describe("lineDiff", () => {
  it("marks a changed middle line as removed then added, keeping the rest", () => {
    const d = lineDiff("alpha\nbeta\ngamma\n", "alpha\nBETA\ngamma\n");
    expect(d).toEqual([
      { kind: "same", text: "alpha" },
      { kind: "del", text: "beta" },
      { kind: "add", text: "BETA" },
      { kind: "same", text: "gamma" },
    ]);
    expect(diffStat(d)).toEqual({ added: 1, removed: 1 });
  });

  it("shows appended lines and no phantom empty line without a final newline", () => {
    const d = lineDiff("one", "one\ntwo");
    expect(d.filter((l) => l.kind !== "same").map((l) => l.text)).toEqual(expect.arrayContaining(["two"]));
    expect(d.some((l) => l.text === "")).toBe(false);
  });

  it("is all kept lines for equal texts", () => {
    const d = lineDiff("a\nb\n", "a\nb\n");
    expect(diffStat(d)).toEqual({ added: 0, removed: 0 });
    expect(d.map((l) => l.text)).toEqual(["a", "b"]);
  });
});
