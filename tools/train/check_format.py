#!/usr/bin/env python3
"""Check the held-out set against the prompt/segment format (FORMAT.md) and the tokenizer.

For every example it asserts:
  * tokenising each segment on its own and concatenating the ids gives exactly the ids of
    the whole prompt (no BPE merge or pre-token crosses a segment boundary);
  * the prompt equals HF's chat template rendering of [system, user] messages with
    add_generation_prompt=True, and HF AutoTokenizer gives the same ids as tokenizer.json;
  * every document has 100..1000 tokens (ledger: 40..150) and doc_tokens[i] is its exact count;
  * the answer (and, for two-hop questions, the bridge) sits in the answer documents;
    for the ledger task (gen_ledger.py), replaying the documents' writes in order gives
    the answer, answer_doc_indices are exactly the documents writing the box, the bridge
    is "Box {name}", and the box name and the answer are one token each.
Prints token-length statistics.

    /work/pyenv/hf/bin/python tools/train/check_format.py models/hypic-tiny
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gen_corpus as gc  # noqa: E402
import gen_ledger  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model_dir = argv[0] if argv else "models/hypic-tiny"
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(model_dir)
    path = os.path.join(model_dir, "eval", "heldout.jsonl")
    exs = [json.loads(line) for line in open(path)]
    ids_seen = set()
    plen, alen, seglens = [], [], []
    for ex in exs:
        assert ex["id"] not in ids_seen
        ids_seen.add(ex["id"])
        segs = gc.segments(ex)
        prompt = "".join(segs)
        whole = tok.encode(prompt, add_special_tokens=False).ids
        parts = [tok.encode(s, add_special_tokens=False).ids for s in segs]
        cat = [i for p in parts for i in p]
        assert cat == whole, f"segment tokenisation differs from whole prompt in {ex['id']}"
        user = "".join(segs[1:-1]) + f"Question: {ex['question']}"
        msgs = [{"role": "system", "content": ex["system"]}, {"role": "user", "content": user}]
        rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert rendered == prompt, f"chat template differs in {ex['id']}"
        hf_ids = hf(prompt, add_special_tokens=False)["input_ids"]
        assert hf_ids == whole, f"HF tokenizer differs in {ex['id']}"
        ledger = ex.get("task") == "ledger"
        lo, hi = (gen_ledger.DOC_MIN, gen_ledger.DOC_MAX) if ledger else (100, 1000)
        for d, n in zip(ex["documents"], ex["doc_tokens"]):
            m = len(tok.encode(d, add_special_tokens=False).ids)
            assert m == n, (ex["id"], m, n)
            assert lo <= m <= hi, (ex["id"], m)
        assert (3 <= len(ex["documents"]) <= 6) if ledger else (3 <= len(ex["documents"]) <= 8)
        idx = ex["answer_doc_indices"]
        if ledger:
            # every document that writes the box, and the answer is its last write
            assert len(idx) == ex["writes"] and (len(idx) >= 2) == (ex["hop"] == 2), ex["id"]
            fc = gen_ledger.final_contents(ex)
            assert fc[ex["crate"]] == ex["answer"], ex["id"]
            assert 2 <= len(fc) <= 4, ex["id"]
            writers = [i for i, d in enumerate(ex["documents"])
                       if any(m.group("c") == ex["crate"] for p in gen_ledger._WRITE_RES for m in p.finditer(d))]
            assert writers == idx, (ex["id"], writers, idx)
            assert ex["bridge"] == gen_ledger.bridge_text(ex["crate"]), ex["id"]
            # the box name and the answer item are one token each, as in the documents
            for w in (" " + ex["crate"], " " + ex["answer"]):
                assert len(tok.encode(w, add_special_tokens=False).ids) == 1, (ex["id"], w)
        else:
            assert len(idx) == ex["hop"] and len(set(idx)) == len(idx)
            assert any(ex["answer"] in ex["documents"][i] for i in idx), ex["id"]
        plen.append(len(whole))
        alen.append(len(tok.encode(gc.answer_text(ex), add_special_tokens=False).ids))
        seglens.append([len(p) for p in parts])
    hop = [e["hop"] for e in exs]
    print(f"{len(exs)} examples ({hop.count(1)} single-hop, {hop.count(2)} two-hop): all checks passed")
    print(f"prompt tokens: min {min(plen)} mean {sum(plen) / len(plen):.0f} max {max(plen)}")
    print(f"answer tokens incl. <|im_end|>: min {min(alen)} mean {sum(alen) / len(alen):.2f} max {max(alen)}")
    print(f"system segment tokens: {sorted(set(s[0] for s in seglens))}; question segment tokens: "
          f"min {min(s[-1] for s in seglens)} max {max(s[-1] for s in seglens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
