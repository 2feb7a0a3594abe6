#!/usr/bin/env python3
"""Golden-reference fixture generator for HYPIC (Qwen3-Next / Qwen3.5 hybrid models).

What it does
------------
Builds three tiny random-weight checkpoints in the official Hugging Face on-disk
formats, reloads each one with ``AutoModelForCausalLM.from_pretrained`` (fp32, CPU,
eager attention, eager experts, HF's pure-torch GatedDeltaNet / causal-conv1d
fallbacks -- `fla` and `causal_conv1d` must NOT be installed) and records
reference outputs that the Rust tests compare against:

  dataplane/tests/fixtures/golden/qwen3_next/    Qwen3NextForCausalLM, fused GDN
                                                 (in_proj_qkvz / in_proj_ba), per-expert
                                                 MoE tensors, layer 1 dense MLP,
                                                 single model.safetensors (fp32)
  dataplane/tests/fixtures/golden/qwen3_5_moe/   qwen3_5_moe VL wrapper (text under
                                                 model.language_model.*, tiny vision
                                                 tower under model.visual.*), split GDN,
                                                 fused 3-D experts, 3 bf16 shards + index
  dataplane/tests/fixtures/golden/qwen3_5/       qwen3_5 VL wrapper, dense MLP, split GDN,
                                                 single model.safetensors (fp32)

Each folder gets config.json, generation_config.json, tokenizer.json (tiny byte-level
BPE, vocab 320 incl. <|endoftext|>=317, <|im_start|>=318, <|im_end|>=319),
tokenizer_config.json (ChatML template), the weights, golden.safetensors and
golden.json.  See tools/README-golden.md for the tensor naming.

How to run (from the repository root)
-------------------------------------
    python3 -m venv /work/pyenv/hf            # once
    /work/pyenv/hf/bin/pip install -r tools/requirements-golden.txt
    /work/pyenv/hf/bin/python tools/make_golden.py            # all three models
    /work/pyenv/hf/bin/python tools/make_golden.py qwen3_5    # only some of them

Takes about a minute on 2 CPU cores.  Everything is seeded (torch
generators per model, one torch thread) so re-running with the pinned versions
rewrites byte-identical golden tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import importlib.util

import numpy
import safetensors
import tokenizers
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_golden  # noqa: E402  (independent plain-torch reference, used in float64)

from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_ROOT = REPO_ROOT / "dataplane" / "tests" / "fixtures" / "golden"

BASE_SEED = 20250917
PROMPT_LENS = [1, 5, 63, 64, 65, 200]
GREEDY_LEN = 16

# ----------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------
BASE_VOCAB = 317  # 256 byte symbols + 61 merges
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # -> ids 317, 318, 319 (Qwen order)
VOCAB_SIZE = BASE_VOCAB + len(SPECIALS)  # 320 == model vocab_size

# Pre-tokenizer regexes copied from transformers 5.17 (tokenization_qwen2.py and
# tokenization_qwen3_5.py).  The HF tokenizer classes rebuild their pipeline with these,
# so tokenizer.json must use the same one for the two to agree.
QWEN2_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN3_5_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

CHAT_PROMPT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! What is 2+2? Answer in one short sentence, please."},
]

TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran
into the forest, where the trees were tall and the light was green and gold.
A serving system for large language models has to schedule requests, manage memory for
the key-value cache, and keep the accelerator busy. Hybrid models mix full attention
layers with linear attention layers; the linear layers keep a fixed-size recurrent state
instead of a cache that grows with the length of the sequence.
In the gated delta rule, the state is decayed, corrected with the delta between the new
value and the value that the state predicts for the key, and then read with the query.
The convolution before the recurrence looks at the last four inputs of each channel.
Mixture-of-experts layers route every token to a few experts chosen by a small router,
and a shared expert is always added, scaled by a sigmoid gate.

User: Hello! How are you today?
Assistant: I am fine, thank you. How can I help you?
User: What is the capital of France?
Assistant: The capital of France is Paris.
User: What is 2+2?
Assistant: 2+2 is 4.
User: Please write a short poem about the sea.
Assistant: The sea is wide, the sea is deep, it sings the sailors all to sleep.

def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

fn main() {
    let mut total = 0u64;
    for i in 0..100 {
        total += i * i;
    }
    println!("total = {}", total);
}

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 65536 3.14159 2.71828.
Punctuation: (parentheses), [brackets], {braces}, "quotes", 'single', a-b, a_b, a/b, a:b;
Email: someone@example.com  URL: https://example.com/path?query=value&x=1#frag
It's a test; we're testing; they've tested; I'm sure; you'll see; he'd know.
Tokenizers split text into pieces, and the pieces into bytes, and the bytes merge back
into tokens that the model has seen many times during its training on a lot of text.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, \u00fcber, \u00e5ngstr\u00f6m, \u4f60\u597d\u4e16\u754c, \u3053\u3093\u306b\u3061\u306f, \U0001f600 emoji.
"""


