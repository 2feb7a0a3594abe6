#!/usr/bin/env python3
"""Seeded generator of warehouse-ledger prompts: a state-tracking task across documents
(HYPIC issue 23, the second bundled eval model `models/hypic-ledger`).

Every prompt is a small warehouse with 3-6 crates. Each document is the log of one shift:
an intro sentence, 1-4 **writes** ("Crate Brask now holds the lamp."), each replacing the
crate's content, and filler sentences (crates checked but left alone, items mentioned
without being moved, workers, weather). The question asks what one crate holds *now*,
after all the shifts in the order of the prompt. The answer is the item of the last
write to that crate.

The answer needs state carried across document boundaries:
- **hop 2 ("overwritten")**: the crate is written in two or more documents, so each of
  those documents is, read alone, a plausible answer. Only the order of the documents
  decides, i.e. which write came last. A Gated DeltaNet layer keeps the latest write
  of a key with its delta rule (`(I - beta k k^T)` removes the old value), which is
  exactly what the cached transition `T_C` carries. Adding each document's zero-start
  state (naive addition) instead sums the old and new values.
- **hop 1 ("set once")**: the crate is written in exactly one document (once or several
  times inside it); a lookup, kept as the control column.

Every document is meaningful on its own (no pronouns or references to other documents),
so a document prefilled alone (a PIC cache entry) computes the same writes as in
context. What its layers cannot know alone is which writes are overwritten later: that
is in the recurrent state composed across segments.

The prompt and segment format is that of gen_corpus.py (ChatML; segments
`[S_sys, S_doc_1, ..., S_doc_n, S_q]`, exact substrings, every segment ends with a
newline; tools/README-train.md). The reply is the item (``answer``) then ``<|im_end|>``.
Examples carry the same fields as gen_corpus.py's, so train.py, check_format.py and
`hypic eval` read them unchanged, plus ``task: "ledger"``, ``crate`` and ``writes``
(the number of documents writing the queried crate).

Example ``index`` of split ``seed`` comes from ``random.Random(f"ledger:{seed}:{index}")``.
Seeds: training 1234, validation 4242, held-out 20261203 (models/hypic-ledger/eval).

CLI:
    python tools/train/gen_ledger.py --seed 20261203 --n 512 --heldout \
        --tokenizer models/hypic-ledger/tokenizer.json --out models/hypic-ledger/eval/heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import gen_corpus as gc

TASK = "ledger"

# Crate names: a fixed list, so a crate's name is a learned key. The items in the
# crates change per prompt, so binding item to crate is always read from the documents.
_NAME_RNG = random.Random("ledger-crate-names")
CRATES: list[str] = []
while len(CRATES) < 48:
    _n = gc._word(_NAME_RNG, ["", "o", "a", "en", "ik", "us", "el"], (1, 1))
    if 3 <= len(_n) <= 7 and _n not in CRATES and not any(x in _n.lower() for x in ("yr", "rkk", "rkr", "thx")):
        CRATES.append(_n)

ITEMS = ["lamp", "kettle", "drum", "violin", "clock", "mirror", "basket", "helmet", "anchor", "compass",
         "candle", "ladder", "saddle", "hammer", "globe", "trumpet", "teapot", "blanket", "lantern", "shovel",
         "umbrella", "telescope", "wheel", "bucket", "carpet", "statue", "rope", "barrel", "map", "guitar",
         "bell", "kite", "vase", "radio", "camera", "bicycle", "sword", "crown", "chair", "piano"]
SHIFTS = ["morning", "evening", "night", "early", "late", "weekend", "holiday", "short", "long", "busy", "quiet"]
TASKS = ["swept the floor", "fixed a shelf", "counted the boxes", "repaired the forklift", "cleaned the windows",
         "painted the door", "oiled the gate", "checked the alarm", "sorted the mail", "labelled the shelves"]

WRITE_TEMPLATES = [
    "Crate {c} now holds the {v}.",
    "The {v} was put into crate {c}, replacing what was in it.",
    "Crate {c} was emptied and the {v} was put in it.",
    "From now on crate {c} holds the {v}.",
]


def write_sentence(rng, crate: str, item: str) -> str:
    return rng.choice(WRITE_TEMPLATES).format(c=crate, v=item)


def filler_sentence(rng, crates: list[str], people: list[str], cities: list[str]) -> str:
    """A sentence that changes no crate; may mention crates and items (distractors)."""
    c, v, p = rng.choice(crates), rng.choice(ITEMS), rng.choice(people)
    return rng.choice([
        f"Crate {c} was checked and left as it was.",
        f"{p} counted the items in crate {c} twice.",
        f"Nobody opened crate {c} during this shift.",
        f"{p} asked whether anyone had seen the {v}.",
        f"A customer from {rng.choice(cities)} asked about the {v}.",
        f"{p} {rng.choice(TASKS)}.",
        f"The weather was {rng.choice(gc.WEATHER)} all day.",
        f"{p} arrived at {rng.randint(5, 11)} and left at {rng.randint(1, 9)}.",
        f"A truck from {rng.choice(cities)} was late.",
        f"{p} wrote a note about crate {c}.",
        f"The lid of crate {c} was painted {rng.choice(gc.COLORS)}.",
        f"{p} and {rng.choice(people)} had lunch together.",
    ])


SYSTEM_PROMPTS = [
    "You keep the warehouse ledger. Read the shift logs in order and answer with the item only.",
    "The documents are shift logs, in the order they happened. Answer the question with one item.",
    "Track what each crate holds through the logs below. Reply with a short answer only.",
    "Read the logs in order. Each crate holds one item; a new item replaces the old one. Answer briefly.",
]


def question_text(rng, crate: str) -> str:
    return rng.choice([f"What does crate {crate} hold now?", f"Which item is in crate {crate} now?",
                       f"What is in crate {crate} at the end?"])


DOC_MIN, DOC_MAX = 100, 1000


def sample_doc_target(rng) -> int:
    u = rng.random()
    if u < 0.70:
        return rng.randint(DOC_MIN, 200)
    if u < 0.95:
        return rng.randint(200, 400)
    return rng.randint(400, 800)


def write_document(rng, writes: list[tuple[str, str]], crates, people, cities, count, target):
    """A shift log with these (crate, item) writes in this order, filled to `target`
    tokens; fillers never go between writes to the same crate in a way that changes
    their order (the writes keep their relative order)."""
    intro = rng.choice([f"Log of the {rng.choice(SHIFTS)} shift at the {rng.choice(cities)} warehouse.",
                        f"Shift report from the {rng.choice(cities)} warehouse, {rng.choice(SHIFTS)} shift.",
                        f"Notes of {rng.choice(people)} for the {rng.choice(SHIFTS)} shift."])
    body = [write_sentence(rng, c, v) for c, v in writes]
    n_tok = count(intro) + sum(count(" " + s) for s in body)
    while n_tok < target:
        f = filler_sentence(rng, crates, people, cities)
        c = count(" " + f)
        if n_tok + c > DOC_MAX:
            break
        body.insert(rng.randint(0, len(body)), f)  # inserting keeps the writes' order
        n_tok += c
    return " ".join([intro] + body), n_tok


def make_example(seed: int, index: int, count: gc.TokCounter, hop: int | None = None,
                 n_extra: int = 0, p_two_hop: float = 0.7) -> dict:
    """Example `index` of split `seed` (same signature as gen_corpus.make_example).
    hop: 2 forces an overwritten crate, 1 a crate written in one document only (else
    hop 2 with probability p_two_hop). n_extra: up to this many follow-up questions
    about the other crates (training only)."""
    rng = random.Random(f"{TASK}:{seed}:{index}")
    for _attempt in range(200):
        ex = _try_example(rng, count, hop, n_extra, p_two_hop)
        if ex is not None:
            ex["id"] = f"{TASK}-{seed}-{index}"
            return ex
    raise RuntimeError("could not build a ledger example")


def _try_example(rng, count, hop, n_extra, p_two_hop):
    crates = rng.sample(CRATES, rng.randint(3, 6))
    people = [gc.person_name(rng, rng.random() < 0.5) for _ in range(4)]
    cities = [gc.city_name(rng) for _ in range(3)]
    n_docs = rng.randint(3, 8)
    h = hop if hop is not None else (2 if rng.random() < p_two_hop else 1)
    # writes per document; a crate's new item always differs from its current one
    content: dict[str, str] = {}
    docs_writes: list[list[tuple[str, str]]] = []
    for _ in range(n_docs):
        ws = []
        for _ in range(rng.randint(1, 4)):
            c = rng.choice(crates)
            v = rng.choice([x for x in ITEMS if x != content.get(c)])
            content[c] = v
            ws.append((c, v))
        docs_writes.append(ws)
    writers = {c: [i for i, ws in enumerate(docs_writes) if any(w[0] == c for w in ws)] for c in crates}
    want = [c for c in crates if (len(writers[c]) >= 2) == (h == 2) and writers[c]]
    if not want:
        return None
    crate = rng.choice(want)
    if h == 2 and len({v for ws in docs_writes for c, v in ws if c == crate}) < 2:
        return None
    docs, n_toks = [], []
    for ws in docs_writes:
        d, t = write_document(rng, ws, crates, people, cities, count, sample_doc_target(rng))
        docs.append(d)
        n_toks.append(t)
    ex = {
        "task": TASK,
        "system": rng.choice(SYSTEM_PROMPTS),
        "documents": docs,
        "question": question_text(rng, crate),
        "answer": content[crate],
        "bridge": None,
        "hop": h,
        "answer_doc_indices": writers[crate],
        "qtype": "ledger.overwritten" if h == 2 else "ledger.set_once",
        "doc_tokens": n_toks,
        "crate": crate,
        "writes": len(writers[crate]),
    }
    if n_extra > 0:
        others = [c for c in crates if c != crate and writers[c]]
        rng.shuffle(others)
        ex["extra"] = [{"question": question_text(rng, c), "answer": content[c], "bridge": None,
                        "hop": 2 if len(writers[c]) >= 2 else 1} for c in others[:n_extra]]
    return ex


def final_contents(ex: dict) -> dict[str, str]:
    """Independent check of an example: replays the writes found in the document texts
    (in prompt order, left to right) and returns each crate's final item."""
    import re

    pats = [re.compile(t.replace(".", r"\.").format(c=r"(?P<c>[A-Z][a-z]+)", v=r"(?P<v>[a-z]+)"))
            for t in WRITE_TEMPLATES]
    out: dict[str, str] = {}
    for d in ex["documents"]:
        hits = []
        for p in pats:
            hits += [(m.start(), m.group("c"), m.group("v")) for m in p.finditer(d)]
        for _, c, v in sorted(hits):
            out[c] = v
    return out


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
    with open(a.out, "w") as f:
        for i in range(a.start, a.start + a.n):
            hop = (1 + (i % 2)) if a.heldout else None
            ex = make_example(a.seed, i, count, hop=hop, n_extra=a.extra)
            assert final_contents(ex)[ex["crate"]] == ex["answer"], ex["id"]
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
