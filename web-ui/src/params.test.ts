// @ts-ignore -- vitest runs in Node; the console has no Node types installed
import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { checkSchema, checkValue, customSection, formText, parseForm, rangeText, readSchema, type ParamSchema } from "./params";

const schema: ParamSchema = {
  params: [
    { name: "limit", type: "int", min: 1, max: 10, default: 3, description: "how many" },
    { name: "ratio", type: "float", min: 0, max: 1, default: 0.5 },
    { name: "strict", type: "bool", default: false },
    { name: "label", type: "string", max_len: 8, default: "x" },
    { name: "mode", type: "enum", choices: ["lru", "lfu"], default: "lru" },
  ],
};

/** A module of only a header and one custom section `name` with `body`. */
function moduleWith(name: string, body: string): Uint8Array {
  const enc = new TextEncoder();
  const n = enc.encode(name);
  const b = enc.encode(body);
  const content = [n.length, ...n, ...b];
  if (content.length > 127) throw new Error("test helper: one-byte sizes only");
  return new Uint8Array([0, 0x61, 0x73, 0x6d, 1, 0, 0, 0, 0, content.length, ...content]);
}

describe("parseForm", () => {
  it("types the form text and keeps what is set", () => {
    const t = formText(schema);
    expect(t).toEqual({ limit: "3", ratio: "0.5", strict: "false", label: "x", mode: "lru" });
    expect(parseForm(schema, { ...t, limit: "7", strict: "true", mode: "lfu" })).toEqual({
      params: { limit: 7, ratio: 0.5, strict: true, label: "x", mode: "lfu" },
    });
    // Empty numeric text: left to the default.
    expect(parseForm(schema, { limit: " " })).toEqual({ params: {} });
  });
  it("names the parameter like the server's 400", () => {
    expect(parseForm(schema, { limit: "11" })).toEqual({ field: "params.limit", message: "limit is above the maximum 10 (allowed: from 1 to 10)" });
    expect(parseForm(schema, { limit: "0" })).toEqual({ field: "params.limit", message: "limit is below the minimum 1 (allowed: from 1 to 10)" });
    expect(parseForm(schema, { limit: "1.5" })).toEqual({ field: "params.limit", message: "limit must be an integer (allowed: from 1 to 10)" });
    expect(parseForm(schema, { limit: "many" })).toEqual({ field: "params.limit", message: "limit must be a number" });
    expect(parseForm(schema, { ratio: "-0.1" })).toMatchObject({ field: "params.ratio", message: "ratio is below the minimum 0 (allowed: from 0 to 1)" });
    expect(parseForm(schema, { label: "123456789" })).toEqual({ field: "params.label", message: "label is 9 bytes, over 8" });
    expect(parseForm(schema, { label: "a\nb" })).toMatchObject({ field: "params.label" });
    expect(parseForm(schema, { mode: "fifo" })).toEqual({ field: "params.mode", message: "mode must be one of lru, lfu" });
  });
  it("states the allowed range of an out-of-range number", () => {
    expect(rangeText({ min: 0 })).toBe("0 or more");
    expect(rangeText({ max: 5 })).toBe("at most 5");
    expect(rangeText({ min: 1, max: 10 })).toBe("from 1 to 10");
    expect(rangeText({})).toBe("any value");
    const ttl: ParamSchema = { params: [{ name: "ttl_ms", type: "int", min: 0, default: 3600000 }] };
    expect(parseForm(ttl, { ttl_ms: "-5" })).toEqual({ field: "params.ttl_ms", message: "ttl_ms is below the minimum 0 (allowed: 0 or more)" });
  });
  it("fills a form from current values", () => {
    expect(formText(schema, { limit: 9, strict: true })).toMatchObject({ limit: "9", strict: "true", mode: "lru" });
  });
});

describe("checkValue", () => {
  it("checks types exactly", () => {
    const [limit, ratio, strict, label] = schema.params;
    expect(checkValue(limit, 10)).toBeNull();
    expect(checkValue(limit, 2 ** 60)).toMatchObject({ message: "limit must be an integer (allowed: from 1 to 10)" });
    expect(checkValue(ratio, Infinity)).toMatchObject({ field: "params.ratio" });
    expect(checkValue(strict, "true")).toMatchObject({ message: "strict must be true or false" });
    expect(checkValue(label, "€€€")).toMatchObject({ message: "label is 9 bytes, over 8" });
  });
});

describe("checkSchema", () => {
  it("accepts every type and names the first problem", () => {
    expect(checkSchema(schema)).toBeNull();
    expect(checkSchema({ params: [] })).toBeNull();
    expect(checkSchema([])).toMatchObject({ field: "wasm" });
    expect(checkSchema({ params: [{ name: "a b", type: "int", default: 1 }] })?.message).toContain("name must be");
    expect(checkSchema({ params: [{ name: "a", type: "int", min: 5, default: 1 }] })?.message).toBe(
      'invalid parameter schema: params[0] ("a"): default 1 is below the minimum 5 (allowed: 5 or more)',
    );
    expect(checkSchema({ params: [{ name: "a", type: "float", min: 1, max: 0, default: 0.5 }] })?.message).toContain(
      "min 1 is above max 0",
    );
    expect(checkSchema({ params: [{ name: "a", type: "enum", choices: ["x"], default: "y" }] })?.message).toContain(
      "must be one of x",
    );
    expect(
      checkSchema({
        params: [
          { name: "a", type: "bool", default: true },
          { name: "a", type: "bool", default: true },
        ],
      })?.message,
    ).toContain("declared twice");
    expect(checkSchema({ params: [{ name: "a", type: "complex", default: 1 }] })?.message).toContain("unknown type");
  });
});

describe("readSchema", () => {
  it("reads the hypic.params custom section", () => {
    const body = JSON.stringify({ params: [{ name: "n", type: "int", default: 2 }] });
    expect(readSchema(moduleWith("hypic.params", body))).toEqual({ params: [{ name: "n", type: "int", default: 2 }] });
    expect(readSchema(moduleWith("other", "{}"))).toBeNull();
    expect(readSchema(moduleWith("hypic.params", "{nope"))).toMatchObject({ field: "wasm" });
    // A section size past the end of the file.
    expect(readSchema(new Uint8Array([0, 0x61, 0x73, 0x6d, 1, 0, 0, 0, 0, 50, 1]))).toMatchObject({ field: "wasm" });
  });
  it("finds the schema of the built-in policies", () => {
    const ttl = new Uint8Array(readFileSync(new URL("../../policies/dist/ttl.wasm", import.meta.url)));
    const s = readSchema(ttl) as ParamSchema;
    expect(s.params.map((p) => p.name)).toEqual(["ttl_ms"]);
    expect(s.params[0]).toMatchObject({ type: "int", min: 0, default: 3600000 });
    const lru = new Uint8Array(readFileSync(new URL("../../policies/dist/lru.wasm", import.meta.url)));
    expect(readSchema(lru)).toEqual({ params: [] });
    expect(customSection(lru, "nothing")).toBeNull();
  });
});