def build_tokenizer(regex: str) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    lines = TRAIN_TEXT.split("\n")
    tok.train_from_iterator([ln + "\n" for ln in lines] * 4, trainer=trainer)
    assert tok.get_vocab_size() == BASE_VOCAB, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() == VOCAB_SIZE
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == BASE_VOCAB + i
    return tok


def tokenizer_config(tokenizer_class: str, regex: str) -> dict:
    added = {
        str(BASE_VOCAB + i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(SPECIALS)
    }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": None,
    }
    if tokenizer_class == "TokenizersBackend":
        cfg["pretokenize_regex"] = regex
    return cfg


ENDOFTEXT_ID, IM_START_ID, IM_END_ID = BASE_VOCAB, BASE_VOCAB + 1, BASE_VOCAB + 2

# ----------------------------------------------------------------------------------------
# Model configs (tiny)
# ----------------------------------------------------------------------------------------
COMMON_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=ENDOFTEXT_ID,
    eos_token_id=IM_END_ID,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
QWEN35_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
QWEN3_NEXT_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,  # == text hidden_size
    num_position_embeddings=16,  # 4x4 grid
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
)
VL_TOKEN_IDS = dict(image_token_id=400, video_token_id=401, vision_start_token_id=402, vision_end_token_id=403)


def make_config(name: str):
    if name == "qwen3_next":
        cfg = Qwen3NextConfig(
            **COMMON_TEXT,
            **MOE,
            num_hidden_layers=len(QWEN3_NEXT_LAYERS),
            layer_types=QWEN3_NEXT_LAYERS,
            intermediate_size=96,  # dense MLP of layer 1 only
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
        cfg.architectures = ["Qwen3NextForCausalLM"]
        return cfg
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],  # sums to rotary_dim/2 = 4
        "mrope_interleaved": True,
    }
    text = dict(
        COMMON_TEXT,
        num_hidden_layers=len(QWEN35_LAYERS),
        layer_types=QWEN35_LAYERS,
        rope_parameters=rope,
        # Present in the released Qwen3.5 text configs; HF keeps them as plain attributes.
        attn_output_gate=True,
        mamba_ssm_dtype="float32",
    )
    if name == "qwen3_5_moe":
        cfg = Qwen3_5MoeConfig(
            text_config=dict(text, **MOE), vision_config=dict(TINY_VISION), tie_word_embeddings=False, **VL_TOKEN_IDS
        )
        cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
        return cfg
    if name == "qwen3_5":
        cfg = Qwen3_5Config(
            text_config=dict(text, intermediate_size=96),
            vision_config=dict(TINY_VISION),
            tie_word_embeddings=False,
            **VL_TOKEN_IDS,
        )
        cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
        return cfg
    raise ValueError(name)


MODEL_SPECS = {
    # name: (model class built in memory, on-disk dtype, shards, tokenizer class, regex)
    "qwen3_next": (Qwen3NextForCausalLM, torch.float32, 1, "Qwen2Tokenizer", QWEN2_REGEX),
    "qwen3_5_moe": (Qwen3_5MoeForConditionalGeneration, torch.bfloat16, 3, "TokenizersBackend", QWEN3_5_REGEX),
    "qwen3_5": (Qwen3_5ForConditionalGeneration, torch.float32, 1, "TokenizersBackend", QWEN3_5_REGEX),
}

