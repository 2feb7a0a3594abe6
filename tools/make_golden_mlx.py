#!/usr/bin/env python3
"""Golden-reference fixture generator for Ring-linear-2.0 (`bailing_moe_linear`) with
mlx-lm 0.32 on its CPU backend.

What it does
------------
Builds a tiny random-weight Ring-linear checkpoint in the Hugging Face on-disk layout
(config.json + model.safetensors with the HF tensor names), runs it with mlx-lm's
own `mlx_lm.models.bailing_moe_linear.Model` on `mx.cpu` in fp32, and records what it
computes:

  dataplane/tests/fixtures/golden/bailing_moe_linear/
      config.json, model.safetensors   the checkpoint (HF names; per-expert tensors,
                                       `mlp.gate.weight`, `mlp.gate.expert_bias`)
      golden.safetensors               prompts, logits, final states, greedy tokens
      golden.json                      versions, seeds, prompt lengths

Layer factor of the Lightning slopes
------------------------------------
mlx-lm computes the per-layer factor as `1 - max(0, l-1)/max(1, L-1) + 1e-5`; SGLang
and vLLM (how inclusionAI serves these checkpoints) use `1 - l/(L-1) + 1e-5`, which
is HYPIC's default. This script replaces ONE function of mlx-lm,
`LinearAttention._get_slopes`, by the same ALiBi slopes times the default factor
before building the model (`patched_get_slopes` below). The `mlx_rule.*` tensors are
computed by a second, unpatched mlx-lm model with the same weights, to test HYPIC's
`lightning_slope_rule: "mlx_lm"` option against mlx-lm itself.

How to run (from the repository root)
-------------------------------------
    python3 -m venv /work/venv-ring
    /work/venv-ring/bin/pip install mlx mlx-cpu 'mlx-lm==0.32.*'
    /work/venv-ring/bin/python tools/make_golden_mlx.py

Seeded (numpy Generator); re-running with the same versions rewrites the same files.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from safetensors.numpy import save_file

import mlx_lm
from mlx_lm.models import bailing_moe_linear as bml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "dataplane/tests/fixtures/golden/bailing_moe_linear"
SEED = 20261203
# Around every edge of the CPU paths: token loop below 16, chunks of 64.
LENS = [1, 5, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200]
GREEDY_PROMPT = 17
GREEDY_STEPS = 16

CONFIG = {
    "architectures": ["BailingMoeLinearV2ForCausalLM"],
    "model_type": "bailing_moe_linear",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "partial_rotary_factor": 0.5,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "use_bias": False,
    "layer_group_size": 3,
    "group_norm_size": 2,
    "linear_silu": False,
    "first_k_dense_replace": 1,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "num_shared_experts": 1,
    "moe_shared_expert_intermediate_size": 16,
    "norm_topk_prob": True,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 0,
}


def alibi(n: int) -> list[float]:
    def pow2(n):
        return [2 ** (-(2 ** -(math.log2(n) - 3)) * (i + 1)) for i in range(n)]

    if math.log2(n).is_integer():
        return pow2(n)
    p = 2 ** math.floor(math.log2(n))
    return pow2(p) + pow2(2 * p)[::2][: n - p]


def patched_get_slopes(self) -> mx.array:
    """mlx-lm's `_get_slopes` with HYPIC's default layer factor 1 - l/(L-1) + 1e-5."""
    slopes = mx.array(alibi(self.num_attention_heads), dtype=mx.float32)
    denom = max(1, self.num_hidden_layers - 1)
    layer_factor = 1 - (self.layer_idx / denom) + 1e-5
    return -slopes * layer_factor


def build(weights: dict[str, np.ndarray], patched: bool):
    original = bml.LinearAttention._get_slopes
    if patched:
        bml.LinearAttention._get_slopes = patched_get_slopes
    try:
        model = bml.Model(bml.ModelArgs.from_dict(CONFIG))
    finally:
        bml.LinearAttention._get_slopes = original
    w = model.sanitize({k: mx.array(v) for k, v in weights.items()})
    model.load_weights(list(w.items()), strict=True)
    mx.eval(model.parameters())
    return model


def random_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """HF-named fp32 tensors: projections N(0, 0.15), embedding N(0, 0.5), RMSNorm
    weights 1 + N(0, 0.1), g_norm U(0.5, 1.5), expert_bias N(0, 0.3)."""
    template = bml.Model(bml.ModelArgs.from_dict(CONFIG))
    out = {}
    c = CONFIG
    for name, p in tree_flatten(template.parameters()):
        shape = p.shape
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            if name.endswith("g_norm.weight"):
                v = rng.uniform(0.5, 1.5, shape)
            else:
                v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("expert_bias"):
            v = 0.3 * rng.standard_normal(shape)
        elif "word_embeddings" in name:
            v = 0.5 * rng.standard_normal(shape)
        else:
            v = 0.15 * rng.standard_normal(shape)
        v = v.astype(np.float32)
        # Back to the HF checkpoint names (mlx-lm's sanitize maps them forward).
        if ".mlp.switch_mlp." in name:
            pre, post = name.split(".mlp.switch_mlp.")
            proj = post.split(".")[0]
            for e in range(c["num_experts"]):
                out[f"{pre}.mlp.experts.{e}.{proj}.weight"] = np.ascontiguousarray(v[e])
            continue
        if name.endswith(".mlp.gate.gate_proj.weight"):
            name = name.replace(".mlp.gate.gate_proj.weight", ".mlp.gate.weight")
        out[name] = v
    return out


def states(cache) -> dict[str, np.ndarray]:
    out = {}
    for i, c in enumerate(cache):
        if isinstance(c, bml.KVCache):
            continue
        # ArraysCache: [B, H, dk, dv], K-major like HYPIC's [H, dk, dv].
        out[f"layer{i}.recurrent"] = np.array(c[0][0], dtype=np.float32)
    return out


def main() -> None:
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(SEED)
    weights = random_weights(rng)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    save_file(weights, str(OUT / "model.safetensors"), metadata={"format": "pt"})

    model = build(weights, patched=True)
    golden: dict[str, np.ndarray] = {}
    seeds = {}
    for L in LENS:
        seed = SEED + 1000 + L
        seeds[f"p{L}"] = seed
        ids = np.random.default_rng(seed).integers(0, CONFIG["vocab_size"], L)
        cache = model.make_cache()
        logits = model(mx.array(ids[None, :].astype(np.int32)), cache=cache)
        mx.eval(logits)
        golden[f"p{L}.ids"] = ids.astype(np.int64)
        golden[f"p{L}.logits"] = np.array(logits[0], dtype=np.float32)
        for k, v in states(cache).items():
            golden[f"p{L}.{k}"] = v
        if L == GREEDY_PROMPT:
            toks = []
            last = logits[0, -1]
            for _ in range(GREEDY_STEPS):
                t = int(mx.argmax(last).item())
                toks.append(t)
                nxt = model(mx.array([[t]], dtype=mx.int32), cache=cache)
                mx.eval(nxt)
                last = nxt[0, -1]
            golden[f"p{L}.greedy"] = np.array(toks, dtype=np.int64)

    # mlx-lm's own layer factor, for the `mlx_lm` slope-rule option.
    plain = build(weights, patched=False)
    L = 65
    ids = golden[f"p{L}.ids"]
    cache = plain.make_cache()
    logits = plain(mx.array(ids[None, :].astype(np.int32)), cache=cache)
    mx.eval(logits)
    golden[f"mlx_rule.p{L}.logits"] = np.array(logits[0], dtype=np.float32)
    for k, v in states(cache).items():
        golden[f"mlx_rule.p{L}.{k}"] = v

    save_file(golden, str(OUT / "golden.safetensors"))
    meta = {
        "model": "bailing_moe_linear",
        "reference": "mlx_lm.models.bailing_moe_linear.Model on mx.cpu, float32",
        "slopes": "LinearAttention._get_slopes patched to layer factor 1 - l/(L-1) + 1e-5 "
        "(mlx_rule.* tensors: unpatched mlx-lm factor 1 - max(0,l-1)/max(1,L-1) + 1e-5)",
        "versions": {
            "python": platform.python_version(),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "numpy": np.__version__,
        },
        "seed": SEED,
        "prompt_lens": LENS,
        "prompt_ids": "numpy.random.default_rng(seed).integers(0, vocab_size, L), seed = prompt_seeds[pL]",
        "prompt_seeds": seeds,
        "greedy": {"prompt": f"p{GREEDY_PROMPT}", "steps": GREEDY_STEPS},
    }
    (OUT / "golden.json").write_text(json.dumps(meta, indent=2) + "\n")
    print("wrote", OUT, file=sys.stderr)


if __name__ == "__main__":
    main()
