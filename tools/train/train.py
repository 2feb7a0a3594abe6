#!/usr/bin/env python3
"""Train HYPIC-tiny (HF transformers Qwen3NextForCausalLM, from scratch) on the
multi-document QA stream of gen_corpus.py, then measure greedy exact match on the
held-out set with full recompute.

Typical run on the GPU machine (see tools/README-train.md for the exact command used):

    PYTHONUNBUFFERED=1 python3 tools/train/train.py --device cuda --out $OUT/run \
        --tokenizer models/hypic-tiny/tokenizer.json --heldout models/hypic-tiny/eval/heldout.jsonl \
        --steps 4000 --time-limit 500

Outputs in --out: model.safetensors (fp32) + config.json + generation_config.json
(HF save_pretrained), loss.csv, val.csv, metrics.json, train.log.  A checkpoint with the
optimizer state (ckpt.pt) is written to --ckpt-dir every --ckpt-every steps and at the
end; --resume continues from it (same data stream, same schedule), --init-from starts a
new schedule from saved weights.  A wall-clock guard (--time-limit, --reserve) stops
training early enough to evaluate and save.

Data: example i of batch b is gen_corpus.make_example(seed, b * 1024 + i): the stream is
the same whatever the worker count, and a resumed run continues it.

Loss: mean cross entropy over answer tokens (each assistant answer and its <|im_end|>)
+ ctx_weight * mean cross entropy over all other tokens (documents, questions, template).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gen_corpus as gc  # noqa: E402
import gen_ledger  # noqa: E402

# --task: the generator of the training stream, validation and held-out style examples
TASKS = {"qa": gc, "ledger": gen_ledger}

EXAMPLES_PER_BATCH_SLOT = 1024
BUCKETS = (128, 256, 384, 512, 640, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 4096, 6144, 8192)
VAL_SEED = 4242


# ------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------
def model_config(vocab_size: int, im_end: int, pad: int, layers: int = 12, hidden: int = 256,
                 attn_layers: list[int] | None = None):
    """attn_layers: indices of the full-attention layers (default every 4th: 3, 7, 11, ...);
    all other layers are Gated DeltaNet."""
    from transformers import Qwen3NextConfig

    if attn_layers is None:
        attn_layers = [i for i in range(layers) if (i + 1) % 4 == 0]
    layer_types = ["full_attention" if i in attn_layers else "linear_attention" for i in range(layers)]
    return Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        shared_expert_intermediate_size=0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=16384,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        attention_bias=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=pad,
        use_cache=True,
    )


def gdn_decay_init(model, seed: int) -> None:
    """Mamba-2 / fla-style initialisation of the Gated DeltaNet decay, in place.

    HF's Qwen3-Next init sets dt_bias = 1 and A ~ U(0.01, 16), so the per-token log-decay
    g = -A * softplus(a + dt_bias) starts at about -A * 1.31: every head forgets within a few
    tokens (half-life under 1 token for A > 0.5), and the gradient that would teach a head to
    keep a write for hundreds of tokens vanishes through that decay.  Here, per value head,
    dt ~ logU(1e-3, 1e-1), dt_bias = softplus^-1(dt) and A ~ U(1, 16), so g starts in
    [-1.6, -0.001]: some heads keep a write for thousands of tokens from the first step.
    The architecture and the checkpoint format are unchanged."""
    gen = torch.Generator().manual_seed(seed + 17)
    for mod in model.modules():
        if hasattr(mod, "dt_bias") and hasattr(mod, "A_log"):
            n = mod.dt_bias.numel()
            dt = torch.exp(torch.rand(n, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            with torch.no_grad():
                mod.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
                mod.A_log.copy_(torch.empty(n).uniform_(1.0, 16.0, generator=gen).log())


class FallbackWatch(logging.Handler):
    """Collects transformers' 'falling back to its reference PyTorch implementation' warnings."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "falling back" in msg:
            self.messages.append(msg)


