#!/usr/bin/env python3
"""CPU prefill / decode throughput of HF transformers, the yardstick for
``dataplane/examples/bench_model.rs`` (see benches/cpu_model.sh).

Modes
-----
Benchmark (default) -- same measurement as the Rust example::

    /work/pyenv/hf/bin/python tools/bench_hf_cpu.py --model DIR \
        --prompt-len 128 --decode-tokens 32 --repeats 5 [--warmup 1] [--seed 0] [--threads N]

  fp32 weights and compute, ``torch.inference_mode()`` (no autograd),
  ``torch.set_num_threads(threads)`` (default: every core), HF's default attention and
  experts implementations (recorded in the output). Each repeat: a fresh cache, one
  prefill forward of the whole prompt (``logits_to_keep=1``, i.e. last-token logits
  only, like the Rust ``Logits::Last``), then ``decode-tokens`` one-token greedy forwards
  with the cache. Prompt ids: SplitMix64(seed) % vocab, bit-identical to the Rust
  example, so the greedy continuations of the two can be compared. Prints JSON with the
  median tokens/s over repeats.

Make a random-weight checkpoint::

    /work/pyenv/hf/bin/python tools/bench_hf_cpu.py --make-model data/bench/qwen3_next_0.5b --preset 0.5b

  Writes config.json + sharded fp32 safetensors in the official Qwen3-Next layout
  (fused in_proj_qkvz / in_proj_ba, per-expert gate/up/down tensors) with HF's own
  seeded initialisation, then reloads it with ``from_pretrained`` to check that every
  key loads. See PRESETS for the shape and the parameter count.

Matrix products alone (torch.nn.functional.linear on the shapes of
dataplane/examples/bench_ops.rs)::

    /work/pyenv/hf/bin/python tools/bench_hf_cpu.py --ops

Report -- combine the JSON lines written by benches/cpu_model.sh::

    /work/pyenv/hf/bin/python tools/bench_hf_cpu.py --report RESULTS.jsonl --out-prefix benches/results/cpu-model-DATE
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# libgomp's default (active) wait spins at every OpenMP barrier; when the cores are
# shared with other work (as on the 2-core dev machines) a spinning thread holds a core
# the other thread needs, and HF slows down 10-25x (measured: decode 0.12 vs 2.9 tok/s on
# the 0.5B model at load average ~11). Passive waiting is the fair setting on a shared
# machine; OMP_WAIT_POLICY=ACTIVE in the environment restores the default. Must be set
# before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MASK64 = (1 << 64) - 1


def splitmix64_ids(seed: int, n: int, vocab: int) -> list[int]:
    """SplitMix64 stream, identical to bench_model.rs::prompt_ids."""
    state = seed & MASK64
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
        out.append(z % vocab)
    return out


# --------------------------------------------------------------------------------------
# Random-weight checkpoints
# --------------------------------------------------------------------------------------

# Qwen3-Next-80B-A3B scaled down: hidden 2048 -> 1024, 48 -> 24 layers (3 GDN : 1 gated
# attention), GDN 16/32 key/value heads x 128 -> 8/16 x 64, attention 16 q / 2 kv heads x
# 256 -> 8 / 2 x 128 (partial RoPE 25 %, output gate), 512 experts (I=512) top-10 + shared
# -> 32 experts (I=128) top-8 + shared expert (I=512), vocab 151936 -> 32768 (untied).
# Parameter count (incl. every expert): 505,966,784 total (routed experts 302 M, embedding
# and lm_head 33.5 M each); ~246 M weights take part in each token's matrix products
# (GDN/attention 98 M, 8 of 32 experts + shared expert + routers 113 M, lm_head 34 M).
PRESETS = {
    "0.5b": dict(
        vocab_size=32768,
        hidden_size=1024,
        num_hidden_layers=24,
        layer_types=["linear_attention"] * 3 + ["full_attention"],  # repeated
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=32,
        num_experts_per_tok=8,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=512,
        intermediate_size=2048,  # unused: every layer is MoE
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
}


def make_model(out: Path, preset: str, seed: int, shard_bytes: int = 1 << 30) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    p = dict(PRESETS[preset])
    reps = p["num_hidden_layers"] // len(p["layer_types"])
    p["layer_types"] = p["layer_types"] * reps
    cfg = Qwen3NextConfig(**p)
    cfg.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(seed)
    t0 = time.time()
    model = Qwen3NextForCausalLM(cfg).eval()  # HF's own (seeded) initialisation
    print(f"built in {time.time() - t0:.1f}s", flush=True)

    # Official on-disk layout: per-expert tensors (as the released Qwen3-Next shards).
    sd = {}
    for k, v in model.state_dict().items():
        v = v.detach().to(torch.float32).contiguous()
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                sd[f"{prefix}{e}.gate_proj.weight"] = v[e, :inter].clone()
                sd[f"{prefix}{e}.up_proj.weight"] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            prefix = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                sd[f"{prefix}{e}.down_proj.weight"] = v[e].clone()
        else:
            sd[k] = v
    total = sum(t.numel() for t in sd.values())
    lin_params = model.num_parameters()
    assert total == lin_params, (total, lin_params)

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    cfg.save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "transformers_version": cfg.transformers_version}, indent=2) + "\n"
    )
    shards: list[dict] = [{}]
    size = 0
    for k in sorted(sd):
        nb = sd[k].numel() * 4
        if size + nb > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][k] = sd[k]
        size += nb
    weight_map = {}
    for i, grp in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(grp, str(out / fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in grp})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total * 4}, "weight_map": weight_map}, indent=2) + "\n"
    )
    counts = param_counts(cfg, total)
    (out / "bench_model_info.json").write_text(json.dumps({"preset": preset, "seed": seed, **counts}, indent=2) + "\n")
    print(json.dumps(counts, indent=2))
    n_shards = len(shards)
    del model, sd, shards

    # Reload with HF's own loader: every key present, nothing mismatched.
    ref, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"][:5]
    assert not info.get("mismatched_keys"), info.get("mismatched_keys")
    assert not info["unexpected_keys"], info["unexpected_keys"][:5]
    print(f"wrote {out} ({len(weight_map)} tensors, {n_shards} shards, {total:,} params); reload OK")


def param_counts(cfg, total: int) -> dict:
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    n_lin = sum(t == "linear_attention" for t in cfg.layer_types)
    n_full = L - n_lin
    kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    hv = cfg.linear_num_value_heads
    gdn = (2 * kd + 2 * vd + 2 * hv) * h + vd * h  # in_proj_qkvz + in_proj_ba + out_proj
    qw = cfg.num_attention_heads * cfg.head_dim * 2
    attn = (qw + 2 * cfg.num_key_value_heads * cfg.head_dim) * h + cfg.num_attention_heads * cfg.head_dim * h
    expert = 3 * h * cfg.moe_intermediate_size
    shared = 3 * h * cfg.shared_expert_intermediate_size
    router = (cfg.num_experts + 1) * h
    matmul_active = n_lin * gdn + n_full * attn + L * (cfg.num_experts_per_tok * expert + shared + router) + cfg.vocab_size * h
    return {
        "params_total": total,
        "params_embedding": cfg.vocab_size * h,
        "params_lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
        "params_experts_routed": L * cfg.num_experts * expert,
        "params_matmul_per_token": matmul_active,
        "layers": f"{n_lin} GDN + {n_full} gated attention, all MoE",
    }


# --------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------


def bench(args) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    threads = args.threads or os.cpu_count()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    cfg = model.config.get_text_config(decoder=True)
    ids = splitmix64_ids(args.seed, args.prompt_len, cfg.vocab_size)
    inp = torch.tensor([ids], dtype=torch.long)

    def once():
        with torch.inference_mode():
            c0, t0 = time.process_time(), time.perf_counter()
            out = model(input_ids=inp, use_cache=True, logits_to_keep=1)
            prefill_s = time.perf_counter() - t0
            c1 = time.process_time()
            cache = out.past_key_values
            tok = out.logits[0, -1].argmax()
            tokens = [int(tok)]
            t1 = time.perf_counter()
            for _ in range(args.decode_tokens):
                out = model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tok = out.logits[0, -1].argmax()
                tokens.append(int(tok))
            decode_s = time.perf_counter() - t1
            c2 = time.process_time()
        return prefill_s, decode_s, tokens, c1 - c0, c2 - c1

    bar = None
    try:
        from tqdm import tqdm  # installed with transformers

        bar = tqdm(total=args.warmup + args.repeats, desc=f"HF T={args.prompt_len}", file=sys.stderr, leave=False)
    except ImportError:
        pass
    load_before = os.getloadavg()[0]
    for _ in range(args.warmup):
        once()
        bar and bar.update(1)
    samples = []
    for _ in range(args.repeats):
        samples.append(once())
        bar and bar.update(1)
    bar and bar.close()
    prefill = [args.prompt_len / s[0] for s in samples]
    decode = [args.decode_tokens / s[1] for s in samples] if args.decode_tokens else []
    return {
        "impl": f"HF transformers {transformers.__version__} / torch {torch.__version__} (CPU, fp32)",
        "model": args.model,
        "model_type": model.config.model_type,
        "params": model.num_parameters(),
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "prompt_len": args.prompt_len,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "load_s": load_s,
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode) if decode else None,
        "prefill_ms": statistics.median(s[0] * 1e3 for s in samples),
        "decode_ms_per_tok": statistics.median(s[1] * 1e3 / args.decode_tokens for s in samples) if decode else None,
        "prefill_cpu_s": statistics.median(s[3] for s in samples),
        "decode_cpu_s_per_tok": statistics.median(s[4] / args.decode_tokens for s in samples) if decode else None,
        "prefill_tok_per_cpu_s": statistics.median(args.prompt_len / s[3] for s in samples),
        "decode_tok_per_cpu_s": statistics.median(args.decode_tokens / s[4] for s in samples) if decode else None,
        "cpu_util": sum(s[3] + s[4] for s in samples) / sum(s[0] + s[1] for s in samples),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg()[0],
        "prefill_tok_s_samples": prefill,
        "decode_tok_s_samples": decode,
        "greedy_tokens": samples[-1][2],
    }


# (name, tokens, in, out, calls): the shapes of dataplane/examples/bench_ops.rs.
OPS_SHAPES = [
    ("gdn_in_proj T512", 512, 1024, 3104, 5),
    ("attn_q_proj T512", 512, 1024, 2048, 5),
    ("out_proj T512", 512, 1024, 1024, 10),
    ("expert_gate_up T128", 128, 1024, 256, 40),
    ("expert_down T128", 128, 128, 1024, 40),
    ("shared_down T512", 512, 512, 1024, 10),
    ("gdn_in_proj T1", 1, 1024, 3104, 200),
    ("lm_head T1", 1, 1024, 32768, 40),
    ("expert_gate_up T1", 1, 1024, 256, 2000),
    ("expert_down T1", 1, 128, 1024, 2000),
]


def bench_ops(threads: int) -> None:
    """torch.nn.functional.linear on the shapes of bench_ops.rs (fp32)."""
    import torch

    torch.set_num_threads(threads or os.cpu_count())
    print(f"{'shape':20} {'ms/call':>10} {'GFLOP/s':>12} {'GFLOP/CPU-s':>14} {'util':>6}")
    with torch.inference_mode():
        for name, t, i, o, calls in OPS_SHAPES:
            x, w = torch.randn(t, i), torch.randn(o, i)
            torch.nn.functional.linear(x, w)
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(calls):
                torch.nn.functional.linear(x, w)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            flop = 2 * t * i * o * calls
            print(f"{name:20} {wall * 1e3 / calls:10.3f} {flop / wall * 1e-9:12.1f} {flop / cpu * 1e-9:14.1f} {cpu / wall:6.2f}")


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def machine_info() -> dict:
    info = {"platform": platform.platform(), "cores": os.cpu_count()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "L2 cache", "L3 cache"):
                info[k.strip()] = v.strip()
        flags = next((l for l in lscpu.splitlines() if l.startswith("Flags")), "")
        info["avx512f"] = "avx512f" in flags
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        info["mem_total"] = next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split(":")[1].strip()
    except OSError:
        pass
    return info


def report(jsonl: Path, prefix: Path, meta_json: str | None) -> None:
    rows = [json.loads(l) for l in jsonl.read_text().splitlines() if l.strip()]
    meta = json.loads(meta_json) if meta_json else {}
    by_key: dict[tuple, dict] = {}
    for r in rows:
        by_key.setdefault((r["label"], r["prompt_len"]), {})[r["side"]] = r
    table = []
    for (label, plen), d in by_key.items():
        ours, hf = d.get("ours"), d.get("hf")
        row = {"model": label, "prompt_len": plen}
        if ours and hf:
            row["decode_tokens"] = ours["decode_tokens"]
            row["params"] = hf["params"]
            for m in ("prefill_tok_s", "decode_tok_s", "prefill_tok_per_cpu_s", "decode_tok_per_cpu_s", "cpu_util"):
                row[f"ours_{m}"] = ours[m]
                row[f"hf_{m}"] = hf[m]
                row[f"ratio_{m}"] = ours[m] / hf[m] if ours[m] and hf[m] else None
            a, b = ours["greedy_tokens"], hf["greedy_tokens"]
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            row["greedy_tokens_agree"] = f"{same}/{min(len(a), len(b))}"
            row["load_avg"] = [ours.get("loadavg_before"), hf.get("loadavg_before")]
        table.append(row)
    doc = {"date": meta.get("date"), "machine": machine_info(), "meta": meta, "table": table, "runs": rows}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(doc, indent=2) + "\n")

    m = doc["machine"]
    hf_impl = next((r["impl"] for r in rows if r["side"] == "hf"), "HF")
    hf_paths = next((f'attn={r["attn_implementation"]}, experts={r["experts_implementation"]}' for r in rows if r["side"] == "hf"), "")
    lines = [
        f"# CPU model benchmark ({meta.get('date', '')})",
        "",
        f"- Machine: {m.get('Model name', '?')}, {m.get('cores')} cores"
        f" (threads/core {m.get('Thread(s) per core', '?')}, AVX-512: {m.get('avx512f')}), {m.get('mem_total', '')};"
        f" load average at start {meta.get('loadavg_start', '?')} (shared machine)",
        f"- Ours: `dataplane/examples/bench_model.rs` (release, rayon {rows[0].get('threads')} threads, fp32);"
        f" git {meta.get('git', '?')}",
        f"- HF: {hf_impl}, {hf_paths}, torch threads {next((r['threads'] for r in rows if r['side'] == 'hf'), '?')},"
        " inference_mode, prefill with logits_to_keep=1 then greedy decode with the cache",
        "- Same prompt ids on both sides (SplitMix64 seed 0); median of repeats after one warm-up run;"
        " ratio = ours / HF (> 1: we are faster)",
        "",
        "| model | params | prompt | prefill tok/s ours | prefill tok/s HF | prefill ratio"
        " | decode tok/s ours | decode tok/s HF | decode ratio | greedy agree |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        if "ours_prefill_tok_s" not in r:
            continue
        f = lambda x, p=1: "n/a" if x is None else f"{x:,.{p}f}"
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:,.1f} M | {r['prompt_len']} | {f(r['ours_prefill_tok_s'])} | {f(r['hf_prefill_tok_s'])}"
            f" | **{f(r['ratio_prefill_tok_s'], 2)}** | {f(r['ours_decode_tok_s'])} | {f(r['hf_decode_tok_s'])}"
            f" | **{f(r['ratio_decode_tok_s'], 2)}** | {r['greedy_tokens_agree']} |"
        )
    lines += [
        "",
        "CPU-normalised (tokens per CPU-second of the process, all threads; less sensitive to the"
        " other load on the machine than wall time; cpu util = CPU-seconds / wall-seconds, at most"
        f" {m.get('cores')}):",
        "",
        "| model | prompt | prefill tok/CPU-s ours | HF | ratio | decode tok/CPU-s ours | HF | ratio | cpu util ours / HF |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        if "ours_prefill_tok_per_cpu_s" not in r:
            continue
        f = lambda x, p=1: "n/a" if x is None else f"{x:,.{p}f}"
        lines.append(
            f"| {r['model']} | {r['prompt_len']} | {f(r['ours_prefill_tok_per_cpu_s'])} | {f(r['hf_prefill_tok_per_cpu_s'])}"
            f" | **{f(r['ratio_prefill_tok_per_cpu_s'], 2)}** | {f(r['ours_decode_tok_per_cpu_s'])} | {f(r['hf_decode_tok_per_cpu_s'])}"
            f" | **{f(r['ratio_decode_tok_per_cpu_s'], 2)}** | {f(r['ours_cpu_util'], 2)} / {f(r['hf_cpu_util'], 2)} |"
        )
    if meta.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in meta["notes"]]
    if meta.get("models"):
        lines += ["", "Models:", ""] + [f"- {k}: {v}" for k, v in meta["models"].items()]
    lines += ["", f"Plot: `{prefix.name}.png`; raw runs: `{prefix.name}.json`.", ""]
    Path(f"{prefix}.md").write_text("\n".join(lines))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    good = [r for r in table if "ours_prefill_tok_s" in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"{r['model']}\nT={r['prompt_len']}" for r in good]
    x = range(len(good))
    for ax, metric, title in zip(axes, ("prefill_tok_s", "decode_tok_s"), ("prefill", f"decode (greedy, {good[0].get('decode_tokens', '?')} tokens)")):
        o = [r[f"ours_{metric}"] or 0 for r in good]
        h = [r[f"hf_{metric}"] or 0 for r in good]
        w = 0.38
        b1 = ax.bar([i - w / 2 for i in x], o, w, label="HYPIC dataplane (Rust)")
        b2 = ax.bar([i + w / 2 for i in x], h, w, label="HF transformers")
        for bars in (b1, b2):
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(list(x), names, fontsize=8)
        ax.set_ylabel("tokens/s (log)")
        ax.set_title(f"CPU {title}")
        ax.legend(fontsize=8)
    fig.suptitle(f"{m.get('Model name', 'CPU')}, {m.get('cores')} cores, fp32 -- {meta.get('date', '')}")
    fig.tight_layout()
    fig.savefig(f"{prefix}.png", dpi=110)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder to benchmark")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (bench) / weight seed (--make-model)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--make-model", metavar="DIR", help="write a random-weight checkpoint to DIR")
    ap.add_argument("--preset", default="0.5b", choices=sorted(PRESETS))
    ap.add_argument("--ops", action="store_true", help="time torch linear on bench_ops.rs's shapes")
    ap.add_argument("--report", metavar="JSONL", help="combine benchmark JSON lines into .json/.md/.png")
    ap.add_argument("--out-prefix", help="with --report: output path without extension")
    ap.add_argument("--meta", help="with --report: JSON object of run metadata")
    args = ap.parse_args(argv)
    if args.make_model:
        make_model(Path(args.make_model), args.preset, args.seed)
        return 0
    if args.ops:
        bench_ops(args.threads)
        return 0
    if args.report:
        if not args.out_prefix:
            ap.error("--report needs --out-prefix")
        report(Path(args.report), Path(args.out_prefix), args.meta)
        return 0
    if not args.model:
        ap.error("--model is required")
    print(json.dumps(bench(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
