// Line diff between two versions of a segment's content, for the Segments screen.
import { diffLines } from "diff";

/** One line of a diff: kept, removed from the older text, or added in the newer. */
export interface DiffLine {
  kind: "same" | "del" | "add";
  text: string;
}

/**
 * The line-by-line difference from `older` to `newer` (Myers diff, from the `diff`
 * package). Every line of both texts appears once, in order; a missing final newline
 * does not create an empty line.
 */
export function lineDiff(older: string, newer: string): DiffLine[] {
  const out: DiffLine[] = [];
  for (const part of diffLines(older, newer)) {
    const kind = part.added ? "add" : part.removed ? "del" : "same";
    const lines = part.value.split("\n");
    if (lines.length > 1 && lines[lines.length - 1] === "") lines.pop();
    for (const text of lines) out.push({ kind, text });
  }
  return out;
}

/** Counts of added and removed lines in a diff. */
export function diffStat(d: DiffLine[]): { added: number; removed: number } {
  return {
    added: d.filter((l) => l.kind === "add").length,
    removed: d.filter((l) => l.kind === "del").length,
  };
}