# ------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------
class TrainBatches(torch.utils.data.Dataset):
    """Item b = one padded batch of training examples (token budget per batch)."""

    def __init__(self, seed, tokenizer_path, batch_tokens, n_extra, p_two_hop, n_batches, pad_id, im_end_id,
                 bucket_pool=0, task="qa", curriculum=0):
        self.task = task
        self.curriculum = curriculum  # ledger only: document lengths ramp up over this many examples
        self.bucket_pool = bucket_pool  # >0: item = a list of length-bucketed batches from this many examples
        self.seed, self.tokenizer_path = seed, tokenizer_path
        self.batch_tokens, self.n_extra, self.p_two_hop = batch_tokens, n_extra, p_two_hop
        self.n_batches, self.pad_id, self.im_end_id = n_batches, pad_id, im_end_id
        self._count = None
        self._tok = None

    def __len__(self):
        return self.n_batches

    def make(self, index):
        kw = {}
        if self.task == "ledger" and self.curriculum:
            kw["length_scale"] = min(1.0, 0.05 + 0.95 * (index // EXAMPLES_PER_BATCH_SLOT) / self.curriculum)
        return TASKS[self.task].make_example(self.seed, index, self._count, n_extra=self.n_extra,
                                             p_two_hop=self.p_two_hop, **kw)

    def _init(self):
        if self._tok is None:
            self._count = gc.TokCounter(self.tokenizer_path)
            self._tok = self._count.tok

    def encode_example(self, ex):
        """ids and per-token 'is answer' flags; pieces are encoded separately (every piece
        boundary is a pre-token boundary, see FORMAT.md) and concatenated."""
        pieces = [(s, 1) for s in gc.segments(ex)] + self._reply_pieces(ex["answer"], ex.get("bridge"))
        for q in ex.get("extra", []):
            pieces.append((gc.followup_text(q["question"], None), 1))
            pieces += self._reply_pieces(q["answer"], q.get("bridge"))
        encs = self._tok.encode_batch([p for p, _ in pieces], add_special_tokens=False)
        ids, ans = [], []
        for (_, cls), e in zip(pieces, encs):
            ids.extend(e.ids)
            ans.extend([cls] * len(e.ids))
        return ids, ans

    @staticmethod
    def _reply_pieces(answer, bridge):
        """A reply as (text, class) pieces: class 3 for the final answer's tokens (after
        the bridge separator, without <|im_end|>), 2 for the rest of the reply.  Every
        piece boundary is a pre-token boundary (" ->" then " answer"), so the ids equal
        those of the whole reply."""
        if bridge:
            sep = gc.BRIDGE_SEP.rstrip()
            return [(bridge + sep, 2), (" " + answer, 3), (gc.IM_END, 2)]
        return [(answer, 3), (gc.IM_END, 2)]

    def _pack(self, rows, T, n_rows):
        x = torch.full((n_rows, T), self.pad_id, dtype=torch.long)
        w = torch.zeros((n_rows, T), dtype=torch.int8)  # class of the TARGET at t (predicting x[t+1]): 0 pad, 1 ctx, 2 reply, 3 final answer
        for r, (ids, ans) in enumerate(rows):
            x[r, : len(ids)] = torch.tensor(ids)
            w[r, : len(ids) - 1] = torch.tensor(ans[1:], dtype=torch.int8)
        return {"input_ids": x, "cls": w, "n_examples": len(rows), "n_tokens": sum(len(r[0]) for r in rows)}

    def _bucketed(self, m):
        """Item m: examples m*1024 .. m*1024+pool-1, grouped by length into fixed shapes
        (T, batch_tokens // T) for T in BUCKETS (few distinct shapes: little padding, few
        Triton autotune keys); examples left over in a bucket move up to the next one; the
        last partial batch is filled with all-padding rows (no loss).  Batches shuffled."""
        by = {T: [] for T in BUCKETS}
        for i in range(self.bucket_pool):
            ex = self.make(m * EXAMPLES_PER_BATCH_SLOT + i)
            ids, ans = self.encode_example(ex)
            T = next((t for t in BUCKETS if len(ids) <= t), None)
            if T is not None:
                by[T].append((ids, ans))
        out, carry = [], []
        for T in BUCKETS:
            n_rows = max(1, self.batch_tokens // T)
            items = carry + by[T]
            while len(items) >= n_rows:
                out.append(self._pack(items[:n_rows], T, n_rows))
                items = items[n_rows:]
            carry = items
        if carry:
            T = next(t for t in BUCKETS if max(len(r[0]) for r in carry) <= t)
            out.append(self._pack(carry, T, max(1, self.batch_tokens // T)))
        random.Random(f"{self.seed}:shuffle:{m}").shuffle(out)
        return out

    def __getitem__(self, b):
        self._init()
        if self.bucket_pool:
            return self._bucketed(b)
        rows, n_tok, i = [], 0, 0
        maxlen = 0
        while i < EXAMPLES_PER_BATCH_SLOT:
            ex = self.make(b * EXAMPLES_PER_BATCH_SLOT + i)
            i += 1
            ids, ans = self.encode_example(ex)
            new_max = max(maxlen, len(ids))
            if rows and (len(rows) + 1) * ((new_max + 63) // 64 * 64) > self.batch_tokens:
                break
            rows.append((ids, ans))
            maxlen = new_max
        T = (maxlen + 63) // 64 * 64
        x = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        w = torch.zeros((len(rows), T), dtype=torch.int8)  # class of the TARGET at t (predicting x[t+1]): 0 pad, 1 ctx, 2 reply, 3 final answer
        for r, (ids, ans) in enumerate(rows):
            x[r, : len(ids)] = torch.tensor(ids)
            cls = torch.tensor(ans[1:], dtype=torch.int8)
            w[r, : len(ids) - 1] = cls
        return {"input_ids": x, "cls": w, "n_examples": len(rows), "n_tokens": sum(len(r[0]) for r in rows)}


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def make_val(tokenizer_path, n, task="qa"):
    count = gc.TokCounter(tokenizer_path)
    return [TASKS[task].make_example(VAL_SEED, i, count, hop=1 + i % 2) for i in range(n)]



# ------------------------------------------------------------------------------------
# Evaluation: greedy decoding, full recompute (the whole prompt + generated tokens in
# one forward per generated token; right padding, causal, so padding never matters)
# ------------------------------------------------------------------------------------
def normalize_answer(s: str) -> str:
    import re
    import string

    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


@torch.no_grad()
def greedy_eval(model, tok, examples, device, im_end_id, pad_id, max_new=24, batch_tokens=262144, autocast=True):
    model.eval()
    prompts = [tok.encode(gc.prompt_text(ex), add_special_tokens=False).ids for ex in examples]
    order = sorted(range(len(examples)), key=lambda i: len(prompts[i]))
    outputs: dict[int, list[int]] = {}
    pos = 0
    while pos < len(order):
        L = len(prompts[order[pos]])
        bs = 1
        while pos + bs < len(order) and (bs + 1) * (len(prompts[order[pos + bs]]) + max_new) <= batch_tokens:
            bs += 1
        idx = order[pos: pos + bs]
        pos += bs
        T = max(len(prompts[i]) for i in idx) + max_new
        buf = torch.full((len(idx), T), pad_id, dtype=torch.long, device=device)
        lens = torch.tensor([len(prompts[i]) for i in idx], device=device)
        for r, i in enumerate(idx):
            buf[r, : len(prompts[i])] = torch.tensor(prompts[i], device=device)
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        gen = [[] for _ in idx]
        for _ in range(max_new):
            cur = int(lens.max())
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                h = model.model(input_ids=buf[:, :cur], use_cache=False).last_hidden_state
                hl = h[torch.arange(len(idx), device=device), lens - 1]
                nxt = model.lm_head(hl).float().argmax(-1)
            for r in range(len(idx)):
                if not done[r]:
                    gen[r].append(int(nxt[r]))
            upd = ~done
            buf[torch.arange(len(idx), device=device)[upd], lens[upd]] = nxt[upd]
            lens = lens + upd.long()
            done = done | (nxt == im_end_id)
            if bool(done.all()):
                break
        for r, i in enumerate(idx):
            outputs[i] = gen[r]
    recs = []
    for i, ex in enumerate(examples):
        g = outputs[i]
        stopped = im_end_id in g
        text = tok.decode(g[: g.index(im_end_id)] if stopped else g, skip_special_tokens=True)
        ans = gc.final_answer(text)
        rec = {"id": ex.get("id"), "hop": ex["hop"], "qtype": ex.get("qtype"), "answer": ex["answer"],
               "pred": text, "stopped": stopped,
               "em": ans == ex["answer"],
               "em_norm": normalize_answer(ans) == normalize_answer(ex["answer"])}
        if ex.get("bridge"):
            i = text.rfind(gc.BRIDGE_SEP.strip())
            rec["bridge_em"] = i >= 0 and normalize_answer(text[:i]) == normalize_answer(ex["bridge"])
        recs.append(rec)
    model.train()
    return recs


def summarize(recs):
    out = {}
    for key, sel in [("all", lambda r: True), ("hop1", lambda r: r["hop"] == 1), ("hop2", lambda r: r["hop"] == 2)]:
        rs = [r for r in recs if sel(r)]
        if rs:
            out[key] = {"n": len(rs), "em": sum(r["em"] for r in rs) / len(rs),
                        "em_norm": sum(r["em_norm"] for r in rs) / len(rs)}
            br = [r["bridge_em"] for r in rs if "bridge_em" in r]
            if br:
                out[key]["bridge_em"] = sum(br) / len(br)
    return out


# ------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------
def lr_at(step, total, peak, warmup, final_frac):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--heldout", default=None, help="held-out JSONL for the final evaluation")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=4000, help="schedule length (optimizer steps)")
    ap.add_argument("--batch-tokens", type=int, default=65536)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--final-lr-frac", type=float, default=0.1)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--ctx-weight", type=float, default=0.3)
    ap.add_argument("--item-weight", type=float, default=0.0,
                    help="extra weight on the final answer's tokens (after the bridge), on top of the reply mean")
    ap.add_argument("--n-extra", type=int, default=3)
    ap.add_argument("--p-two-hop", type=float, default=0.6)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--attn-layers", default=None,
                    help="comma-separated indices of the full-attention layers (default: every 4th, 3,7,11)")
    ap.add_argument("--task", default="qa", choices=sorted(TASKS),
                    help="qa: gen_corpus.py (hypic-tiny); ledger: gen_ledger.py (hypic-ledger)")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--gdn-init", default="hf", choices=["hf", "mamba"],
                    help="GDN decay initialisation of a new model: HF's (fast forgetting) or Mamba-2/fla-style "
                         "(see gdn_decay_init)")
    ap.add_argument("--curriculum", type=int, default=0,
                    help="ledger task: document lengths ramp from 5%% to 100%% of the held-out range over the "
                         "first this many data items (an item is one batch, or with --bucket-pool one pool of "
                         "examples); 0: off")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default); 1 is fastest on a shared 2-core machine")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--val-n", type=int, default=128)
    ap.add_argument("--ckpt-dir", default="/tmp/hypic_ckpt")
    ap.add_argument("--ckpt-every", type=int, default=1000)
    ap.add_argument("--resume", default=None, help="ckpt.pt to continue (same schedule, same data stream)")
    ap.add_argument("--init-from", default=None, help="model folder to start from (new optimizer and schedule)")
    ap.add_argument("--start-batch", type=int, default=0, help="first data batch index (with --init-from)")
    ap.add_argument("--time-limit", type=float, default=1e9, help="seconds from start; training stops at time-limit - reserve")
    ap.add_argument("--reserve", type=float, default=60.0)
    ap.add_argument("--require-fla", action="store_true")
    ap.add_argument("--no-fp32-eval", action="store_true")
    ap.add_argument("--fla-dqkwg", default="torch", choices=["torch", "triton", "none"],
                    help="how to run fla's gated chunk_bwd_dqkwg on Hopper + Triton < 3.7.1 (see fla_patch.py); "
                         "the chosen mode is gradchecked against an fp32 reference first")
    ap.add_argument("--schedule", default="steps", choices=["steps", "time"],
                    help="cosine over --steps optimizer steps, or over the training time left by the wall-clock guard")
    ap.add_argument("--eval-every-s", type=float, default=0, help="validation every this many seconds (0: off)")
    ap.add_argument("--bucket-pool", type=int, default=0,
                    help="length bucketing: each data item is this many examples packed into fixed-shape batches "
                         "(0: off, one batch per item padded to its longest example)")
    a = ap.parse_args(argv)
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.ckpt_dir, exist_ok=True)
    logf = open(os.path.join(a.out, "train.log"), "a")

    def log(*xs):
        s = " ".join(str(x) for x in xs)
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    import tokenizers
    import transformers
    from transformers import Qwen3NextForCausalLM
    from transformers.utils import logging as hf_logging

    watch = FallbackWatch()
    hf_logging.get_logger("transformers").addHandler(watch)
    try:
        import fla  # noqa: F401

        fla_version = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        fla_version = f"not importable: {e!r}"
    log(f"torch {torch.__version__} transformers {transformers.__version__} tokenizers {tokenizers.__version__} fla {fla_version}")
    log("args", json.dumps(vars(a)))

    random.seed(a.seed)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        log("gpu", torch.cuda.get_device_name(0))

    tok = tokenizers.Tokenizer.from_file(a.tokenizer)
    im_end = tok.token_to_id(gc.IM_END)
    pad = tok.token_to_id(gc.ENDOFTEXT)
    vocab = tok.get_vocab_size()
    if a.init_from:
        model = Qwen3NextForCausalLM.from_pretrained(a.init_from, dtype=torch.float32)
    else:
        attn = [int(x) for x in a.attn_layers.split(",")] if a.attn_layers else None
        cfg = model_config(vocab, im_end, pad, a.layers, a.hidden, attn)
        model = Qwen3NextForCausalLM(cfg)
    if not a.init_from and not a.resume and a.gdn_init == "mamba":
        gdn_decay_init(model, a.seed)
        log("GDN decay init: dt log-uniform in [1e-3, 1e-1] (dt_bias = softplus^-1(dt)), A uniform in [1, 16]")
    model.to(device)
    model.train()
    if device.type == "cpu":  # CPU pilot runs: faster, equivalent PyTorch fallbacks (cpu_fast.py)
        import cpu_fast

        cpu_fast.apply()
        log(f"cpu_fast patches applied; max abs difference to HF's fallbacks {cpu_fast.check():.2e}")
    dqkwg_mode, gradchecks = "none", {}
    if device.type == "cuda" and not fla_version.startswith("not"):
        import fla_patch

        dqkwg_mode = fla_patch.apply(a.fla_dqkwg)
        tg = time.time()
        try:
            gradchecks[dqkwg_mode] = fla_patch.gradcheck(device, H=model.config.linear_num_value_heads,
                                                         K=model.config.linear_key_head_dim,
                                                         V=model.config.linear_value_head_dim)
        except Exception as e:  # noqa: BLE001
            gradchecks[dqkwg_mode] = {"error": repr(e)[:300]}
        log(f"gradcheck fla (dqkwg={dqkwg_mode}) vs fp32 reference, rel L2 errors: {gradchecks[dqkwg_mode]} "
            f"({time.time() - tg:.1f}s)")
        g = gradchecks[dqkwg_mode]
        if "error" in g or max(g.values()) > 0.05:
            log("ERROR: fla gradients do not match the reference")
            return 4
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    log(f"params {n_params} ({n_params / 1e6:.2f} M; embeddings+lm_head {n_emb / 1e6:.2f} M)")
    log("layer_types", model.config.layer_types)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    step, start_batch = 0, a.start_batch
    tokens_seen, examples_seen = 0, 0
    if a.resume:
        ck = torch.load(a.resume, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, tokens_seen, examples_seen = ck["step"], ck["tokens_seen"], ck["examples_seen"]
        start_batch = ck["next_batch"]
        log(f"resumed from {a.resume} at step {step}, next batch {start_batch}")

    ds = TrainBatches(a.seed, a.tokenizer, a.batch_tokens, a.n_extra, a.p_two_hop, 10**8, pad, im_end,
                      bucket_pool=a.bucket_pool, task=a.task, curriculum=a.curriculum)
    sampler = range(start_batch, start_batch + (a.steps - step) + 10)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler, num_workers=a.workers,
                                     prefetch_factor=6 if a.workers else None, persistent_workers=False,
                                     pin_memory=device.type == "cuda")
    val = make_val(a.tokenizer, a.val_n, a.task) if a.val_n else []

    loss_f = open(os.path.join(a.out, "loss.csv"), "a", newline="")
    loss_w = csv.writer(loss_f)
    if os.path.getsize(os.path.join(a.out, "loss.csv")) == 0:
        loss_w.writerow(["step", "elapsed_s", "lr", "loss", "loss_ans", "loss_ctx", "tokens_seen", "examples_seen", "tok_per_s", "grad_norm", "loss_item"])
    val_f = open(os.path.join(a.out, "val.csv"), "a", newline="")
    val_w = csv.writer(val_f)
    if os.path.getsize(os.path.join(a.out, "val.csv")) == 0:
        val_w.writerow(["step", "elapsed_s", "em_all", "em_hop1", "em_hop2"])

    def save_ckpt(next_batch):
        path = os.path.join(a.ckpt_dir, "ckpt.pt")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "tokens_seen": tokens_seen,
                    "examples_seen": examples_seen, "next_batch": next_batch, "args": vars(a)}, path + ".tmp")
        os.replace(path + ".tmp", path)

    def run_val():
        recs = greedy_eval(model, tok, val, device, im_end, pad)
        s = summarize(recs)
        val_w.writerow([step, round(time.time() - t0, 1), s["all"]["em"], s.get("hop1", {}).get("em"), s.get("hop2", {}).get("em")])
        val_f.flush()
        log(f"[val] step {step} EM all {s['all']['em']:.3f} hop1 {s['hop1']['em']:.3f} hop2 {s['hop2']['em']:.3f}")

    deadline = t0 + a.time_limit - a.reserve
    t_train0 = time.time()
    train_budget = max(1.0, deadline - t_train0)
    t_val_last = time.time()
    t_last, tok_last = time.time(), tokens_seen
    acc = {"loss": 0.0, "ans": 0.0, "ctx": 0.0, "item": 0.0, "n": 0}
    batch_idx = start_batch
    stopped_by = "steps"
    first = True
    data_wait = 0.0
    t_wait = time.time()
    def flat(loader):  # items are batches, or lists of batches with --bucket-pool
        nonlocal batch_idx
        for item in loader:
            for sub in (item if isinstance(item, list) else [item]):
                yield sub
            batch_idx += 1

    for batch in flat(dl):
        data_wait += time.time() - t_wait
        if step >= a.steps:
            break
        if time.time() > deadline:
            stopped_by = "time"
            break
        x = batch["input_ids"].to(device, non_blocking=True)
        cls = batch["cls"].to(device, non_blocking=True)
        if a.schedule == "time":  # warmup by steps, then cosine over the fraction of training time used
            if step < a.warmup:
                lr = a.lr * (step + 1) / a.warmup
            else:
                p = min(1.0, (time.time() - t_train0) / train_budget)
                lr = a.lr * (a.final_lr_frac + (1 - a.final_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))
        else:
            lr = lr_at(step, a.steps, a.lr, a.warmup, a.final_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        c = cls[:, :-1]
        if a.ctx_weight == 0:  # reply tokens only: the lm_head runs on those positions alone
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                h = model.model(input_ids=x, use_cache=False).last_hidden_state
                sel = c >= 2
                lg = model.lm_head(h[:, :-1][sel])
            ce_s = F.cross_entropy(lg.float(), x[:, 1:][sel], reduction="none")
            is_item = (c[sel] == 3).float()
            l_ans = ce_s.mean()
            l_item = (ce_s * is_item).sum() / is_item.sum().clamp(min=1)
            l_ctx = torch.zeros((), device=device)
        else:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids=x, use_cache=False).logits
            ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                 reduction="none").view(x.shape[0], -1)
            m_ans, m_ctx, m_item = (c >= 2).float(), (c == 1).float(), (c == 3).float()
            l_ans = (ce * m_ans).sum() / m_ans.sum().clamp(min=1)
            l_ctx = (ce * m_ctx).sum() / m_ctx.sum().clamp(min=1)
            l_item = (ce * m_item).sum() / m_item.sum().clamp(min=1)
        loss = l_ans + a.ctx_weight * l_ctx + a.item_weight * l_item
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += batch["n_tokens"]
        examples_seen += batch["n_examples"]
        acc["loss"] += loss.item()
        acc["ans"] += l_ans.item()
        acc["ctx"] += l_ctx.item()
        acc["item"] += l_item.item()
        acc["n"] += 1
        if first:
            first = False
            log(f"first step done at {time.time() - t0:.1f}s; batch {tuple(x.shape)}; fallbacks: {watch.messages}")
            if a.require_fla and any("chunk_gated_delta_rule" in m for m in watch.messages):
                log("ERROR: GDN runs on the torch fallback (fla not used)")
                return 3
        if step % a.log_every == 0 or step == a.steps:
            now = time.time()
            tps = (tokens_seen - tok_last) / max(1e-9, now - t_last)
            t_last, tok_last = now, tokens_seen
            n = acc["n"]
            row = [step, round(now - t0, 1), f"{lr:.3e}", f"{acc['loss'] / n:.4f}", f"{acc['ans'] / n:.4f}",
                   f"{acc['ctx'] / n:.4f}", tokens_seen, examples_seen, round(tps), f"{float(gn):.3f}", f"{acc['item'] / n:.4f}"]
            loss_w.writerow(row)
            loss_f.flush()
            log(f"step {step} t {now - t0:.0f}s lr {lr:.2e} loss {acc['loss'] / n:.4f} ans {acc['ans'] / n:.4f} "
                f"ctx {acc['ctx'] / n:.4f} item {acc['item'] / n:.4f} tok/s {tps:.0f} ex {examples_seen} gn {float(gn):.2f} data_wait {data_wait:.1f}s")
            acc = {"loss": 0.0, "ans": 0.0, "ctx": 0.0, "item": 0.0, "n": 0}
        if val and ((a.eval_every and step % a.eval_every == 0)
                    or (a.eval_every_s and time.time() - t_val_last > a.eval_every_s)):
            run_val()
            t_val_last = time.time()
        if a.ckpt_every and step % a.ckpt_every == 0:
            save_ckpt(batch_idx)
        t_wait = time.time()
    train_time = time.time() - t_train0
    log(f"training stopped by {stopped_by} at step {step}; train loop {train_time:.1f}s; tokens {tokens_seen}; examples {examples_seen}")
    save_ckpt(batch_idx)
    if val:
        run_val()

    # ---- save (fp32 weights; the shipped model is the bf16 rounding of these)
    model.config.use_cache = True
    model.save_pretrained(a.out, safe_serialization=True)
    log(f"saved model to {a.out} at {time.time() - t0:.1f}s")

    metrics = {"fla_dqkwg": dqkwg_mode, "gradchecks": gradchecks, "params": n_params, "steps": step, "data_wait_s": round(data_wait, 1), "tokens_seen": tokens_seen, "examples_seen": examples_seen,
               "train_loop_s": round(train_time, 1), "stopped_by": stopped_by, "seed": a.seed,
               "tok_per_s_mean": round(tokens_seen / max(1e-9, train_time)), "fallbacks": watch.messages,
               "fla": fla_version, "torch": torch.__version__, "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "args": vars(a)}
    with open(os.path.join(a.out, "metrics.json"), "w") as f:  # partial, rewritten below
        json.dump(metrics, f, indent=2)
    if a.heldout:
        held = load_jsonl(a.heldout)
        # evaluate the weights that ship: bf16-rounded
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
        te = time.time()
        recs = greedy_eval(model, tok, held, device, im_end, pad, autocast=True)
        metrics["heldout_bf16_autocast"] = summarize(recs)
        metrics["heldout_bf16_autocast_s"] = round(time.time() - te, 1)
        log(f"[heldout bf16-autocast] {json.dumps(metrics['heldout_bf16_autocast'])} in {time.time() - te:.1f}s")
        with open(os.path.join(a.out, "heldout_preds.jsonl"), "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        bf16_eval_s = time.time() - te
        left = t0 + a.time_limit - time.time()
        if a.no_fp32_eval or left < 3 * bf16_eval_s + 10:
            log(f"skipping the fp32 held-out evaluation ({left:.0f}s left)")
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            te = time.time()
            recs32 = greedy_eval(model, tok, held, device, im_end, pad, autocast=False)
            metrics["heldout_fp32"] = summarize(recs32)
            metrics["heldout_fp32_s"] = round(time.time() - te, 1)
            metrics["fp32_vs_bf16_pred_agreement"] = sum(r1["pred"] == r2["pred"] for r1, r2 in zip(recs, recs32)) / len(recs)
            with open(os.path.join(a.out, "heldout_preds_fp32.jsonl"), "w") as f:
                for r in recs32:
                    f.write(json.dumps(r) + "\n")
            log(f"[heldout fp32] {json.dumps(metrics['heldout_fp32'])} in {time.time() - te:.1f}s")
    metrics["total_s"] = round(time.time() - t0, 1)
    with open(os.path.join(a.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    log(f"done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
