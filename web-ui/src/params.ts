// Policy parameter schemas (ABI v2, policies/ABI.md): reading the `hypic.params`
// custom section of a module chosen in the file picker, and checking form values
// against a schema with the server's rules (control/src/policy/params.rs). The
// server checks again; its answer is authoritative.
import type { FieldError } from "./validate";

/** One declared parameter (`ParamSpec` of the API). */
export type ParamSpec = { name: string; description?: string } & (
  | { type: "int"; min?: number; max?: number; default: number }
  | { type: "float"; min?: number; max?: number; default: number }
  | { type: "bool"; default: boolean }
  | { type: "string"; max_len?: number; default: string }
  | { type: "enum"; choices: string[]; default: string }
);

/** The parameters a module declares (`{"params": [...]}`). */
export interface ParamSchema {
  params: ParamSpec[];
}

/** A parameter value as the API takes it. */
export type ParamValue = number | boolean | string;

/** Default and largest `max_len` of a string parameter, bytes. */
export const MAX_STRING_LEN = 256;

const NAME_RE = /^[A-Za-z0-9_]{1,64}$/;
// Control characters (line breaks included), refused in strings and choices.
// eslint-disable-next-line no-control-regex
// Control, line-break, bidirectional and zero-width characters (the server refuses them).
const CONTROL_RE = /[\u0000-\u001f\u007f-\u009f\u061c\u200b-\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029\ufeff]/;

function leb(b: Uint8Array, at: number): [number, number] {
  let v = 0;
  let shift = 0;
  for (let i = at; i < b.length && shift < 35; i++) {
    v += (b[i] & 0x7f) * 2 ** shift;
    shift += 7;
    if (b[i] < 0x80) return [v, i + 1];
  }
  throw new Error("truncated LEB128 number");
}

/**
 * The contents of the custom section `name` of a Wasm binary module, or null
 * when it has none. Throws on a module whose section headers do not parse.
 */
export function customSection(bytes: Uint8Array, name: string): Uint8Array | null {
  let i = 8;
  while (i < bytes.length) {
    const id = bytes[i];
    const [size, start] = leb(bytes, i + 1);
    const end = start + size;
    if (end > bytes.length) throw new Error("a section runs past the end of the module");
    if (id === 0) {
      const [len, at] = leb(bytes, start);
      const n = new TextDecoder().decode(bytes.subarray(at, at + len));
      if (n === name) return bytes.subarray(at + len, end);
    }
    i = end;
  }
  return null;
}

/**
 * The parameter schema a module declares (its `hypic.params` section), null
 * when it has none, or a {@link FieldError} on `wasm` naming the problem.
 */
export function readSchema(bytes: Uint8Array): ParamSchema | null | FieldError {
  let sec: Uint8Array | null;
  try {
    sec = customSection(bytes, "hypic.params");
  } catch (e) {
    return { field: "wasm", message: `not a Wasm module: ${(e as Error).message}` };
  }
  if (sec === null) return null;
  let v: unknown;
  try {
    v = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(sec));
  } catch (e) {
    return { field: "wasm", message: `invalid parameter schema: ${(e as Error).message}` };
  }
  const bad = checkSchema(v);
  return bad ?? (v as ParamSchema);
}

/** Checks a schema like the server at upload; the first problem, or null. */
export function checkSchema(v: unknown): FieldError | null {
  const err = (message: string): FieldError => ({ field: "wasm", message: `invalid parameter schema: ${message}` });
  if (!v || typeof v !== "object" || !Array.isArray((v as ParamSchema).params))
    return err('expected {"params": [...]}');
  const ps = (v as ParamSchema).params;
  if (ps.length > 64) return err(`${ps.length} parameters declared, at most 64`);
  const seen = new Set<string>();
  for (let i = 0; i < ps.length; i++) {
    const p = ps[i] as ParamSpec;
    const at = `params[${i}] (${JSON.stringify(p?.name)})`;
    if (!p || typeof p.name !== "string" || !NAME_RE.test(p.name))
      return err(`${at}: name must be 1 to 64 characters of [A-Za-z0-9_]`);
    if (seen.has(p.name)) return err(`${at}: declared twice`);
    seen.add(p.name);
    if (!("default" in p)) return err(`${at}: missing field \`default\``);
    const dflt = checkValue(p, p.default as ParamValue);
    if (p.type === "int" || p.type === "float") {
      if (p.min !== undefined && p.max !== undefined && p.min > p.max)
        return err(`${at}: min ${p.min} is above max ${p.max}`);
    } else if (p.type === "enum") {
      if (!Array.isArray(p.choices) || p.choices.length === 0 || p.choices.length > 64)
        return err(`${at}: choices must list 1 to 64 values`);
      if (new Set(p.choices).size !== p.choices.length) return err(`${at}: a choice is listed twice`);
    } else if (p.type !== "bool" && p.type !== "string") {
      return err(`${at}: unknown type ${JSON.stringify((p as { type: unknown }).type)}`);
    }
    if (dflt) return err(`${at}: default ${JSON.stringify(p.default)} ${dflt.message.slice(p.name.length + 1)}`);
  }
  return null;
}

