#!/usr/bin/env python3
"""Install a trained checkpoint as the shipped HF model folder (bf16 weights).

    python tools/train/export.py /tmp/hypic-tiny-fp32 models/hypic-tiny

Reads the fp32 folder written by train.py (config.json + model.safetensors), rounds the
weights to bf16 (round-to-nearest-even, torch's .to(torch.bfloat16), the same rounding
train.py applies before its held-out evaluation) and writes config.json (dtype bfloat16)
and model.safetensors into the destination, plus generation_config.json from
train_tokenizer.py.  tokenizer.json / tokenizer_config.json are expected to be there
already (train_tokenizer.py writes them).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src, dst = argv[0], argv[1]
    from transformers import Qwen3NextForCausalLM

    import train_tokenizer

    model = Qwen3NextForCausalLM.from_pretrained(src, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    model.config.use_cache = True
    os.makedirs(dst, exist_ok=True)
    model.save_pretrained(dst, safe_serialization=True)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(train_tokenizer.generation_config(), f, indent=2)
        f.write("\n")
    n = sum(p.numel() for p in model.parameters())
    size = os.path.getsize(os.path.join(dst, "model.safetensors"))
    print(f"wrote {dst}: {n} parameters, model.safetensors {size} bytes (bf16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
