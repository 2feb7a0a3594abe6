#!/usr/bin/env python3
"""Plots what scripts/gpu-check.sh measured in one run: our kernels against the public
ones (gated delta rule prefill vs FLA, causal attention vs torch SDPA, from the run's
gdr_vs_fla.md and flash_vs_sdpa.md), and the whole model at the Qwen3.5-35B-A3B shape
(TTFT of full recompute, prefix cache and HYPIC per workload, decode step per context,
from model_bench.md). Files that are missing are left out of the figure.

  tools/plot_gpu_report.py OUT_DIR [--out FILE.png] [--title TEXT]
  tools/plot_gpu_report.py --model-bench A.md --flash B.md --gdr C.md --out FILE.png

Needs matplotlib. The numbers are the tables' own (ms, ratios measured in the same run).
"""
import argparse
import os
import re
import sys


def rows(path, header_word):
    """Data rows (lists of cells) of the first markdown table whose header row contains
    header_word."""
    if not path or not os.path.exists(path):
        return []
    out, on = [], False
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if not line.startswith("|"):
            if on and out:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not on:
            on = any(header_word in c for c in cells)
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        out.append(cells)
    return out


def num(s):
    m = re.search(r"-?\d+(?:\.\d+)?", s.replace(",", ""))
    return float(m.group()) if m else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", nargs="?", help="a gpu-check output folder ($OUT)")
    ap.add_argument("--model-bench")
    ap.add_argument("--flash")
    ap.add_argument("--gdr")
    ap.add_argument("--out")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    d = a.dir
    mb = a.model_bench or (d and os.path.join(d, "model_bench.md"))
    fl = a.flash or (d and os.path.join(d, "flash_vs_sdpa.md"))
    gd = a.gdr or (d and os.path.join(d, "gdr_vs_fla.md"))
    out = a.out or (d and os.path.join(d, "gpu_report.png"))
    if not out:
        sys.exit("give an output folder or --out")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("matplotlib is not installed: no plot")

    gdr = [(int(num(r[0])), num(r[4])) for r in rows(gd, "FLA") if num(r[0]) and num(r[4])]
    flash = {}
    for r in rows(fl, "kernel"):
        if len(r) >= 4 and num(r[0]) and "×" in r[3]:
            flash.setdefault(r[1], []).append((int(num(r[0])), num(r[3])))
    ttft = [r for r in rows(mb, "full recompute") if len(r) >= 8]
    decode = [(int(num(r[0])), num(r[1])) for r in rows(mb, "step ms") if num(r[0]) and num(r[1])]

    panels = [p for p in ("kernels", "ttft", "decode") if {"kernels": gdr or flash, "ttft": ttft, "decode": decode}[p]]
    if not panels:
        sys.exit("no tables found")
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.6), squeeze=False)
    for ax, p in zip(axes[0], panels):
        if p == "kernels":
            if gdr:
                ax.plot([t for t, _ in gdr], [x for _, x in gdr], "o-", label="GDR prefill vs FLA chunk_gated_delta_rule")
            for name, pts in flash.items():
                if "default backend" in name or "FLASH_ATTENTION" in name:
                    continue
                if "Lean" in name or "prefill_flash (" in name:
                    short = name.split(", ")[-1] if "Lean" in name else "FA-2 kernel (flash.cu)"
                    ax.plot([t for t, _ in pts], [x for _, x in pts], "s--", label=f"attention vs SDPA (default backend): {short}")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.axhline(2.0, color="tab:blue", lw=0.6, ls=":", label="goal GDR ≥ 2× at 1k–4k")
            ax.axhline(0.9, color="tab:red", lw=0.6, ls=":", label="goal attention ≥ 0.9×")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T (tokens)")
            ax.set_ylabel("speed vs the public kernel, same run (×, higher is faster)")
            ax.set_title("kernels against FLA 0.6.0 and torch SDPA")
            ax.legend(fontsize=7)
        elif p == "ttft":
            labels = [r[0] for r in ttft]
            xs = range(len(labels))
            w = 0.27
            for k, (col, name) in enumerate([(2, "full recompute"), (4, "prefix cache"), (7, "HYPIC")]):
                ax.bar([x + (k - 1) * w for x in xs], [num(r[col]) for r in ttft], w, label=name)
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=8)
            ax.set_xlabel("segments × tokens per segment")
            ax.set_ylabel("TTFT (ms)")
            ax.set_title("TTFT, Qwen3.5-35B-A3B shape, random bf16 weights")
            ax.legend(fontsize=8)
        else:
            ax.plot([c for c, _ in decode], [s for _, s in decode], "o-")
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode step (ms, one token, logits to the host)")
            ax.set_title("decode step")
    if a.title:
        fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
