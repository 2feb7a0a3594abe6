#!/usr/bin/env python3
"""Load the shipped model with plain HF transformers on CPU (fp32 compute, torch fallbacks,
no fla) and answer held-out prompts with model.generate (greedy, KV/state cache), an
independent code path from train.py's full-recompute evaluation.

    /work/pyenv/hf/bin/python tools/train/verify_cpu.py models/hypic-tiny [preds.jsonl] [N_RIGHT N_WRONG]

With the GPU predictions file (heldout_preds.jsonl from train.py) it picks N_RIGHT prompts
the GPU evaluation answered correctly and N_WRONG it got wrong, and reports whether the
CPU answer equals the gold answer and the GPU answer.  Without it, it runs the first
N_RIGHT + N_WRONG prompts.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import gen_corpus as gc  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model_dir = argv[0]
    preds_path = argv[1] if len(argv) > 1 and argv[1] != "-" else None
    n_right, n_wrong = (int(argv[2]), int(argv[3])) if len(argv) > 3 else (4, 2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    held = [json.loads(line) for line in open(os.path.join(model_dir, "eval", "heldout.jsonl"))]
    by_id = {e["id"]: e for e in held}
    if preds_path:
        preds = [json.loads(line) for line in open(preds_path)]
        right = [p for p in preds if p["em"]][:n_right]
        wrong = [p for p in preds if not p["em"]][:n_wrong]
        picked = [(by_id[p["id"]], p["pred"]) for p in right + wrong]
    else:
        picked = [(e, None) for e in held[: n_right + n_wrong]]
    n_ok = n_same = 0
    for ex, gpu in picked:
        user = "".join(gc.segments(ex)[1:-1]) + f"Question: {ex['question']}"
        msgs = [{"role": "system", "content": ex["system"]}, {"role": "user", "content": user}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        assert tok.decode(ids["input_ids"][0]) == gc.prompt_text(ex)
        t = time.time()
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=24, do_sample=False)
        ans = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        ok, same = gc.final_answer(ans) == ex["answer"], (gpu is None or ans == gpu.strip())
        n_ok += ok
        n_same += same
        print(f"{ex['id']} hop{ex['hop']} {ids['input_ids'].shape[1]} tok | Q: {ex['question']} | gold {ex['answer']!r} "
              f"| cpu {ans!r} | gpu {gpu!r} | {'OK' if ok else 'wrong'}{'' if same else ' (differs from GPU)'} "
              f"| {time.time() - t:.1f}s", flush=True)
    print(f"CPU correct {n_ok}/{len(picked)}; equal to the GPU prediction {n_same}/{len(picked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
