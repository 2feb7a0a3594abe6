// The segment list's rows: their keys, the reference a row's link opens, and the
// residency, hits and last-use cells (GET /v1/segments answers them per row).
import type { Segment, SegmentRow } from "./api";

/** Who is looking: the tenant of the signed-in token and its role. */
export interface Viewer {
  tenant: string;
  role: string;
}

/**
 * A row's key: owner tenant and id. Ids are unique per owner only, so two tenants'
 * segment `doc` are two rows (an operator sees both); a row without an owner (a
 * tenant's view of another tenant's segment) is keyed by its address, which is
 * then its id.
 */
export function rowKey(s: Pick<SegmentRow, "id" | "address" | "owner_tenant">): string {
  return s.owner_tenant ? `${s.owner_tenant}/${s.id}` : `~/${s.address}`;
}

/**
 * What a row's link addresses the segment by: its id when the viewer's tenant owns
 * it (ids resolve in the caller's own namespace), else its address (another
 * tenant's `doc` is not the viewer's `doc`).
 */
export function rowRef(s: Pick<SegmentRow, "id" | "address" | "owner_tenant">, me: Viewer): string {
  return !s.owner_tenant || s.owner_tenant === me.tenant ? s.id : s.address;
}

/** The label of a segment: `owner/id` when another tenant owns it, else its id. */
export function segmentLabel(s: Pick<SegmentRow, "id" | "owner_tenant">, me: Viewer): string {
  return s.owner_tenant && s.owner_tenant !== me.tenant ? `${s.owner_tenant}/${s.id}` : s.id;
}

type Residency = SegmentRow["residency"];

/** Residency in words: resident (shared), resident, not resident, or unknown (—). */
export function residencyText(r: Residency | undefined): string {
  if (!r) return "—";
  return r.resident ? (r.shared ? "resident (shared)" : "resident") : "not resident";
}

/** The residency of a detail answer (`hypic.residency`). */
export function segmentResidency(s: Segment): string {
  return residencyText(s.hypic?.residency);
}

/** Hits of a row's resident entries; — when no entry tells (none resident, or hidden from a tenant). */
export function hitsText(s: Pick<SegmentRow, "hits">): string {
  return s.hits === null || s.hits === undefined ? "—" : String(s.hits);
}
