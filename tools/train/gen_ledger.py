#!/usr/bin/env python3
"""Seeded generator of box-ledger prompts: multi-query associative recall with
overwrites across documents (HYPIC issue 23, the second bundled eval model
`models/hypic-ledger`).

Every prompt is a small store room with 2-4 boxes. Each document is the log of one shift:
an intro sentence, 0-3 **writes** ("Box Brom has the lamp now."), each replacing the box's
item, and a few simple filler sentences (a box opened and closed, an item mentioned, the
weather). The question asks what one box holds *now*, after all the shifts in the order of
the prompt. The reply names the box, then its last-written item:
`Box Brom -> lamp<|im_end|>` (the `bridge -> answer` reply format of gen_corpus.py; the
answer is the text after `->`).

Why it is shaped like this (issue 23's second design; the first one, multi-token names,
40 items, 4 write phrasings, 100-1000-token documents, never learned box->item binding in
~400 M tokens):
- Box names and items are each ONE token of the bundled 4096-token BPE (checked by
  `check_vocab`), so a write is one key token and one value token, as in the
  multi-query associative recall (MQAR) task that small Gated DeltaNet models learn fast.
- In both write phrasings the box name is at most 3 tokens before the item, inside the
  GDN layers' causal conv window (kernel 4), so one layer can form the key from the box
  token and the value from the item token.
- The reply repeats the box name, so the item is predicted 3 tokens after the query key.
- Documents are short (40-150 tokens) and fillers are few and simple.

The answer needs state carried across document boundaries:
- **hop 2 ("overwritten")**: the box is written in 2-4 different documents, so each of
  them is, read alone, a plausible answer; only the order of the documents decides. A
  Gated DeltaNet layer keeps the latest write of a key with its delta rule
  (`(I - beta k k^T)` removes the old value), which is what the cached transition `T_C`
  carries. Naive addition of each document's zero-start state sums the old and new values.
- **hop 1 ("set once")**: the box is written in exactly one document (once, or twice inside
  it); a lookup, kept as the control column.

Every document is meaningful on its own (no pronouns or references to other documents),
so a document prefilled alone (a PIC cache entry) computes the same writes as in context.

The prompt and segment format is that of gen_corpus.py (ChatML; segments
`[S_sys, S_doc_1, ..., S_doc_n, S_q]`, exact substrings, every segment ends with a
newline; tools/README-train.md). Examples carry gen_corpus.py's fields, so train.py,
check_format.py and `hypic eval` read them unchanged, plus ``task: "ledger"``, ``crate``
(the box's name) and ``writes`` (the number of documents writing the queried box).

Example ``index`` of split ``seed`` comes from ``random.Random(f"ledger:{seed}:{index}")``.
Seeds: training 1234, validation 4242, held-out 20261204 (models/hypic-ledger/eval).

CLI:
    python tools/train/gen_ledger.py --seed 20261204 --n 512 --heldout \
        --tokenizer models/hypic-ledger/tokenizer.json --out models/hypic-ledger/eval/heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys

import gen_corpus as gc

TASK = "ledger"

# Box names: each one token with a leading space (" Brom") in the bundled BPE. The items
# in the boxes are drawn fresh for every prompt.
CRATES = ["Brom", "Kral", "Drex", "Flon", "Grix", "Plur", "Trom", "Zeth", "Quix", "Vond",
          "Xyl", "Jux", "Stom", "Shen", "Thal", "Kex", "Vark", "Zond", "Brel", "Dril",
          "Flix", "Gron", "Krun", "Plas", "Tral", "Zark", "Xand", "Jal", "Kor", "Sherk",
          "Stix", "Quen", "Vyx", "Drom", "Fler", "Gril", "Plon", "Zul", "Jeth", "Thux"]
# Items: each one token with a leading space (" lamp").
ITEMS = ["lamp", "kettle", "camera", "bicycle", "drone", "tablet", "tractor", "scooter",
         "clock", "telescope", "headset", "speaker", "watch", "horse", "dog", "cat",
         "rabbit", "parrot", "tortoise", "coffee", "bread", "tea", "glass", "furniture",
         "pottery", "books", "maps", "toy", "machine", "prize", "novel", "stone"]
SHIFTS = ["morning", "night", "quiet", "busy", "old", "new"]
WEATHER = ["cold", "hot", "rainy", "windy", "mild", "dry"]

# Two write phrasings, the box name first and at most 3 tokens before the item.
WRITE_TEMPLATES = [
    "Box {c} has the {v} now.",
    "The staff gave Box {c} the {v}.",
]
BRIDGE = "Box {c}"  # the reply names the box first: "Box Brom -> lamp"


def write_sentence(rng, crate: str, item: str) -> str:
    return WRITE_TEMPLATES[0 if rng.random() < 0.6 else 1].format(c=crate, v=item)


def filler_sentence(rng, crates: list[str]) -> str:
    """A sentence that changes no box; it may name a box or an item, never both."""
    k = rng.randrange(5)
    if k == 0:
        return f"Box {rng.choice(crates)} was opened and closed again."
    if k == 1:
        return f"A customer asked about the {rng.choice(ITEMS)}."
    if k == 2:
        return f"The staff found the {rng.choice(ITEMS)} on the floor."
    if k == 3:
        return f"The weather was {rng.choice(WEATHER)}."
    return f"The {rng.choice(SHIFTS)} staff had a break."


def intro_sentence(rng) -> str:
    return f"Log of the {rng.choice(SHIFTS)} shift."


SYSTEM_PROMPTS = [
    "Read the shift logs in order. A box holds one item; a new item replaces the old one. Answer with the box and its item.",
    "The logs are in the order they happened. Say which item each box has at the end.",
]


def question_text(rng, crate: str) -> str:
    return rng.choice([f"What is in Box {crate} now?", f"What does Box {crate} have now?"])


def bridge_text(crate: str) -> str:
    return BRIDGE.format(c=crate)


DOC_MIN, DOC_MAX = 40, 150  # tokens; longer than the largest seam window evaluated (32)


def write_document(rng, writes: list[tuple[str, str]], crates, count, target, doc_min=DOC_MIN):
    """A shift log with these (box, item) writes in this order, filled with fillers to
    about `target` tokens (never below doc_min, never above DOC_MAX)."""
    intro = intro_sentence(rng)
    body = [write_sentence(rng, c, v) for c, v in writes]
    n_tok = count(intro) + sum(count(" " + s) for s in body)
    while n_tok < max(target, doc_min):
        f = filler_sentence(rng, crates)
        c = count(" " + f)
        if n_tok + c > DOC_MAX:
            break
        body.insert(rng.randint(0, len(body)), f)  # inserting keeps the writes' order
        n_tok += c
    return " ".join([intro] + body), n_tok


def make_example(seed: int, index: int, count: gc.TokCounter, hop: int | None = None,
                 n_extra: int = 0, p_two_hop: float = 0.5, length_scale: float = 1.0) -> dict:
    """Example `index` of split `seed` (same signature as gen_corpus.make_example).
    hop: 2 asks about an overwritten box, 1 about a box written in one document only (else
    hop 2 with probability p_two_hop). n_extra: up to this many follow-up questions about
    the prompt's other boxes (training only). length_scale < 1 (training curriculum only,
    train.py --curriculum): document lengths are drawn from [DOC_MIN, DOC_MAX] times it,
    so early training prompts have the same writes and questions with fewer fillers."""
    rng = random.Random(f"{TASK}:{seed}:{index}")
    for _attempt in range(200):
        ex = _try_example(rng, count, hop, n_extra, p_two_hop, length_scale)
        if ex is not None:
            ex["id"] = f"{TASK}-{seed}-{index}"
            return ex
    raise RuntimeError("could not build a ledger example")


def _try_example(rng, count, hop, n_extra, p_two_hop, length_scale=1.0):
    n_crates = rng.randint(2, 4)
    n_docs = rng.randint(3, 6)
    crates = rng.sample(CRATES, n_crates)
    h = hop if hop is not None else (2 if rng.random() < p_two_hop else 1)
    # which documents write each box: the asked box (crates[0]) has hop h, the others
    # are hop 1 or hop 2 at random
    plan: dict[str, list[int]] = {}
    for j, c in enumerate(crates):
        hc = h if j == 0 else rng.choice([1, 2])
        k = 1 if hc == 1 else rng.randint(2, min(4, n_docs))
        docs = sorted(rng.sample(range(n_docs), k))
        if rng.random() < 0.2:  # sometimes two writes inside one document
            docs = sorted(docs + [rng.choice(docs)])
        plan[c] = docs
    events = [(d, c) for c, ds in plan.items() for d in ds]
    rng.shuffle(events)
    events.sort(key=lambda e: e[0])  # order inside a document is random
    if max(sum(1 for d, _ in events if d == i) for i in range(n_docs)) > 3:
        return None
    items = rng.sample(ITEMS, len(events))  # every write puts a different item
    docs_writes: list[list[tuple[str, str]]] = [[] for _ in range(n_docs)]
    content: dict[str, str] = {}
    for (d, c), v in zip(events, items):
        docs_writes[d].append((c, v))
        content[c] = v
    docs, n_toks = [], []
    ls = min(1.0, max(0.0, length_scale))
    lo, hi = int(DOC_MIN * ls), max(1, int(DOC_MAX * ls))
    for ws in docs_writes:
        d, t = write_document(rng, ws, crates, count, rng.randint(lo, hi), doc_min=lo)
        if not lo <= t <= DOC_MAX:
            return None
        docs.append(d)
        n_toks.append(t)
    crate = crates[0]
    writers = {c: sorted(set(ds)) for c, ds in plan.items()}
    ex = {
        "task": TASK,
        "system": rng.choice(SYSTEM_PROMPTS),
        "documents": docs,
        "question": question_text(rng, crate),
        "answer": content[crate],
        "bridge": bridge_text(crate),
        "hop": h,
        "answer_doc_indices": writers[crate],
        "qtype": "ledger.overwritten" if h == 2 else "ledger.set_once",
        "doc_tokens": n_toks,
        "crate": crate,
        "writes": len(writers[crate]),
    }
    if n_extra > 0:
        others = crates[1:]
        rng.shuffle(others)
        ex["extra"] = [{"question": question_text(rng, c), "answer": content[c], "bridge": bridge_text(c),
                        "hop": 2 if len(writers[c]) >= 2 else 1} for c in others[:n_extra]]
    return ex


_WRITE_RES = [re.compile(re.escape(t).replace(r"\{c\}", r"(?P<c>[A-Z][a-z]+)").replace(r"\{v\}", r"(?P<v>[a-z]+)"))
              for t in WRITE_TEMPLATES]


def final_contents(ex: dict) -> dict[str, str]:
    """Independent check of an example: replays the writes found in the document texts
    (in prompt order, left to right) and returns each box's final item."""
    out: dict[str, str] = {}
    for d in ex["documents"]:
        hits = []
        for p in _WRITE_RES:
            hits += [(m.start(), m.group("c"), m.group("v")) for m in p.finditer(d)]
        for _, c, v in sorted(hits):
            out[c] = v
    return out


