// Request and response types of the HYPIC REST API used by the console, and the
// one function that calls it. Every type is taken from src/api.gen.ts, generated
// from the server's OpenAPI document (`npm run gen:api`; a vitest and a Rust test
// fail when either is stale). Where the document gives a field as a free-form
// JSON object (parameters, metrics), the generator types it as an object with no
// keys; those fields are widened to `Record<string, unknown>` here, nothing else.
import type { components, operations } from "./api.gen";
import type { ParamSchema, ParamValue } from "./params";

type Schemas = components["schemas"];

/** The JSON answer of a 200 of operation `O`. */
type Answer<O extends keyof operations> = operations[O] extends { responses: { 200: { content: { "application/json": infer T } } } }
  ? T
  : never;

/** `T` with the free-form object fields `K` typed as JSON objects. */
type Free<T, K extends keyof T> = Omit<T, K> & { [P in K]: Record<string, unknown> };

/** OpenAI-style error body: `{"error": {...}}`. */
export type ApiErrorBody = Schemas["ErrorDetail"];

/** `GET /v1/whoami`. */
export type Principal = Schemas["Principal"];

/** A catalog segment as the caller may see it, with what the served model makes of it (`GET /v1/segments/{id}`, `POST /v1/segments`). */
export type Segment = Schemas["ServedSegment"];

/** The `hypic` extension of a segment on the serving router. */
export type SegmentServing = Schemas["SegmentServing"];

/** One row of `GET /v1/segments`: the current version, its residency, hits and last use. */
export type SegmentRow = Schemas["ServedSegmentRow"];

/** `GET /v1/segments`. */
export type SegmentList = Schemas["ServedSegmentList"];

/** Body of `POST /v1/segments`. */
export type NewSegment = Schemas["CreateSegmentBody"];

/** `GET /v1/segments/{id}/grants`: the tenants granted the segment. */
export type Grants = Answer<"list_grants">;

/** `GET /v1/segments/{id}/group-grants`: the groups granted the segment. */
export type GroupGrants = Answer<"list_group_grants">;

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
export type Group = Schemas["Group"];

/** Hook kinds of a policy. */
export const POLICY_KINDS = ["admission", "eviction", "invalidation", "isolation"] as const;
export type PolicyKind = (typeof POLICY_KINDS)[number];

/** One row of `GET /v1/admin/policies` (`params`: a JSON object, as text). */
export type PolicyRecord = Schemas["PolicyRecord"];

/** Body of `POST /v1/admin/policies`. */
export type UploadPolicy = Free<Schemas["UploadPolicy"], "params">;

/** `POST /v1/admin/policies/{id}/activate`. */
export type Activated = Free<Schemas["Activated"], "params">;

/** `POST /v1/admin/policies/rollback`: the policy now active and the one before. */
export type RolledBack = Schemas["RolledBack"];

/** Replay statistics of a dry run (`crate::sim::SimStats`). */
export type SimStats = Schemas["SimStats"];

/** One tenant's share of a dry-run replay (`crate::sim::TenantSimStats`). */
export type TenantSimStats = Schemas["TenantSimStats"];

/** `POST /v1/admin/policies/{id}/dry-run`. */
export type DryRunResult = Schemas["DryRunResult"];

/** `GET /v1/admin/traffic` (operator; `hypic serve` only): recent prompts as a trace. */
export type RecordedTraffic = Schemas["RecordedTraffic"];

/** `GET /v1/admin/policies/stats`: active policy and rollback target per kind, counters. */
export type PolicyStats = Free<Schemas["PolicyStats"], "metrics">;

/** One row of `GET /v1/admin/audit` (`detail`: JSON, as text). */
export type AuditEntry = Schemas["AuditEntry"];

/** Query of `GET /v1/admin/audit`. */
export type AuditQuery = NonNullable<operations["audit_log"]["parameters"]["query"]>;

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
    let err: ApiErrorBody = { message: text || r.statusText, type: "", param: null, code: "" };
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

/**
 * `GET /v1/admin/policies/{id}`: a version with its declared parameters and module
 * contents. The schema is the generated one read through src/params.ts's type
 * (the same shape, with its parameter types as a union the form switches on).
 */
export type PolicyDetail = Omit<Schemas["PolicyDetail"], "param_schema" | "effective_params"> & {
  /** Null: the module declares no schema (ABI v1 integer parameters). */
  param_schema?: ParamSchema | null;
  /** Stored parameters completed with the defaults. */
  effective_params?: Record<string, ParamValue> | null;
};

/** Answers of one policy over the calls a shadow saw (only its kind's fields move). */
export type DecisionCounts = Schemas["DecisionCounts"];

/** `GET /v1/admin/policies/shadow[/{kind}]`: a shadow and the active policy's answers to the same calls. */
export type ShadowView = Free<Schemas["ShadowView"], "params">;

/** Serving counters of a tenant since the server started. */
export type ServingUsage = Schemas["ServingUsage"];

/** `GET /v1/admin/tenants` rows and `GET /v1/tenants/{tenant}/usage`. */
export type TenantView = Schemas["TenantView"];