/** Checks one typed value against its spec; a {@link FieldError} on `params.<name>`, or null. */
export function checkValue(p: ParamSpec, v: ParamValue): FieldError | null {
  const field = `params.${p.name}`;
  const bad = (message: string): FieldError => ({ field, message: `${p.name} ${message}` });
  switch (p.type) {
    case "int":
      if (typeof v !== "number" || !Number.isSafeInteger(v)) return bad(`must be an integer (allowed: ${rangeText(p)})`);
      break;
    case "float":
      if (typeof v !== "number" || !Number.isFinite(v)) return bad(`must be a finite number (allowed: ${rangeText(p)})`);
      break;
    case "bool":
      return typeof v === "boolean" ? null : bad("must be true or false");
    case "string": {
      if (typeof v !== "string") return bad("must be a string");
      const cap = p.max_len ?? MAX_STRING_LEN;
      const len = new TextEncoder().encode(v).length;
      if (len > cap) return bad(`is ${len} bytes, over ${cap}`);
      if (CONTROL_RE.test(v)) return bad("must not contain control, line-break, bidirectional or zero-width characters");
      return null;
    }
    case "enum":
      return typeof v === "string" && p.choices.includes(v) ? null : bad(`must be one of ${p.choices.join(", ")}`);
  }
  if (p.min !== undefined && v < p.min) return bad(`is below the minimum ${p.min} (allowed: ${rangeText(p)})`);
  if (p.max !== undefined && v > p.max) return bad(`is above the maximum ${p.max} (allowed: ${rangeText(p)})`);
  return null;
}

/** The allowed range of a number parameter in words, as the server writes it: `from 0 to 100`, `0 or more`, `at most 100`, `any value`. */
export function rangeText(p: { min?: number; max?: number }): string {
  if (p.min !== undefined && p.max !== undefined) return `from ${p.min} to ${p.max}`;
  if (p.min !== undefined) return `${p.min} or more`;
  if (p.max !== undefined) return `at most ${p.max}`;
  return "any value";
}

/**
 * Form text of every parameter (checkbox state as "true"/"false") turned into
 * typed values and checked: the params object to send, or the first bad field.
 * Empty text of a numeric or string field means "the default".
 */
export function parseForm(
  schema: ParamSchema,
  text: Record<string, string>,
): { params: Record<string, ParamValue> } | FieldError {
  const out: Record<string, ParamValue> = {};
  for (const p of schema.params) {
    const raw = text[p.name];
    if (raw === undefined) continue;
    let v: ParamValue;
    if (p.type === "int" || p.type === "float") {
      const t = raw.trim();
      if (t === "") continue;
      v = Number(t);
      if (Number.isNaN(v)) return { field: `params.${p.name}`, message: `${p.name} must be a number` };
    } else if (p.type === "bool") {
      v = raw === "true";
    } else {
      v = raw;
    }
    const bad = checkValue(p, v);
    if (bad) return bad;
    out[p.name] = v;
  }
  return { params: out };
}

/** Form text of the parameters: `values` where given, else the defaults. */
export function formText(schema: ParamSchema, values?: Record<string, unknown> | null): Record<string, string> {
  const out: Record<string, string> = {};
  for (const p of schema.params) {
    const v = values && p.name in values ? values[p.name] : p.default;
    out[p.name] = String(v);
  }
  return out;
}

/** A short description of a parameter's type and constraints, for the form. */
export function describe(p: ParamSpec): string {
  switch (p.type) {
    case "int":
    case "float": {
      const lo = p.min !== undefined ? `${p.min} ≤ ` : "";
      const hi = p.max !== undefined ? ` ≤ ${p.max}` : "";
      return `${p.type}${lo || hi ? `, ${lo}x${hi}` : ""}; default ${p.default}`;
    }
    case "bool":
      return `bool; default ${p.default}`;
    case "string":
      return `string, at most ${p.max_len ?? MAX_STRING_LEN} bytes; default ${JSON.stringify(p.default)}`;
    case "enum":
      return `one of ${p.choices.join(", ")}; default ${p.default}`;
  }
}
