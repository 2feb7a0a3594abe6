// Request and response types of the HYPIC REST API used by the console, and the
// one function that calls it. Types the OpenAPI document describes as schemas are
// taken from src/api.gen.ts, generated from it (`npm run gen:api`; a vitest and a
// Rust test fail when either is stale); the others are written by hand to mirror
// the Rust handlers (control/src/api.rs, control/src/serve/routes.rs,
// control/src/serve/history.rs), whose answers the document gives as plain objects.
import type { components } from "./api.gen";

type Schemas = components["schemas"];

/** OpenAI-style error body: `{"error": {...}}`. */
export interface ApiErrorBody {
  message: string;
  type: string;
  param: string | null;
  code: string | null;
}

/** `GET /v1/whoami`. */
export type Principal = Schemas["Principal"];

/** A catalog segment as the caller may see it. */
export interface Segment {
  id: string;
  address: string;
  owner_tenant?: string;
  name: string;
  public: boolean;
  current_version: number;
  content_hash: string;
  byte_len: number;
  tokens: Record<string, number>;
  created_at: number;
  updated_at: number;
  /** Serving router only: token count and cache residency for the served model. */
  hypic?: SegmentServing;
}

/** The `hypic` extension of a segment on the serving router. */
export interface SegmentServing {
  model?: string;
  version?: number;
  tokens?: number;
  residency?: {
    resident: boolean;
    shared: boolean;
    entries: { body_start: number; resident: boolean; bytes: number }[];
  };
  error?: string;
}

/** `GET /v1/segments`. */
export interface SegmentList {
  object: "list";
  data: Segment[];
  next: string | null;
}

/** Body of `POST /v1/segments`. */
export interface NewSegment {
  id: string;
  name?: string;
  content: string;
  public?: boolean;
  prefill?: boolean;
}

/** One row of `GET /v1/segments/{id}/versions`. */
export type SegmentVersion = Schemas["SegmentVersion"];

/** `GET /v1/segments/{id}/versions/{version}`: one version's text. */
export type VersionContent = Schemas["VersionContent"];

/** The policy that decided a cache event (`GET /v1/segments/{id}/why`). */
export type PolicyRef = Schemas["PolicyRef"];
/** One reason a segment's lookup misses. */
export type WhyReason = Schemas["WhyReason"];
/** One event of a cache entry's history. */
export type WhyEvent = Schemas["WhyEvent"];
/** One public-pool entry of a segment in a tenant's namespace. */
export type WhyEntry = Schemas["WhyEntry"];
/** A recent request or segment event. */
export type WhyObservation = Schemas["Observation"];
/** `GET /v1/segments/{id}/why?tenant=&version=`. */
export type WhyAnswer = Schemas["WhyAnswer"];

/** `POST /v1/segments/{id}/evict`. */
export type Evicted = Schemas["Evicted"];

/** One entry of a prefill: `status` and `bytes`, or `error`. */
export type PrefillEntry = Schemas["PrefillEntry"];

/** `POST /v1/segments/{id}/prefill`: what warming the current version did. */
export type Prefilled = Schemas["Prefilled"];

/** `GET /v1/admin/groups` rows: tenants grouped for segment grants. */
export interface Group {
  id: string;
  name: string;
  members: string[];
  created_by: string;
  created_at: number;
}

/** Hook kinds of a policy. */
export const POLICY_KINDS = ["admission", "eviction", "invalidation", "isolation"] as const;
export type PolicyKind = (typeof POLICY_KINDS)[number];

/** One row of `GET /v1/admin/policies`. */
export interface PolicyRecord {
  id: number;
  name: string;
  kind: PolicyKind;
  module_sha256: string;
  /** JSON object, as text. */
  params: string;
  version: number;
  created_by: string;
  created_at: number;
  active: boolean;
}

/** Body of `POST /v1/admin/policies`. */
export interface UploadPolicy {
  name: string;
  kind: PolicyKind;
  wasm_base64: string;
  params: Record<string, unknown>;
}

/** Replay statistics of a dry run (`crate::sim::SimStats`). */
export type SimStats = Schemas["SimStats"];

/** One tenant's share of a dry-run replay (`crate::sim::TenantSimStats`). */
export type TenantSimStats = Schemas["TenantSimStats"];

/** `POST /v1/admin/policies/{id}/dry-run`. */
export interface DryRunResult {
  policy_id: number;
  kind: PolicyKind;
  candidate: SimStats;
  active: SimStats;
  hit_ratio_delta: number;
  recompute_tokens_delta: number;
}

/** `GET /v1/admin/traffic` (operator; `hypic serve` only): recent prompts as a trace. */
export interface RecordedTraffic {
  requests: number;
  capacity: number;
  /** JSONL in the dry-run trace format, oldest first. */
  trace: string;
}

/** `GET /v1/admin/policies/stats` (only `active` is typed; the rest is shown as is). */
export interface PolicyStats {
  active: Record<PolicyKind, number | null>;
  metrics: unknown;
  module_compiles: number;
  modules_cached: number;
}

