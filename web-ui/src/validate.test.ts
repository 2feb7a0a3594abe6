import { describe, expect, it } from "vitest";
import { checkCapacity, checkId, checkTrace, checkWasm, isError, parseParams, segmentIdOf } from "./validate";

describe("parseParams", () => {
  it("accepts an object of integers and empty text", () => {
    expect(parseParams('{"ttl_ms": 3600000, "min_hits": 0}')).toEqual({ params: { ttl_ms: 3600000, min_hits: 0 } });
    expect(parseParams("  ")).toEqual({ params: {} });
  });
  it("names the bad field", () => {
    expect(parseParams('{"ttl_ms": 1.5}')).toEqual({ field: "params.ttl_ms", message: "params.ttl_ms must be an integer" });
    expect(parseParams('{"a": "3"}')).toMatchObject({ field: "params.a" });
    expect(parseParams("[1]")).toMatchObject({ field: "params", message: "params must be a JSON object" });
    expect(parseParams("{nope")).toMatchObject({ field: "params" });
    expect(parseParams('{"big": 9007199254740993}')).toMatchObject({ field: "params.big" });
  });
});

describe("checkWasm", () => {
  const ok = new Uint8Array([0, 0x61, 0x73, 0x6d, 1, 0, 0, 0, 1, 2]);
  it("accepts a module header", () => expect(checkWasm(ok, 100)).toBeNull());
  it("refuses empty, oversized and non-Wasm files", () => {
    expect(checkWasm(new Uint8Array(), 100)?.message).toBe("the file is empty");
    expect(checkWasm(ok, 9)?.message).toContain("over 9");
    expect(checkWasm(new TextEncoder().encode("(module)  "), 100)?.message).toContain("bad magic");
    // Right magic, binary version 2.
    expect(checkWasm(new Uint8Array([0, 0x61, 0x73, 0x6d, 2, 0, 0, 0]), 100)).not.toBeNull();
  });
});

describe("checkTrace", () => {
  const line = '{"tenant":"acme","segments":["a","b"],"tokens":[500,300],"bytes":[4000,2400]}';
  it("counts requests and skips blank lines", () => {
    expect(checkTrace(`${line}\n\n${line}\n`)).toEqual({ requests: 2 });
  });
  it("names the first bad line", () => {
    expect(checkTrace(`${line}\n{"tenant":"x","segments":["a"],"tokens":[1,2],"bytes":[1]}`)).toEqual({
      field: "trace",
      message: "line 2: tokens must list one non-negative integer per segment (1)",
    });
    expect(checkTrace("nope")).toEqual({ field: "trace", message: "line 1: not JSON" });
    expect(checkTrace('{"segments":[],"tokens":[],"bytes":[]}')).toMatchObject({ message: "line 1: tenant must be a string" });
    expect(checkTrace('{"tenant":"a","segments":["a"],"tokens":[-1],"bytes":[1]}')).toMatchObject({ field: "trace" });
    expect(checkTrace("\n")).toEqual({ field: "trace", message: "the trace has no request" });
  });
});

describe("ids and capacity", () => {
  it("checks ids like the catalog", () => {
    expect(checkId("id", "zentrix.v1:a-b_c")).toBeNull();
    expect(checkId("id", "")).not.toBeNull();
    expect(checkId("id", "a b")).not.toBeNull();
    expect(checkId("id", "x".repeat(129))).not.toBeNull();
  });
  it("wants a positive integer capacity", () => {
    expect(checkCapacity("8000")).toEqual({ bytes: 8000 });
    expect(isError(checkCapacity("0"))).toBe(true);
    expect(isError(checkCapacity("1.5"))).toBe(true);
    expect(isError(checkCapacity("x"))).toBe(true);
  });
});

describe("segment ids in the route", () => {
  it("decodes ids and addresses", () => {
    expect(segmentIdOf("kb-doc")).toBe("kb-doc");
    expect(segmentIdOf("%7E60d346af")).toBe("~60d346af");
    expect(segmentIdOf("caf%C3%A9")).toBe("café");
  });
  it("refuses what is not an id instead of throwing or calling another route", () => {
    for (const bad of ["%E0%A4%A", "%", "", ".", "..", "%2E%2E", "a%2Fb"]) {
      expect(segmentIdOf(bad)).toBeNull();
    }
  });
});
