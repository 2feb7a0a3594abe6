// Readable text for the "Why did it miss?" view (GET /v1/segments/{id}/why).
import type { PolicyRef, Prefilled, WhyAnswer, WhyReason } from "./api";
import { bytes } from "./metrics";

/** Short titles of the reason codes the API documents. */
export const REASON_TITLES: Record<string, string> = {
  never_seen: "Never seen",
  evicted: "Evicted for space",
  invalidated: "Removed (invalidated)",
  checksum_failure: "Dropped: checksum failure",
  not_admitted: "Not admitted",
  no_room: "No room",
  too_short_for_seam: "Too short for the seam window",
  no_permission: "No permission",
  superseded_version: "Superseded version",
  deleted: "Segment deleted",
  evicted_on_request: "Evicted on request",
};

/** The policy as one phrase: `eviction policy #3 (lru-ui v1)`, or its name. */
export function policyText(p: PolicyRef | null | undefined): string {
  if (!p) return "";
  if (p.policy_name && p.policy_version != null) return `${p.name} (${p.policy_name} v${p.policy_version})`;
  return p.name;
}

/** The title of a reason (its code when the console does not know it). */
export function reasonTitle(r: WhyReason): string {
  return REASON_TITLES[r.code] ?? r.code;
}

/** The entry a reason concerns, as words. */
export function entryText(bodyStart: number | null | undefined): string {
  if (bodyStart == null) return "";
  return bodyStart === 0 ? "used first (whole segment)" : `used after another segment (body from token ${bodyStart})`;
}

/** One line summing up an answer: resident, or the newest reason. */
export function verdict(a: WhyAnswer): string {
  const cacheable = a.entries.filter((e) => e.cacheable);
  const resident = cacheable.filter((e) => e.tier);
  if (cacheable.length > 0 && resident.length === cacheable.length)
    return `Resident for ${a.tenant}: ${resident.map((e) => `${e.tier} (${entryText(e.body_start)})`).join(", ")}`;
  const first = a.reasons[0];
  if (!first) return `Not resident for ${a.tenant}`;
  const partly = resident.length > 0 ? "Partly resident; " : "";
  return `${partly}${reasonTitle(first)}: ${first.message}`;
}

/** What a prefill did, as one line: `body start 0: stored (1.2 KiB); body start 8: already resident`. */
export function prefillText(r: Prefilled): string {
  const words: Record<string, string> = {
    stored: "stored",
    present: "already resident",
    refused: "refused by the pool (admission policy or no room)",
    not_needed: "not needed (no longer than the seam window)",
  };
  const rows = r.prefill.entries.map((e) => {
    if (e.error) return `body start ${e.body_start}: failed: ${e.error}`;
    const st = words[e.status ?? ""] ?? e.status ?? "?";
    return e.status === "stored" && e.bytes != null
      ? `body start ${e.body_start}: ${st} (${bytes(e.bytes)})`
      : `body start ${e.body_start}: ${st}`;
  });
  return `v${r.version} for ${r.prefill.shared ? "every tenant (shared)" : `tenant ${r.tenant}`}, ${r.prefill.prefill_ms.toFixed(0)} ms — ${rows.join("; ")}`;
}