/** One row of `GET /v1/admin/audit`. */
export interface AuditEntry {
  id: number;
  at: number;
  actor: string;
  tenant: string | null;
  action: string;
  target: string;
  /** JSON, as text. */
  detail: string;
}

/** Query of `GET /v1/admin/audit`. */
export interface AuditQuery {
  action?: string;
  actor?: string;
  since_ms?: number;
  until_ms?: number;
  limit?: number;
}

/** One storage tier of a pool in a metrics sample. */
export type TierSample = Schemas["TierSample"];

/** One cache pool in a metrics sample; `tiers` has only the tiers the backend has. */
export type PoolSample = Schemas["PoolSample"];

/** TTFT quantiles (ms) of one mode over an interval. */
export type Quantiles = Schemas["Quantiles"];

/** One metrics sample; counters are cumulative since the server started. */
export type MetricSample = Schemas["MetricSample"];

/** `GET /v1/metrics/history` (operator; `hypic serve` only). */
export type MetricsHistory = Schemas["MetricsHistory"];

/** An error answer of the API, kept verbatim for display. */
export class ApiError extends Error {
  constructor(
    public status: number,
    public body: ApiErrorBody,
  ) {
    super(body.message);
  }
}

const TOKEN_KEY = "hypic.token";

/** The bearer token of this browser tab (session storage only). */
export function getToken(): string | null {
  return sessionStorage.getItem(TOKEN_KEY);
}

/** Stores (or, with `null`, forgets) the bearer token for this tab. */
export function setToken(t: string | null): void {
  if (t === null) sessionStorage.removeItem(TOKEN_KEY);
  else sessionStorage.setItem(TOKEN_KEY, t);
}

/**
 * Calls the API with the tab's token. Resolves to the parsed JSON body; an
 * answer that is not 2xx rejects with an {@link ApiError} carrying the server's
 * error object unchanged (a non-JSON error body becomes its `message`).
 */
export async function api<T>(method: string, path: string, body?: unknown): Promise<T> {
  const headers: Record<string, string> = {};
  const token = getToken();
  if (token) headers["authorization"] = `Bearer ${token}`;
  if (body !== undefined) headers["content-type"] = "application/json";
  const r = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "omit",
    cache: "no-store",
  });
  const text = await r.text();
  if (!r.ok) {
    let err: ApiErrorBody = { message: text || r.statusText, type: "", param: null, code: null };
    try {
      const j = JSON.parse(text);
      if (j && typeof j.error === "object") err = j.error;
    } catch {
      // not JSON: the text itself is the message
    }
    throw new ApiError(r.status, err);
  }
  return (text ? JSON.parse(text) : null) as T;
}

/** `?a=1&b=x` from the set fields of `q` (empty string when none). */
export function query(q: Record<string, string | number | undefined>): string {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(q)) if (v !== undefined && v !== "") p.set(k, String(v));
  const s = p.toString();
  return s ? `?${s}` : "";
}

// ---- policy detail, shadow mode, tenants (control/src/policy_api.rs, tenants_api.rs)

/** `GET /v1/admin/policies/{id}`: a version with its declared parameters and module contents. */
export interface PolicyDetail extends PolicyRecord {
  /** Null: the module declares no schema (ABI v1 integer parameters). */
  param_schema: import("./params").ParamSchema | null;
  /** Stored parameters completed with the defaults. */
  effective_params: Record<string, import("./params").ParamValue> | null;
  module: {
    bytes: number;
    exports: { name: string; kind: string }[];
    imports: number;
    functions: number;
    code_bytes: number;
    memory_min_pages: number | null;
    custom_sections: { name: string; bytes: number }[];
  };
}

/** Answers of one policy over the calls a shadow saw (only its kind's fields move). */
export interface DecisionCounts {
  calls: number;
  faults: number;
  admitted: number;
  rejected: number;
  admitted_bytes: number;
  evictions: number;
  victim_bytes: number;
  victim_recompute_tokens: number;
  dropped: number;
  kept: number;
  shared: number;
  private: number;
}

/** `GET /v1/admin/policies/shadow[/{kind}]`: a shadow and the active policy's answers to the same calls. */
export interface ShadowView {
  kind: PolicyKind;
  policy_id: number;
  params: Record<string, unknown>;
  started_at: number;
  started_by: string;
  active_policy_id: number | null;
  candidate: DecisionCounts;
  active: DecisionCounts;
  agreed: number;
  disagreed: number;
  tripped: boolean;
}

/** Serving counters of a tenant since the server started. */
export interface ServingUsage {
  requests: number;
  prompt_tokens: number;
  cached_tokens: number;
  completion_tokens: number;
  segment_hits: number;
  segment_misses: number;
  last_request_at: number | null;
}

/** `GET /v1/admin/tenants` rows and `GET /v1/tenants/{tenant}/usage`. */
export interface TenantView {
  tenant: string;
  principals: { sub: string; role: "tenant" | "operator" }[];
  groups: string[];
  catalog: { segments: number; segment_bytes: number; granted_segments: number; group_granted_segments: number };
  serving: ServingUsage;
}
