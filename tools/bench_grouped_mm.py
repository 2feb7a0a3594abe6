#!/usr/bin/env python3
"""Same-run anchor for the grouped MoE expert GEMMs (issue 18, item 6).

Times PyTorch's `torch._grouped_mm` at the Qwen3.5-35B-A3B MoE shape (bf16, hidden 2048,
256 experts, top-8, expert width 512) on the GPU this runs on, replayed from a CUDA graph
(kernel time, not Python launch overhead):

* `gemms`: gate_up grouped GEMM, SwiGLU, down grouped GEMM over rows already sorted by
  expert (what the issue's anchor figure measures);
* `moe`: the whole block as `gpu_bench --moe-grouped` times ours: router GEMM, softmax
  top-k, sort by expert, gather, the two grouped GEMMs with SwiGLU, and the weighted
  combine back to token order.

Routing is drawn by a random router on random inputs, so the per-expert row counts are
what our bench sees. Prints a markdown table; `--json FILE` also writes the figures.
Usage: python3 tools/bench_grouped_mm.py [--tokens 1024,4096,16384] [--json out.json]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

H, E, K, I = 2048, 256, 8, 512


def graph_ms(fn, reps):
    """Mean time over `reps` replays of a CUDA graph of `fn` (after warm-up)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    if not hasattr(torch, "_grouped_mm"):
        print(f"skipped: torch {torch.__version__} has no _grouped_mm")
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sh = H ** -0.5
    router = (torch.rand(E, H, device=dev) * 2 - 1).mul_(3 * sh).to(torch.bfloat16)
    w_gu = (torch.rand(E, 2 * I, H, device=dev) * 2 - 1).mul_(sh).to(torch.bfloat16)
    w_dn = (torch.rand(E, H, I, device=dev) * 2 - 1).mul_(I ** -0.5).to(torch.bfloat16)
    w_gu_t = w_gu.transpose(-2, -1)  # [E, H, 2I], the layout grouped_mm multiplies by
    w_dn_t = w_dn.transpose(-2, -1)  # [E, I, H]
    name = torch.cuda.get_device_name()
    print(f"# torch._grouped_mm anchor on {name}, torch {torch.__version__}")
    print(f"bf16, hidden {H}, {E} experts, top-{K}, expert width {I}; CUDA graph replay\n")
    print("| t | gemms ms | gemms TFLOP/s | moe ms |")
    print("|---|---|---|---|")
    out = {"device": name, "torch": torch.__version__, "rows": []}
    for t in [int(v) for v in args.tokens.split(",")]:
        n = t * K
        x = (torch.rand(t, H, device=dev) * 2 - 1).to(torch.bfloat16)
        with torch.no_grad():
            logits = (x @ router.t()).float()
            p = logits.softmax(-1)
            w_top, idx = p.topk(K, dim=-1)
            order = idx.flatten().argsort(stable=True)
            counts = torch.bincount(idx.flatten(), minlength=E)
            offs = counts.cumsum(0).to(torch.int32)
            xs = x[order // K].contiguous()

        def gemms():
            gu = torch._grouped_mm(xs, w_gu_t, offs=offs)
            a = F.silu(gu[:, :I]) * gu[:, I:]
            return torch._grouped_mm(a, w_dn_t, offs=offs)

        y_out = torch.empty(t, H, device=dev, dtype=torch.float32)

        def moe():
            lg = (x @ router.t()).float()
            pr = lg.softmax(-1)
            wt, ix = pr.topk(K, dim=-1)
            flat = ix.flatten()
            od = flat.argsort(stable=True)
            cnt = torch.zeros(E, device=dev, dtype=torch.int64)
            cnt.scatter_add_(0, flat, torch.ones_like(flat))
            of = cnt.cumsum(0).to(torch.int32)
            xg = x[od // K]
            gu = torch._grouped_mm(xg, w_gu_t, offs=of)
            a = F.silu(gu[:, :I]) * gu[:, I:]
            yd = torch._grouped_mm(a, w_dn_t, offs=of).float()
            yd = yd * wt.flatten()[od].unsqueeze(1)
            y_out.zero_()
            y_out.index_add_(0, od // K, yd)
            return y_out

        reps = 10 if t >= 16384 else 20
        with torch.no_grad():
            g_ms = graph_ms(gemms, reps)
            m_ms = graph_ms(moe, reps)
        flops = 2.0 * n * 3 * I * H
        print(f"| {t} | {g_ms:.3f} | {flops / g_ms / 1e9:.0f} | {m_ms:.3f} |")
        out["rows"].append({"t": t, "gemms_ms": g_ms, "moe_ms": m_ms, "gemm_flops": flops})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