# ----------------------------------------------------------------------------------------
# Weight randomisation
# ----------------------------------------------------------------------------------------


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a seeded random value so that every term is exercised."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            shape = p.shape

            def normal(std, mean=0.0):
                return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

            def uniform(lo, hi):
                return torch.rand(shape, generator=g, dtype=torch.float32) * (hi - lo) + lo

            if ".visual." in name or name.startswith("model.visual"):
                v = normal(0.05) if p.dim() >= 2 else normal(0.02, 1.0 if "norm" in name and "weight" in name else 0.0)
            elif name.endswith("A_log"):
                v = uniform(1.0, 16.0).log()
            elif name.endswith("dt_bias"):
                v = uniform(-3.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                # Qwen3NextRMSNormGated: plain weight (HF init = 1)
                v = uniform(0.5, 1.5)
            elif "norm" in name:
                # zero-centred RMSNorm (output * (1 + w)), HF init = 0
                v = normal(0.1)
            elif "embed_tokens" in name:
                v = normal(0.5)
            elif "conv1d" in name:
                v = normal(0.4)
            elif "in_proj_qkv" in name:
                # Larger q/k/v(/z) projections keep the GDN read-out o = S^T q well above the
                # gated RMSNorm's eps (1e-6): with |o|^2 ~ eps that norm amplifies fp32 rounding
                # ~1000x and no independent implementation could match the fixtures tightly.
                v = normal(0.4)
            else:
                v = normal(0.15)
            p.copy_(v.to(p.dtype))


# ----------------------------------------------------------------------------------------
# On-disk layout
# ----------------------------------------------------------------------------------------


def disk_state_dict(name: str, model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors as the official release checkpoints name and lay them out."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().to(torch.float32).contiguous()
        if name == "qwen3_next" and k.endswith("mlp.experts.gate_up_proj"):
            # fused [E, 2I, H] (gate first) -> per-expert gate_proj/up_proj [I, H]
            prefix = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif name == "qwen3_next" and k.endswith("mlp.experts.down_proj"):
            prefix = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return {k: t.to(dtype).contiguous() for k, t in sorted(out.items())}


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)


def write_weights(folder: Path, sd: dict[str, torch.Tensor], shards: int) -> list[str]:
    if shards == 1:
        save_tensors(sd, folder / "model.safetensors")
        return ["model.safetensors"]
    # Shard by groups in a stable order: embeddings + first layers, later layers, head/visual.
    keys = list(sd)

    def shard_of(k: str) -> int:
        if k.startswith("lm_head") or ".visual." in k or k.startswith("model.visual"):
            return shards - 1
        if ".layers." in k:
            layer = int(k.split(".layers.")[1].split(".")[0])
            return 0 if layer < 2 else 1
        return 0 if "embed_tokens" in k else 1

    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    for k in keys:
        groups[shard_of(k)][k] = sd[k]
    files, weight_map = [], {}
    total = 0
    for i, grp in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_tensors(grp, folder / fn)
        files.append(fn)
        for k, t in grp.items():
            weight_map[k] = fn
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files + ["model.safetensors.index.json"]


def read_all_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for fn in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(fn)))
    return out


def hf_save_pretrained_layout(model, disk_sd) -> dict:
    """What would HF's own save_pretrained write?  Compared with our official layout."""
    with tempfile.TemporaryDirectory() as td:
        model.save_pretrained(td)
        hf = read_all_safetensors(Path(td))
    ours = {k: v.float() for k, v in disk_sd.items()}
    same_keys = set(hf) == set(ours)
    same_vals = same_keys and all(torch.equal(hf[k].float(), ours[k]) for k in ours)
    return {
        "same_keys_as_fixture": same_keys,
        "same_values_as_fixture": bool(same_vals),
        "only_in_save_pretrained": sorted(set(hf) - set(ours))[:6],
        "only_in_fixture": sorted(set(ours) - set(hf))[:6],
    }


# ----------------------------------------------------------------------------------------
# Golden outputs
# ----------------------------------------------------------------------------------------


# Robustness thresholds.  A Rust implementation legitimately differs from HF by ~1e-5..1e-4
# in fp32 (different summation order, recurrent vs chunked GDN).  If a greedy argmax or a
# top-k expert choice were decided by less than that, an exact-match test would be flaky, so
# prompts whose decisions are too close are re-drawn with the next seed (documented in
# golden.json: prompt_seeds and checks).
MIN_GREEDY_LOGIT_MARGIN = 5e-3
MIN_ROUTER_LOGIT_MARGIN = 1e-3
# ... and prompts on which HF's fp32 logits are far from the exact answer are re-drawn too,
# so that Rust tests can use tight tolerances.  "Exact" = tools/check_golden.py's independent
# token-by-token implementation run in float64 (HF itself casts the GDN core and the norms to
# fp32 even for a float64 model, so it cannot serve as the fp64 yardstick).  The remaining
# error comes from HF's fp32 chunked delta rule (~1e-5 relative in the state) amplified by the
# gated RMSNorm where a head's read-out S^T q happens to be small.
MAX_LOGIT_DIFF_VS_FP64_REFERENCE = 5e-4
MAX_PROMPT_ATTEMPTS = 64


