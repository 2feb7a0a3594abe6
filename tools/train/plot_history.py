#!/usr/bin/env python3
"""Plot the whole training history of HYPIC-tiny (every run's loss.csv, one after the
other on a cumulative-token axis) to a PNG.

    python tools/train/plot_history.py models/hypic-tiny/training models/hypic-tiny/loss.png

Runs are read in name order (run1, run2, run3a, ...). A run whose first logged
tokens_seen is smaller than the previous run's last starts a new count (--init-from):
its tokens are offset by everything seen before; a resumed run (--resume) continues the
count and is not offset.
"""

import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    root, out = argv[0], argv[1]
    runs = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "loss.csv")))
    fig, ax = plt.subplots(figsize=(9, 4.8))
    offset, last = 0, 0
    for name in runs:
        with open(os.path.join(root, name, "loss.csv")) as f:
            rows = list(csv.DictReader(f))
        if not rows:
            continue
        seen = [int(r["tokens_seen"]) for r in rows]
        if seen[0] < last:  # a fresh count: --init-from
            offset += last
        last = seen[-1]
        x = [(s + offset) / 1e6 for s in seen]
        (line,) = ax.plot(x, [float(r["loss_ans"]) for r in rows], label=f"{name}: answer tokens")
        ax.plot(x, [float(r["loss_ctx"]) for r in rows], color=line.get_color(), ls="--", alpha=0.6)
        ax.axvline(x[0], color="grey", lw=0.5)
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (millions, cumulative over runs)")
    ax.set_ylabel("cross-entropy (nats/token); dashed: other tokens")
    ax.set_title("HYPIC-tiny training history (H200, bf16 autocast)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} from {', '.join(runs)}")


if __name__ == "__main__":
    main(sys.argv[1:])
