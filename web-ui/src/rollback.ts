// Where a policy rollback goes, in words (GET /v1/admin/policies/stats answers
// `rollback_to` per kind: the latest earlier policy that differs from the active
// one, null for the native default; absent when there is nothing to roll back to).
import type { PolicyRecord, PolicyStats } from "./api";

/** A policy version in words: `#3 lru v2`, or the native default. */
export function policyName(id: number | null | undefined, all: PolicyRecord[]): string {
  if (id === null || id === undefined) return "the native default";
  const p = all.find((x) => x.id === id);
  return p ? `#${p.id} ${p.name} v${p.version}` : `#${id}`;
}

/**
 * The rollback of `kind`: whether there is one, and where it goes. `stats` may
 * not be loaded yet (then no rollback is offered).
 */
export function rollbackTarget(kind: string, stats: PolicyStats | null, all: PolicyRecord[]): { possible: boolean; to: string } {
  const targets = stats?.rollback_to ?? {};
  if (!Object.prototype.hasOwnProperty.call(targets, kind)) return { possible: false, to: "" };
  return { possible: true, to: policyName(targets[kind], all) };
}