def check_vocab(tok) -> None:
    """Asserts that every box name and every item is one token with its leading space,
    and that in both write phrasings the box token is at most 3 tokens before the item."""
    for w in CRATES + ITEMS:
        ids = tok.encode(" " + w, add_special_tokens=False).ids
        assert len(ids) == 1, (w, tok.encode(" " + w, add_special_tokens=False).tokens)
    for t in WRITE_TEMPLATES:
        toks = tok.encode(" " + t.format(c="Brom", v="lamp"), add_special_tokens=False).tokens
        assert 1 <= toks.index("Ġlamp") - toks.index("ĠBrom") <= 3, toks


def chance_levels(ex: dict) -> dict[str, float]:
    """Cross-entropy (nats) of the answer item for three reference guessers: uniform over
    the items named anywhere in the documents; over the items written to any box; over
    the items written to the asked box (knows the binding, not the order)."""
    named = {w for d in ex["documents"] for w in re.findall(r"[a-z]+", d) if w in ITEMS}
    written = {v for d in ex["documents"] for p in _WRITE_RES for m in p.finditer(d) for v in [m.group("v")]}
    own = {m.group("v") for d in ex["documents"] for p in _WRITE_RES for m in p.finditer(d) if m.group("c") == ex["crate"]}
    return {"named": math.log(len(named)), "written": math.log(len(written)), "own": math.log(len(own))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--start", type=int, default=0, help="first example index")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json for exact document lengths")
    ap.add_argument("--heldout", action="store_true", help="alternate hop 1 / hop 2, one question each")
    ap.add_argument("--extra", type=int, default=0, help="follow-up questions per example (training)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    count = gc.TokCounter(a.tokenizer)
    if count.tok is not None:
        check_vocab(count.tok)
    with open(a.out, "w") as f:
        for i in range(a.start, a.start + a.n):
            hop = (1 + (i % 2)) if a.heldout else None
            ex = make_example(a.seed, i, count, hop=hop, n_extra=a.extra)
            assert final_contents(ex)[ex["crate"]] == ex["answer"], ex["id"]
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