def prompt_seed(length: int, attempt: int) -> int:
    return BASE_SEED + 1000 + length + 100000 * attempt


def prompt_ids(length: int, attempt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(prompt_seed(length, attempt))
    return torch.randint(0, BASE_VOCAB, (length,), generator=g, dtype=torch.int64)  # no special tokens


class RouterMargins:
    """Records the smallest gap between the k-th and (k+1)-th router logit (top-k boundary)."""

    def __init__(self, model):
        self.handles, self.min_margin = [], float("inf")
        for n, m in model.named_modules():
            if n.endswith("mlp.gate") and hasattr(m, "top_k"):
                self.handles.append(m.register_forward_hook(self._hook))

    def _hook(self, mod, inp, out):
        logits = out[0].float().sort(dim=-1, descending=True).values
        k = mod.top_k
        self.min_margin = min(self.min_margin, float((logits[:, k - 1] - logits[:, k]).min()))

    def take(self):
        m, self.min_margin = self.min_margin, float("inf")
        return None if m == float("inf") else m

    def remove(self):
        for h in self.handles:
            h.remove()


def top2_margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


@torch.no_grad()
def run_golden(model, text_cfg, ids: torch.Tensor):
    L = ids.numel()
    lin = [i for i, t in enumerate(text_cfg.layer_types) if t == "linear_attention"]
    full = [i for i, t in enumerate(text_cfg.layer_types) if t == "full_attention"]
    out = model(input_ids=ids[None], use_cache=True)
    cache = out.past_key_values
    tensors = {"ids": ids.clone(), "logits": out.logits[0].float().contiguous()}
    for i in lin:
        layer = cache.layers[i]
        rec = layer.recurrent_states[0]
        conv = layer.conv_states[0]
        assert rec.shape == (1, text_cfg.linear_num_value_heads, text_cfg.linear_key_head_dim, text_cfg.linear_value_head_dim), rec.shape
        conv_dim = 2 * text_cfg.linear_num_key_heads * text_cfg.linear_key_head_dim + text_cfg.linear_num_value_heads * text_cfg.linear_value_head_dim
        assert conv.shape == (1, conv_dim, text_cfg.linear_conv_kernel_dim), conv.shape
        tensors[f"layer{i}.recurrent"] = rec[0].float().contiguous()
        tensors[f"layer{i}.conv"] = conv[0].float().contiguous()
    for i in full:
        layer = cache.layers[i]
        assert layer.keys.shape == (1, text_cfg.num_key_value_heads, L, text_cfg.head_dim), layer.keys.shape
        tensors[f"layer{i}.k"] = layer.keys[0].float().contiguous()
        tensors[f"layer{i}.v"] = layer.values[0].float().contiguous()

    # Non-cached forward must agree with the cached prefill.
    nocache = model(input_ids=ids[None], use_cache=False).logits[0]
    diff_nocache = float((nocache - out.logits[0]).abs().max())

    # HF generate: greedy, exactly GREEDY_LEN tokens, EOS ignored (no eos => no processors touch logits).
    gen = model.generate(
        input_ids=ids[None],
        attention_mask=torch.ones(1, L, dtype=torch.long),
        do_sample=False,
        max_new_tokens=GREEDY_LEN,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=ENDOFTEXT_ID,
        output_logits=True,
        return_dict_in_generate=True,
        use_cache=True,
    )
    greedy = gen.sequences[0, L:].clone()
    assert greedy.numel() == GREEDY_LEN, greedy.shape
    greedy_logits = torch.stack([lg[0] for lg in gen.logits]).float().contiguous()
    assert torch.equal(greedy_logits.argmax(-1), greedy)
    tensors["greedy"] = greedy
    tensors["greedy_logits"] = greedy_logits

    # Manual cached decode (one token at a time through the recurrent path) == generate.
    step = model(input_ids=ids[None], use_cache=True)
    c = step.past_key_values
    manual, tok = [], step.logits[0, -1].argmax()
    for t in range(GREEDY_LEN):
        manual.append(int(tok))
        if t + 1 == GREEDY_LEN:
            break
        step = model(input_ids=tok.view(1, 1), past_key_values=c, use_cache=True)
        c = step.past_key_values
        tok = step.logits[0, -1].argmax()
    assert manual == greedy.tolist(), (manual, greedy.tolist())

    # Full (chunked) prefill of prompt+greedy reproduces the decode-path logits.
    full_seq = torch.cat([ids, greedy[:-1]])[None]
    pre = model(input_ids=full_seq, use_cache=False).logits[0, L - 1 :]
    diff_decode_vs_prefill = float((pre - greedy_logits).abs().max())

    checks = {
        "max_abs_diff_cached_vs_uncached_prefill_logits": diff_nocache,
        "max_abs_diff_decode_logits_vs_full_prefill": diff_decode_vs_prefill,
        "min_top2_logit_margin_greedy": top2_margin(greedy_logits),
    }
    return tensors, checks


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": numpy.__version__,
    }


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def generate_model(name: str, seed: int) -> dict:
    cls, disk_dtype, shards, tok_class, regex = MODEL_SPECS[name]
    folder = OUT_ROOT / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    print(f"== {name} -> {folder.relative_to(REPO_ROOT)}", flush=True)

    # ---- tokenizer files
    tok = build_tokenizer(regex)
    tok.save(str(folder / "tokenizer.json"), pretty=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok_class, regex), indent=2) + "\n")

    # ---- model + config
    config = make_config(name)
    torch.manual_seed(seed)  # HF init (overwritten below anyway)
    model = cls._from_config(config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)
    model.eval()
    randomise_(model, seed)
    if disk_dtype != torch.float32:
        with torch.no_grad():  # golden outputs are computed from the rounded weights
            for p in model.parameters():
                p.copy_(p.to(disk_dtype).to(torch.float32))
    disk_sd = disk_state_dict(name, model, disk_dtype)
    save_pretrained_info = hf_save_pretrained_layout(model, disk_sd)

    cfg_to_save = make_config(name)
    cfg_to_save.dtype = "bfloat16" if disk_dtype == torch.bfloat16 else "float32"
    if hasattr(cfg_to_save, "text_config"):
        cfg_to_save.text_config.dtype = cfg_to_save.dtype
    cfg_to_save.save_pretrained(str(folder))
    gen_cfg = {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "do_sample": False,
        "transformers_version": transformers.__version__,
    }
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    weight_files = write_weights(folder, disk_sd, shards)

    # ---- disk layout sanity
    on_disk = read_all_safetensors(folder)
    assert set(on_disk) == set(disk_sd)
    assert all(t.dtype == disk_dtype for t in on_disk.values())
    if name == "qwen3_next":
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in on_disk
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in on_disk
        assert not any(k.endswith("gate_up_proj") for k in on_disk)
    else:
        assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in on_disk
        assert "model.language_model.layers.0.linear_attn.in_proj_z.weight" in on_disk
        if name == "qwen3_5_moe":
            assert on_disk["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
            assert on_disk["model.language_model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 32)

    # ---- reload with HF's own loader (text CausalLM for the VL wrappers)
    ref, info = AutoModelForCausalLM.from_pretrained(
        str(folder),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    ref.eval()
    assert not info["missing_keys"], info["missing_keys"]
    assert not info.get("mismatched_keys"), info.get("mismatched_keys")
    text_cfg = ref.config.get_text_config(decoder=True)
    print(f"   reloaded as {type(ref).__name__}, unexpected keys ignored: {len(info['unexpected_keys'])}", flush=True)

    # ---- tokenizer checks (HF AutoTokenizer vs plain tokenizers.json)
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    raw_tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for s in TRAIN_TEXT.split("\n")[:40] + ["hello world", "  spaced  out\n\nnew", "<|im_start|>user\nhi<|im_end|>\n"]:
        a = hf_tok.encode(s, add_special_tokens=False)
        b = raw_tok.encode(s, add_special_tokens=False).ids
        assert a == b, (s, a, b)
    chat_text = hf_tok.apply_chat_template(CHAT_PROMPT, tokenize=False, add_generation_prompt=True)
    chat_ids = hf_tok.apply_chat_template(CHAT_PROMPT, tokenize=True, add_generation_prompt=True, return_dict=False)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    chat_ids = list(chat_ids)
    assert chat_ids == raw_tok.encode(chat_text, add_special_tokens=False).ids
    assert chat_ids[0] == IM_START_ID and chat_ids.count(IM_END_ID) == 2

    # ---- golden tensors
    golden: dict[str, torch.Tensor] = {}
    checks: dict[str, dict] = {}
    ref64 = check_golden.Model(folder, torch.float64)
    router = RouterMargins(ref)
    built_vs_reload = 0.0
    seeds_used = {}
    for L in PROMPT_LENS:
        for attempt in range(MAX_PROMPT_ATTEMPTS):
            ids = prompt_ids(L, attempt)
            router.take()
            tensors, chk = run_golden(ref, text_cfg, ids)  # covers prefill + every decode step
            chk["min_router_topk_logit_margin"] = router.take()
            exact = ref64.prefill_logits(ids.tolist())
            chk["max_abs_diff_logits_vs_fp64_reference"] = float((exact - tensors["logits"].double()).abs().max())
            ok = (
                chk["min_top2_logit_margin_greedy"] >= MIN_GREEDY_LOGIT_MARGIN
                and (
                    chk["min_router_topk_logit_margin"] is None
                    or chk["min_router_topk_logit_margin"] >= MIN_ROUTER_LOGIT_MARGIN
                )
                and chk["max_abs_diff_logits_vs_fp64_reference"] <= MAX_LOGIT_DIFF_VS_FP64_REFERENCE
            )
            if ok:
                break
            print(f"   L={L}: attempt {attempt} too close to a tie ({chk}), re-drawing prompt", flush=True)
        else:
            raise RuntimeError(f"no robust prompt found for L={L}")
        seeds_used[f"p{L}"] = prompt_seed(L, attempt)
        chk["prompt_attempt"] = attempt
        with torch.no_grad():
            built = model(input_ids=ids[None], use_cache=False).logits[0]
        chk["max_abs_diff_built_model_vs_reloaded"] = float((built - tensors["logits"]).abs().max())
        built_vs_reload = max(built_vs_reload, chk["max_abs_diff_built_model_vs_reloaded"])
        checks[f"p{L}"] = chk
        for k, v in tensors.items():
            golden[f"p{L}.{k}"] = v
        print(f"   L={L:3d} greedy={tensors['greedy'].tolist()}  checks={chk}", flush=True)
    router.remove()
    assert built_vs_reload < 1e-4, built_vs_reload
    for chk in checks.values():
        assert chk["max_abs_diff_cached_vs_uncached_prefill_logits"] < 1e-4
        assert chk["max_abs_diff_decode_logits_vs_full_prefill"] < 1e-3

    chat = torch.tensor(chat_ids, dtype=torch.int64)
    golden["chat.ids"] = chat
    with torch.no_grad():
        chat_gen = ref.generate(
            input_ids=chat[None],
            attention_mask=torch.ones(1, chat.numel(), dtype=torch.long),
            do_sample=False,
            max_new_tokens=GREEDY_LEN,
            eos_token_id=None,
            pad_token_id=ENDOFTEXT_ID,
        )
    golden["chat.greedy"] = chat_gen[0, chat.numel() :].clone()
    with torch.no_grad():
        chat_logits = ref(input_ids=torch.cat([chat, golden["chat.greedy"][:-1]])[None]).logits[0, chat.numel() - 1 :]
    assert torch.equal(chat_logits.argmax(-1), golden["chat.greedy"])
    checks["chat"] = {"min_top2_logit_margin_greedy": top2_margin(chat_logits)}

    golden = {k: v.contiguous() for k, v in sorted(golden.items())}
    save_tensors(golden, folder / "golden.safetensors")

    lin = [i for i, t in enumerate(text_cfg.layer_types) if t == "linear_attention"]
    full = [i for i, t in enumerate(text_cfg.layer_types) if t == "full_attention"]
    meta = {
        "model": name,
        "model_type": config.model_type,
        "text_model_type": text_cfg.model_type,
        "architectures": config.architectures,
        "hf_reference_class": type(ref).__name__,
        "weights_prefix": "model.language_model." if name != "qwen3_next" else "model.",
        "versions": versions(),
        "seed": seed,
        "prompt_lens": PROMPT_LENS,
        "prompt_ids": "torch.randint(0, 317, (L,), generator=torch.Generator().manual_seed(seed)) with seed = prompt_seeds[pL]",
        "prompt_seeds": seeds_used,
        "robustness": {
            "min_greedy_top2_logit_margin": MIN_GREEDY_LOGIT_MARGIN,
            "min_router_topk_logit_margin": MIN_ROUTER_LOGIT_MARGIN,
            "max_logit_diff_vs_fp64_reference": MAX_LOGIT_DIFF_VS_FP64_REFERENCE,
            "note": "prompts re-drawn until every greedy argmax and every top-k expert choice (prefill and decode) is decided by at least these logit margins, and HF's fp32 prefill logits are within max_logit_diff_vs_fp64_reference of tools/check_golden.py's independent float64 implementation",
        },
        "greedy_len": GREEDY_LEN,
        "layer_types": list(text_cfg.layer_types),
        "linear_attention_layers": lin,
        "full_attention_layers": full,
        "dense_mlp_layers": list(getattr(text_cfg, "mlp_only_layers", []) or []) if name != "qwen3_5" else list(range(len(text_cfg.layer_types))),
        "vocab_size": text_cfg.vocab_size,
        "special_tokens": {"<|endoftext|>": ENDOFTEXT_ID, "<|im_start|>": IM_START_ID, "<|im_end|>": IM_END_ID},
        "dtype": {
            "weights_on_disk": str(disk_dtype).replace("torch.", ""),
            "reference_compute": "float32 (CPU); bf16 weights are upcast exactly, so the golden outputs are the fp32 forward of the bf16-rounded weights"
            if disk_dtype == torch.bfloat16
            else "float32 (CPU)",
            "golden_tensors": "float32 (logits/states/KV), int64 (ids/greedy)",
        },
        "hf_paths": {
            "attn_implementation": "eager",
            "experts_implementation": "eager",
            "fla_installed": importlib.util.find_spec("fla") is not None,
            "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None,
            "prefill": "torch_chunk_gated_delta_rule (chunk 64) + causal_conv1d_fn (torch conv1d)",
            "decode": "torch_recurrent_gated_delta_rule + causal_conv1d_update (seq_len==1 with cache)",
        },
        "tensor_layout": {
            "pL.ids": "int64 [L]",
            "pL.logits": "float32 [L, vocab] -- every prefill position",
            "pL.layerI.recurrent": "float32 [Hv, dk, dv] -- final GDN state after prefill (K-major; o = S^T q)",
            "pL.layerI.conv": "float32 [conv_dim, K] -- last K pre-conv inputs [q_all|k_all|v_all] along time (oldest first), left zero-padded when L<K",
            "pL.layerI.k / .v": "float32 [Hkv, L, head_dim] -- keys after k_norm + partial RoPE; values raw",
            "pL.greedy": "int64 [16] -- model.generate(do_sample=False, max_new_tokens=16), EOS disabled",
            "pL.greedy_logits": "float32 [16, vocab] -- logits that chose each greedy token (row 0 = last prefill row; rows 1.. from the cached one-token decode path)",
            "chat.ids": "int64 -- tokenizer.apply_chat_template(chat.prompt, add_generation_prompt=True)",
            "chat.greedy": "int64 [16] -- greedy continuation of chat.ids, EOS disabled",
        },
        "tensors": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in golden.items()},
        "chat": {"prompt": CHAT_PROMPT, "text": chat_text, "ids": chat_ids, "add_generation_prompt": True},
        "checks": checks,
        "hf_save_pretrained_vs_fixture_layout": save_pretrained_info,
        "weight_files": weight_files,
        "files_sha256": {},
    }
    for fn in sorted(p.name for p in folder.iterdir() if p.is_file()):
        meta["files_sha256"][fn] = sha256(folder / fn)
    (folder / "golden.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for pkg in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(pkg) is not None:
            print(f"error: {pkg} is installed; HF would use its kernels instead of the torch fallbacks", file=sys.stderr)
            return 1
    names = argv or list(MODEL_SPECS)
    for idx, name in enumerate(MODEL_SPECS):
        if name in names:
            generate_model(name, BASE_SEED + 17 * (idx + 1))
    print(f"done: {OUT_ROOT.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
