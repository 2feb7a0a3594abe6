// Client-side checks run before a request is sent. The server validates again
// and its answer is authoritative; these only catch what can be told locally,
// naming the form field like the API's `param`.

/** A problem with one form field. */
export interface FieldError {
  field: string;
  message: string;
}

const ID_RE = /^[A-Za-z0-9._:-]{1,128}$/;

/** Segment and group ids: 1..=128 characters of `[A-Za-z0-9._:-]` (as the catalog). */
export function checkId(field: string, v: string): FieldError | null {
  if (!ID_RE.test(v))
    return { field, message: `${field} must be 1 to 128 characters of A-Z a-z 0-9 . _ : -` };
  return null;
}

/**
 * Policy parameters: a JSON object of integers (the policy ABI passes
 * parameters as i64). Empty text is `{}`.
 */
export function parseParams(text: string): { params: Record<string, number> } | FieldError {
  const t = text.trim();
  if (t === "") return { params: {} };
  let v: unknown;
  try {
    v = JSON.parse(t);
  } catch (e) {
    return { field: "params", message: `params is not JSON: ${(e as Error).message}` };
  }
  if (v === null || typeof v !== "object" || Array.isArray(v))
    return { field: "params", message: "params must be a JSON object" };
  const out: Record<string, number> = {};
  for (const [k, x] of Object.entries(v as Record<string, unknown>)) {
    if (typeof x !== "number" || !Number.isSafeInteger(x))
      return { field: `params.${k}`, message: `params.${k} must be an integer` };
    out[k] = x;
  }
  return { params: out };
}

/** The first 8 bytes of every Wasm module: `\0asm` and binary version 1. */
const WASM_MAGIC = [0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00];

/** A policy module chosen in the file picker: non-empty, under `maxBytes`, Wasm magic. */
export function checkWasm(bytes: Uint8Array, maxBytes: number): FieldError | null {
  if (bytes.length === 0) return { field: "wasm", message: "the file is empty" };
  if (bytes.length > maxBytes)
    return { field: "wasm", message: `the module is ${bytes.length} bytes, over ${maxBytes}` };
  if (bytes.length < 8 || WASM_MAGIC.some((b, i) => bytes[i] !== b))
    return { field: "wasm", message: "not a WebAssembly binary module (bad magic or version)" };
  return null;
}

/**
 * A dry-run trace: JSONL, one request per line with `tenant` (string),
 * `segments` (ids), and `tokens` and `bytes` of the same length as `segments`.
 * Returns the number of requests, or the first bad line.
 */
export function checkTrace(text: string): { requests: number } | FieldError {
  let n = 0;
  const lines = text.split("\n");
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i].trim();
    if (line === "") continue;
    const at = `line ${i + 1}`;
    let r: Record<string, unknown>;
    try {
      r = JSON.parse(line);
    } catch {
      return { field: "trace", message: `${at}: not JSON` };
    }
    if (r === null || typeof r !== "object" || Array.isArray(r))
      return { field: "trace", message: `${at}: not a JSON object` };
    if (typeof r.tenant !== "string") return { field: "trace", message: `${at}: tenant must be a string` };
    const segs = r.segments;
    if (!Array.isArray(segs) || segs.some((s) => typeof s !== "string"))
      return { field: "trace", message: `${at}: segments must be a list of ids` };
    for (const k of ["tokens", "bytes"]) {
      const a = r[k];
      if (!Array.isArray(a) || a.length !== segs.length || a.some((x) => !Number.isInteger(x) || x < 0))
        return {
          field: "trace",
          message: `${at}: ${k} must list one non-negative integer per segment (${segs.length})`,
        };
    }
    n++;
  }
  if (n === 0) return { field: "trace", message: "the trace has no request" };
  return { requests: n };
}

/** Simulated capacity for a dry run: a positive integer number of bytes. */
export function checkCapacity(text: string): { bytes: number } | FieldError {
  const n = Number(text.trim());
  if (!Number.isSafeInteger(n) || n <= 0)
    return { field: "capacity_bytes", message: "capacity_bytes must be a positive integer" };
  return { bytes: n };
}

/** True when `v` is a {@link FieldError}. */
export function isError(v: unknown): v is FieldError {
  return typeof v === "object" && v !== null && "field" in v && "message" in v;
}

/**
 * The segment id of a `#/segments/{id}` route part, or `null` when it is not one:
 * malformed percent-encoding, empty, or `.` / `..` (the browser would collapse them
 * in the API path and call another route).
 */
export function segmentIdOf(part: string): string | null {
  let id: string;
  try {
    id = decodeURIComponent(part);
  } catch {
    return null;
  }
  if (id === "" || id === "." || id === ".." || id.includes("/")) return null;
  return id;
}
