#!/usr/bin/env python3
"""Answer-level cross-check, in Python with HF, of naive state addition against full
recompute on the held-out prompts (not the engine: `hypic eval` is the measurement).

    python tools/train/naive_check.py MODEL_DIR [N] [DEVICE] [--selftest]

For the first N held-out prompts (alternating hop 1 / hop 2) it decodes the reply
greedily (up to 12 tokens) in three ways:
- full: the whole prompt prefilled at once, then decoded on the cache;
- chunked: the segments prefilled one after another on one cache (the exact running
  state carried across every boundary). It must give the replies of `full`: this checks
  the harness;
- naive: dataplane's `NaiveAddition`. The system and document segments are each
  prefilled alone from a zero state, at their own positions in the prompt (the keys
  equal those of a prefill at 0 re-rotated to its place: RoPE is relative). The linear
  layers' recurrent states are summed (`S <- S + S_C|0`), their conv state is the last
  document's, and the attention KV is concatenated. The question segment is then
  prefilled on that cache and the reply decoded.
Prints exact match per hop for each, and how many replies differ from `full`.

--selftest: a random 4-layer model (attention at layer 0), to check that `chunked`
equals `full`.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import gen_corpus as gc  # noqa: E402
import gen_ledger  # noqa: E402


def _prefill(model, ids, pos0, cache):
    x = torch.tensor([ids], device=model.device)
    pos = torch.arange(pos0, pos0 + len(ids), device=model.device).unsqueeze(0)
    out = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float(), out.past_key_values


def _decode(model, logits, cache, pos, im_end, max_new=12):
    gen = []
    for _ in range(max_new):
        t = int(logits.argmax())
        gen.append(t)
        if t == im_end:
            break
        logits, cache = _prefill(model, [t], pos, cache)
        pos += 1
    return gen


def _add_segment(base, c):
    """Naive addition of segment cache `c` onto `base`, layer by layer."""
    for lb, lc in zip(base.layers, c.layers):
        if hasattr(lb, "recurrent_states"):
            lb.recurrent_states[0].add_(lc.recurrent_states[0])
            lb.conv_states[0].copy_(lc.conv_states[0])
        else:
            lb.keys = torch.cat([lb.keys, lc.keys], dim=-2)
            lb.values = torch.cat([lb.values, lc.values], dim=-2)


@torch.no_grad()
def replies(model, tok, ex, im_end):
    segs = [tok.encode(s, add_special_tokens=False) for s in gc.segments(ex)]
    segs = [s.ids if hasattr(s, "ids") else s for s in segs]
    whole = [i for s in segs for i in s]
    n = len(whole)
    out = {}
    lg, cache = _prefill(model, whole, 0, None)
    out["full"] = _decode(model, lg, cache, n, im_end)
    cache, pos = None, 0
    for s in segs:
        lg, cache = _prefill(model, s, pos, cache)
        pos += len(s)
    out["chunked"] = _decode(model, lg, cache, n, im_end)
    base, pos = None, 0
    for s in segs[:-1]:
        _, c = _prefill(model, s, pos, None)
        pos += len(s)
        if base is None:
            base = c
        else:
            _add_segment(base, c)
    lg, base = _prefill(model, segs[-1], pos, base)
    out["naive"] = _decode(model, lg, base, n, im_end)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selftest = "--selftest" in argv
    argv = [a for a in argv if a != "--selftest"]
    model_dir = argv[0]
    n = int(argv[1]) if len(argv) > 1 else 32
    device = torch.device(argv[2] if len(argv) > 2 else "cpu")
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3NextForCausalLM

    if device.type == "cpu":
        import cpu_fast  # the same functions as HF's CPU fallbacks, faster (train.py uses them on CPU)

        cpu_fast.apply()
        torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    tok = AutoTokenizer.from_pretrained(model_dir)
    if selftest:
        import train

        torch.manual_seed(0)
        cfg = train.model_config(len(tok), tok.convert_tokens_to_ids(gc.IM_END), 4093, 4, 64, [0])
        model = Qwen3NextForCausalLM(cfg)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()
    im_end = tok.convert_tokens_to_ids(gc.IM_END)

    class _Tok:  # tokenizer.json ids, as check_format.py uses them
        def encode(self, s, add_special_tokens=False):
            return tok(s, add_special_tokens=False)["input_ids"]

    held = [json.loads(line) for line in open(os.path.join(model_dir, "eval", "heldout.jsonl"))][:n]
    stats = {m: {1: [0, 0], 2: [0, 0]} for m in ("full", "chunked", "naive")}
    differ = {"chunked": 0, "naive": 0}
    # wrong answers by kind: an earlier item of the asked box, another item, not an item
    wrong = {m: {"earlier item of the box": 0, "other item": 0, "no item": 0} for m in stats}
    t0 = time.time()
    for ex in held:
        r = replies(model, _Tok(), ex, im_end)
        for m, g in r.items():
            text = tok.decode([t for t in g if t != im_end], skip_special_tokens=True)
            ok = gc.final_answer(text) == ex["answer"]
            stats[m][ex["hop"]][0] += ok
            if not ok:
                own = {mm.group("v") for d in ex["documents"] for p in gen_ledger._WRITE_RES
                       for mm in p.finditer(d) if mm.group("c") == ex["crate"]}
                a = gc.final_answer(text)
                wrong[m]["earlier item of the box" if a in own else
                         "other item" if a in gen_ledger.ITEMS else "no item"] += 1
            stats[m][ex["hop"]][1] += 1
            if m != "full" and g != r["full"]:
                differ[m] += 1
    for m, s in stats.items():
        em = {h: (s[h][0] / s[h][1] if s[h][1] else float("nan")) for h in (1, 2)}
        allem = (s[1][0] + s[2][0]) / max(1, s[1][1] + s[2][1])
        extra = f"; replies differing from full {differ[m]}/{len(held)}" if m in differ else ""
        print(f"{m:8s} EM all {allem:.3f} hop1 {em[1]:.3f} ({s[1][0]}/{s[1][1]}) hop2 {em[2]:.3f} "
              f"({s[2][0]}/{s[2][1]}){extra}; wrong answers: {wrong[m]}")
    print(f"{len(held)} prompts in {time.time() - t0:.1f}s on {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
