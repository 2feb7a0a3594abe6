#!/usr/bin/env python3
"""Segment-parallelism simulation (docs/segment-parallelism.md).

Fed by docs/segment-parallelism/measured.json (per-segment entry build and
composition times of the bundled model on the CPU, shipped entry sizes, TCP
loopback bandwidth; written by the ignored Rust test
`parallel_measure_inputs_of_the_simulation`). Simulates the paper's scenario --
32k tokens in 8 cold segments, 1 to 8 workers -- and LPT against round robin on
unequal segments, with the combiner's pipeline as the code runs it:

* each worker builds its segments in its assignment order and ships each as soon
  as it is built; frames reach the combiner over one shared link (the combiner's
  receive side), in arrival order;
* the combiner composes segment i once it has arrived and segment i-1 is composed.

Prints markdown tables and writes docs/segment-parallelism/sim.svg (matplotlib,
optional: without it only the tables are printed).

    python3 scripts/sp_sim.py [--measured FILE] [--svg FILE] [--md FILE]
"""
import argparse
import json
import os


def interp(rows, key, n):
    """Linear interpolation (and extrapolation from the last two points) of
    rows[key] over rows["tokens"]."""
    xs = [r["tokens"] for r in rows]
    ys = [r[key] for r in rows]
    if n <= xs[0]:
        return ys[0] * n / xs[0]
    for i in range(1, len(xs)):
        if n <= xs[i] or i == len(xs) - 1:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    return ys[-1]


def lpt(sizes, workers):
    load = [0.0] * workers
    out = [[] for _ in range(workers)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        w = min(range(workers), key=lambda w: (load[w], w))
        load[w] += sizes[i]
        out[w].append(i)
    return out


def round_robin(sizes, workers):
    out = [[] for _ in range(workers)]
    for i in range(len(sizes)):
        out[i % workers].append(i)
    return out


def simulate(sizes, plan, m):
    """Time (ms) until every segment is composed on the combiner."""
    rows, bw = m["segments"], m["tcp_loopback"]["mb_per_s_median"] * 1e6
    done = {}
    for lst in plan:
        t = 0.0
        for i in lst:
            t += interp(rows, "build_ms", sizes[i])
            done[i] = t
    # One shared receive link, first come first served.
    link = 0.0
    arrive = {}
    for i in sorted(done, key=lambda i: done[i]):
        start = max(link, done[i])
        link = start + interp(rows, "entry_bytes", sizes[i]) / bw * 1e3
        arrive[i] = link
    t = 0.0
    for i in range(len(sizes)):
        t = max(t, arrive[i]) + interp(rows, "compose_ms", sizes[i])
    return t


def local(sizes, m):
    """One process, no scatter: build and compose every segment in order."""
    rows = m["segments"]
    return sum(interp(rows, "build_ms", n) + interp(rows, "compose_ms", n) for n in sizes)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", default=os.path.join(root, "docs/segment-parallelism/measured.json"))
    ap.add_argument("--svg", default=os.path.join(root, "docs/segment-parallelism/sim.svg"))
    ap.add_argument("--md", default=None, help="also write the tables to this file")
    a = ap.parse_args()
    m = json.load(open(a.measured))

    equal = [4096] * 8
    unequal = [8192, 1024, 6144, 2048, 5120, 3072, 4096, 3072]
    lines = []
    base = local(equal, m)
    lines.append(f"Measured on {m['machine']['cpu'].strip()} ({m['machine']['cores']} cores), {m['date_utc']}; "
                 f"TCP loopback {m['tcp_loopback']['mb_per_s_median']:.0f} MB/s. Simulated below.\n")
    lines.append("**32k tokens in 8 equal cold segments (4096 each)**\n")
    lines.append("| workers | LPT ms | round robin ms | speed-up vs local (LPT) |")
    lines.append("|---:|---:|---:|---:|")
    lines.append(f"| local (no scatter) | {base:.0f} | {base:.0f} | 1.00x |")
    eq_lpt, eq_rr, un_lpt, un_rr = [], [], [], []
    for k in range(1, 9):
        tl = simulate(equal, lpt(equal, k), m)
        tr = simulate(equal, round_robin(equal, k), m)
        eq_lpt.append(tl)
        eq_rr.append(tr)
        lines.append(f"| {k} | {tl:.0f} | {tr:.0f} | {base / tl:.2f}x |")
    ubase = local(unequal, m)
    lines.append("")
    lines.append("**32k tokens in 8 unequal cold segments (8192, 1024, 6144, 2048, 5120, 3072, 4096, 3072)**\n")
    lines.append("| workers | LPT ms | round robin ms | round robin / LPT |")
    lines.append("|---:|---:|---:|---:|")
    lines.append(f"| local (no scatter) | {ubase:.0f} | {ubase:.0f} | |")
    for k in range(1, 9):
        tl = simulate(unequal, lpt(unequal, k), m)
        tr = simulate(unequal, round_robin(unequal, k), m)
        un_lpt.append(tl)
        un_rr.append(tr)
        lines.append(f"| {k} | {tl:.0f} | {tr:.0f} | {tr / tl:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        open(a.md, "w").write(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not found: no plot")
        return
    ks = list(range(1, 9))
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(ks, [base / t for t in eq_lpt], "o-", label="simulated (LPT)")
    ax[0].plot(ks, ks, ":", color="grey", label="linear")
    ax[0].plot([8], [2.83 / 0.49], "s", color="C3", label="paper, 8x H20 (5.7x)")
    ax[0].set_xlabel("workers")
    ax[0].set_ylabel("speed-up over one process")
    ax[0].set_title("8 equal cold segments, 32k tokens")
    ax[0].legend()
    ax[1].plot(ks, un_lpt, "o-", label="LPT")
    ax[1].plot(ks, un_rr, "s--", label="round robin")
    ax[1].set_xlabel("workers")
    ax[1].set_ylabel("time to compose all, ms")
    ax[1].set_title("8 unequal cold segments, 32k tokens")
    ax[1].legend()
    fig.suptitle(f"Simulated from measurements on this CPU ({m['date_utc'][:10]}, hypic-tiny)", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.svg)
    print(f"wrote {a.svg}")


if __name__ == "__main__":
    main()
