#!/usr/bin/env python3
"""Golden fixture for Kimi-Linear (`model_type: kimi_linear`) made by HF transformers 5.17.

Builds a tiny random-weight ``KimiLinearForCausalLM`` (4 layers: KDA, KDA, MLA, KDA;
layer 0 dense MLP, layers 1-3 MoE with a sigmoid router, ``e_score_correction_bias``,
grouped top-k and one shared expert), writes it with ``save_pretrained`` (which
reverts HF's load-time conversions, so the folder has the release layout:
``self_attn.{q,k,v}_conv1d``, ``self_attn.f_a_proj`` / ``A_log`` / ``dt_bias``,
``block_sparse_moe.experts.{e}.w1/w2/w3``), reloads the folder with
``AutoModelForCausalLM.from_pretrained`` (fp32, eager attention, eager experts, HF's
pure-torch KDA and causal-conv fallbacks: ``fla`` must not be installed) and records
what the reloaded model computes:

  dataplane/tests/fixtures/golden/kimi_linear/  config.json, generation_config.json,
                                                model.safetensors, golden.safetensors,
                                                golden.json

Run from the repository root (about a minute on 2 cores; seeded, byte-identical reruns):

    /work/venv-golden/bin/python tools/make_golden_kimi.py

See tools/README-golden.md (section kimi_linear) for the tensors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy
import safetensors
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, KimiLinearConfig, KimiLinearForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT = REPO_ROOT / "dataplane" / "tests" / "fixtures" / "golden" / "kimi_linear"

SEED = 20261204
VOCAB = 128
# Around every edge of the CPU paths (token loop below 16 tokens, chunks of 64) and 200.
PROMPT_LENS = [1, 5, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200]
GREEDY_PROMPTS = [17, 65]
GREEDY_LEN = 16
MIN_GREEDY_MARGIN = 5e-3
MIN_ROUTER_MARGIN = 1e-4

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    routed_scaling_factor=2.446,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    num_local_experts=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    # The release config's sub-dict; 1-indexed layer lists.
    linear_attn_config={
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
        "head_dim": 16,
        "num_heads": 4,
        "short_conv_kernel_size": 4,
    },
    first_k_dense_replace=1,
)
KDA_LAYERS = [0, 1, 3]
MLA_LAYERS = [2]


def refuse_fast_kernels() -> None:
    for mod in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(mod) is not None:
            sys.exit(f"{mod} is importable: the fixture must come from HF's pure-torch fallbacks")


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer random (seeded); plain norm weights near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()) + sorted(model.named_buffers()):

            def normal(std):
                return torch.randn(p.shape, generator=gen) * std

            def uniform(lo, hi):
                return torch.rand(p.shape, generator=gen) * (hi - lo) + lo

            if name.endswith("norm.weight") or "layernorm" in name:
                v = uniform(0.5, 1.5)
            elif name.endswith("A_log"):
                v = uniform(1.0, 16.0).log()
            elif name.endswith("dt_bias"):
                # HF's own init (FLA's): the inverse softplus of dt, log-uniform in
                # [1e-3, 1e-1], so that decays are mild and states remember tens of
                # tokens (PIC composition is then measurable).
                dt = uniform(float(numpy.log(1e-3)), float(numpy.log(1e-1))).exp()
                v = dt + torch.log(-torch.expm1(-dt))
            elif name.endswith("e_score_correction_bias"):
                v = uniform(0.0, 0.1)
            elif "embed_tokens" in name:
                v = normal(0.5)
            elif any(s in name for s in ("q_proj", "k_proj", "v_proj", "conv1d")):
                v = normal(0.4)
            else:
                v = normal(0.15)
            p.copy_(v.to(p.dtype))


class RouterMargin:
    """Smallest gap, over every routed token, between the k-th and (k+1)-th eligible
    biased score and between the last kept and first dropped group score."""

    def __init__(self, model, cfg):
        self.cfg, self.min_margin, self.handles = cfg, float("inf"), []
        for mod in model.modules():
            if type(mod).__name__ == "KimiLinearTopkRouter":
                self.handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, mod, inp, out):
        logits = out[0]
        s = logits.sigmoid() + mod.e_score_correction_bias
        e, g, kg, k = mod.num_experts, mod.num_group, mod.topk_group, mod.top_k
        grp = s.view(-1, g, e // g).topk(2, dim=-1)[0].sum(-1)
        gs = grp.sort(dim=-1, descending=True)[0]
        if kg < g:
            self.min_margin = min(self.min_margin, float((gs[:, kg - 1] - gs[:, kg]).min()))
        keep = grp.topk(kg, dim=-1)[1]
        mask = torch.zeros_like(grp).scatter_(1, keep, 1).bool()
        mask = mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)
        el = s.masked_fill(~mask, float("-inf")).sort(dim=-1, descending=True)[0]
        self.min_margin = min(self.min_margin, float((el[:, k - 1] - el[:, k]).min()))

    def take(self):
        m, self.min_margin = self.min_margin, float("inf")
        return m


def top2_margin(logits: torch.Tensor) -> float:
    t = logits.topk(2, dim=-1)[0]
    return float((t[..., 0] - t[..., 1]).min())


def prompt(length: int, attempt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED * 1000 + length * 10 + attempt)
    return torch.randint(0, VOCAB, (1, length), generator=g)


def run_prompt(model, ids: torch.Tensor, router: RouterMargin, greedy: bool):
    """Prefill with a cache; returns (tensors, checks)."""
    out = {}
    chk = {}
    l = ids.shape[1]
    with torch.no_grad():
        r = model(input_ids=ids, use_cache=True)
        chk["router_margin_prefill"] = router.take()
        logits = r.logits[0].float()
        out[f"p{l}.ids"] = ids[0].clone()
        out[f"p{l}.logits"] = logits.contiguous()
        cache = r.past_key_values
        for i in KDA_LAYERS:
            layer = cache.layers[i]
            out[f"p{l}.layer{i}.recurrent"] = layer.recurrent_states[0][0].float().contiguous()
            out[f"p{l}.layer{i}.conv"] = layer.conv_states[0][0].float().contiguous()
        for i in MLA_LAYERS:
            layer = cache.layers[i]
            out[f"p{l}.layer{i}.latent"] = layer.keys[0, 0].float().contiguous()
            out[f"p{l}.layer{i}.k_rot"] = layer.values[0, 0].float().contiguous()
        # Uncached prefill agrees with the cached one.
        plain = model(input_ids=ids, use_cache=False).logits[0].float()
        router.take()
        chk["cached_vs_uncached_prefill"] = float((plain - logits).abs().max())
        assert chk["cached_vs_uncached_prefill"] < 1e-5, chk
        chk["min_top2_margin_prefill_last"] = top2_margin(logits[-1])
        if greedy:
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=GREEDY_LEN,
                min_new_tokens=GREEDY_LEN,
                eos_token_id=None,
                pad_token_id=CONFIG["pad_token_id"],
                output_logits=True,
                return_dict_in_generate=True,
            )
            chk["router_margin_decode"] = router.take()
            toks = gen.sequences[0, l:]
            glog = torch.stack([x[0] for x in gen.logits]).float()
            assert len(toks) == GREEDY_LEN
            out[f"p{l}.greedy"] = toks.clone()
            out[f"p{l}.greedy_logits"] = glog.contiguous()
            chk["min_top2_margin_greedy"] = top2_margin(glog)
            # The decode path's logits equal a full prefill of prompt + continuation.
            full = model(input_ids=gen.sequences[:, :-1], use_cache=False).logits[0, l - 1 :].float()
            router.take()
            chk["decode_vs_full_prefill"] = float((full - glog).abs().max())
            assert chk["decode_vs_full_prefill"] < 1e-4, chk
    return out, chk


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    refuse_fast_kernels()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    cfg = KimiLinearConfig(**CONFIG)
    assert cfg.layer_types == ["linear_attention", "linear_attention", "full_attention", "linear_attention"], cfg.layer_types
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"], cfg.mlp_layer_types
    built = KimiLinearForCausalLM(cfg).float().eval()
    randomise_(built, SEED)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    built.save_pretrained(OUT, safe_serialization=True)
    for extra in OUT.glob("*"):
        if extra.name not in ("config.json", "generation_config.json", "model.safetensors"):
            sys.exit(f"unexpected file from save_pretrained: {extra.name}")

    model = AutoModelForCausalLM.from_pretrained(
        OUT,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=False,
    ).eval()
    assert type(model).__name__ == "KimiLinearForCausalLM"
    # The reload reproduces the built model exactly.
    a, b = built.state_dict(), model.state_dict()
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    del built

    router = RouterMargin(model, cfg)
    tensors, checks = {}, {}
    for l in PROMPT_LENS:
        for attempt in range(20):
            ids = prompt(l, attempt)
            out, chk = run_prompt(model, ids, router, l in GREEDY_PROMPTS)
            ok = chk["router_margin_prefill"] >= MIN_ROUTER_MARGIN and chk["min_top2_margin_prefill_last"] >= MIN_GREEDY_MARGIN
            if l in GREEDY_PROMPTS:
                ok = ok and chk["min_top2_margin_greedy"] >= MIN_GREEDY_MARGIN
                ok = ok and chk["router_margin_decode"] >= MIN_ROUTER_MARGIN
            if ok:
                chk["attempt"] = attempt
                break
        else:
            sys.exit(f"no robust prompt of length {l}")
        tensors.update(out)
        checks[f"p{l}"] = chk
        print(f"p{l}: {chk}", flush=True)

    # A span-split prefill through HF's cache (5.17 passes the cached state as
    # initial_state for multi-token chunks) equals the one-shot prefill.
    ids = tensors["p200.ids"].unsqueeze(0)
    with torch.no_grad():
        first = model(input_ids=ids[:, :130], use_cache=True)
        second = model(input_ids=ids[:, 130:], past_key_values=first.past_key_values, use_cache=True)
    router.take()
    joined = torch.cat([first.logits[0], second.logits[0]]).float()
    checks["hf_split_130_vs_one_shot"] = float((joined - tensors["p200.logits"]).abs().max())
    assert checks["hf_split_130_vs_one_shot"] < 1e-4, checks

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, OUT / "golden.safetensors", metadata={"format": "pt"})
    # Re-read: the stored file is what the tests see.
    back = load_file(OUT / "golden.safetensors")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)

    meta = {
        "made_by": "tools/make_golden_kimi.py",
        "reference": "HF transformers KimiLinearForCausalLM (pure-torch KDA / causal-conv fallbacks, eager attention and experts), fp32, CPU",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": numpy.__version__,
        },
        "seed": SEED,
        "prompt_lens": PROMPT_LENS,
        "greedy_prompts": GREEDY_PROMPTS,
        "layers": {"kda": KDA_LAYERS, "mla": MLA_LAYERS},
        "robustness": {
            "min_greedy_top2_logit_margin": MIN_GREEDY_MARGIN,
            "min_router_biased_score_margin": MIN_ROUTER_MARGIN,
        },
        "checks": checks,
        "sha256": {p.name: sha256(p) for p in sorted(OUT.glob("*.safetensors"))},
    }
    (OUT / "golden.json").write_text(json.dumps(meta, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {OUT} ({total} bytes)")
    assert total < 2 * 1024 * 1024, total
    return 0


if __name__ == "__main__":
    sys.exit(main())
