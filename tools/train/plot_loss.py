#!/usr/bin/env python3
"""Plot train.py's loss.csv (and val.csv, if given) to a PNG with matplotlib.

    python tools/train/plot_loss.py loss.csv loss.png [val.csv]
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def main(argv):
    rows = read(argv[0])
    val = read(argv[2]) if len(argv) > 2 else []
    step = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(1, 2 if val else 1, figsize=(12 if val else 7, 4.5))
    a0 = ax[0] if val else ax
    a0.plot(step, [float(r["loss_ans"]) for r in rows], label="answer tokens (CE)")
    a0.plot(step, [float(r["loss_ctx"]) for r in rows], label="other tokens (CE)")
    if rows and rows[0].get("loss_item"):
        a0.plot(step, [float(r["loss_item"]) for r in rows], label="final answer tokens (CE)")
    a0.plot(step, [float(r["loss"]) for r in rows], label="loss (weighted sum)", alpha=0.6)
    a0.set_yscale("log")
    a0.set_xlabel("optimizer step")
    a0.set_ylabel("cross entropy (nats/token)")
    a0.set_title("training loss")
    a0.grid(True, which="both", alpha=0.3)
    a0.legend()
    if val:
        vs = [int(r["step"]) for r in val]
        for k, lab in [("em_hop1", "single-hop"), ("em_hop2", "two-hop")]:
            ax[1].plot(vs, [float(r[k]) for r in val], marker="o", label=lab)
        ax[1].set_ylim(0, 1)
        ax[1].set_xlabel("optimizer step")
        ax[1].set_ylabel("greedy exact match")
        ax[1].set_title("validation (seed 4242, full recompute)")
        ax[1].grid(True, alpha=0.3)
        ax[1].legend()
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
