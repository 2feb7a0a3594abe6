#!/usr/bin/env python3
"""TTFT p50 and p99 against arrival rate for several `hypic bench` runs side by side, as
one dependency-free SVG (two panels per mode). Usage:
  tools/plot_ab_svg.py OUT.svg LABEL=DIR [LABEL=DIR ...]
where each DIR holds `<mode>/summary.json` (as `hypic bench --out` writes it, one folder
per mode). Series with the same label prefix before a space share a colour."""
import json, os, sys

out, specs = sys.argv[1], [a.split("=", 1) for a in sys.argv[2:]]
series = {}  # mode -> [(label, [(rate, p50, p99)])]
for label, d in specs:
    for mode in sorted(os.listdir(d)):
        f = os.path.join(d, mode, "summary.json")
        if not os.path.exists(f):
            continue
        runs = json.load(open(f))["runs"]
        pts = sorted((r["rate"], r["ttft_p50_ms"], r["ttft_p99_ms"]) for r in runs)
        series.setdefault(mode, []).append((label, pts))
modes = sorted(series)
W, H, M = 420, 300, 55  # panel size, margin
colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
base = {}
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H * len(modes) + 40}" font-family="sans-serif" font-size="11">',
       '<rect width="100%" height="100%" fill="white"/>']
for mi, mode in enumerate(modes):
    for pi, (col, name) in enumerate([(1, "p50"), (2, "p99")]):
        x0, y0 = pi * W, mi * H + 20
        rates = sorted({p[0] for _, pts in series[mode] for p in pts})
        ymax = max(p[col] for _, pts in series[mode] for p in pts) * 1.1
        rx = lambda r: x0 + M + (r - rates[0]) / max(rates[-1] - rates[0], 1e-9) * (W - 2 * M)
        ry = lambda v: y0 + H - M - v / ymax * (H - 2 * M)
        svg.append(f'<text x="{x0 + W / 2}" y="{y0 + 14}" text-anchor="middle" font-size="13">{mode}: TTFT {name} (ms) vs rate (req/s)</text>')
        svg.append(f'<line x1="{x0 + M}" y1="{y0 + H - M}" x2="{x0 + W - M}" y2="{y0 + H - M}" stroke="black"/>')
        svg.append(f'<line x1="{x0 + M}" y1="{y0 + M}" x2="{x0 + M}" y2="{y0 + H - M}" stroke="black"/>')
        for r in rates:
            svg.append(f'<text x="{rx(r)}" y="{y0 + H - M + 15}" text-anchor="middle">{r:g}</text>')
        for k in range(5):
            v = ymax * k / 4
            svg.append(f'<text x="{x0 + M - 5}" y="{ry(v) + 4}" text-anchor="end">{v:.0f}</text>')
            svg.append(f'<line x1="{x0 + M}" y1="{ry(v)}" x2="{x0 + W - M}" y2="{ry(v)}" stroke="#ddd"/>')
        for si, (label, pts) in enumerate(series[mode]):
            key = label.split(" ")[0]
            c = colours[base.setdefault(key, len(base)) % len(colours)]
            dash = ' stroke-dasharray="5,3"' if " " in label else ""
            path = " ".join(f"{rx(p[0]):.1f},{ry(p[col]):.1f}" for p in pts)
            svg.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
            for p in pts:
                svg.append(f'<circle cx="{rx(p[0]):.1f}" cy="{ry(p[col]):.1f}" r="3" fill="{c}"/>')
            svg.append(f'<line x1="{x0 + W - M - 90}" y1="{y0 + 30 + 14 * si}" x2="{x0 + W - M - 70}" y2="{y0 + 30 + 14 * si}" stroke="{c}" stroke-width="2"{dash}/>')
            svg.append(f'<text x="{x0 + W - M - 65}" y="{y0 + 34 + 14 * si}">{label}</text>')
svg.append("</svg>")
open(out, "w").write("\n".join(svg))
print(f"wrote {out}")
