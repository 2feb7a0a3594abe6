#!/usr/bin/env python3
"""Checkpoint streaming at the Qwen3.5-35B-A3B shape (gpu-check step `load35b`).

1. `hypic random-checkpoint --config qwen3.5-35b-a3b --layers N --seed S --out DIR`
   writes the random-weight checkpoint (sharded bf16 safetensors, HF names) into DIR
   (by default under /dev/shm, RAM-backed: the GPU machine's 64 GiB disk is too small
   for all 40 layers, and its 128 GiB of RAM holds about 65 GiB of tmpfs beside the
   server; see docs/gpu.md for the layer counts that fit).
2. `hypic serve --device cuda --dtype bf16 --model DIR` loads it (GpuModel::load:
   tensor by tensor, bf16 stays bf16); reported: load time and GB/s from the server's
   `weights loaded to the GPU` log line, time to /health, and the server's peak
   resident memory (VmHWM of /proc/PID/status, read once the server is ready), against
   the goal VmHWM ≤ largest shard + 2 GiB.
3. Greedy completions (temperature 0) from that server must equal those of
   `hypic serve --device cuda --dtype bf16 --model DIR --random-weights S` (the same
   weights generated on the device by GpuModel::random).

Python 3 standard library only. Exit status 0 when the answers are equal and the
VmHWM goal holds; the report goes to OUT/load35b.md, logs to OUT/serve_load*.log.

  python3 scripts/load_check.py --hypic .device/bin/hypic --out .device/out --layers 24
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_check import Server  # noqa: E402

PROMPTS = [
    "The history of the harbour town of Ostel begins",
    "Question: Who founded Zentrix?\nAnswer:",
    "1, 2, 3, 4,",
]


def vm(pid, key):
    """A /proc/PID/status field in bytes (kB in the file)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def q35_bytes(layers):
    """Bytes of the bf16 random checkpoint of the first `layers` Qwen3.5-35B-A3B layers
    (embedding + LM head, per 4 layers 3 GDN + 1 attention mixers and 4 MoE blocks;
    the small fp32 tensors, under 1 MB a layer, are left out)."""
    h, e, i, si, vocab = 2048, 256, 512, 512, 248320
    gdn = (8192 + 4096 + 64) * h + h * 4096
    attn = (16 * 256 * 2 + 2 * 2 * 256) * h + h * 16 * 256
    moe = e * h + e * 3 * i * h + 3 * si * h + h
    per4 = 3 * gdn + attn + 4 * moe
    return 2 * (2 * vocab * h + layers // 4 * per4 + layers % 4 * (gdn + moe))


def answers(s, max_tokens):
    out = []
    for p in PROMPTS:
        st, b = s.post("/v1/completions", {"prompt": p, "temperature": 0,
                                            "max_tokens": max_tokens})
        if st != 200:
            out.append(f"HTTP {st}: {b}")
        else:
            c = b["choices"][0]
            out.append((c.get("text"), c.get("finish_reason")))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hypic", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default="/dev/shm/hypic-q35-random")
    ap.add_argument("--layers", default="auto",
                    help="decoder layers to write, or `auto`: the most (a multiple of 4, "
                         "at most 40) whose bf16 checkpoint fits the free space of --dir's "
                         "file system with 1 GiB to spare")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    parent = os.path.dirname(os.path.abspath(a.dir))
    free = shutil.disk_usage(parent).free
    if parent == "/dev/shm" and free < q35_bytes(4) + 2**30:
        # A container's /dev/shm can be tiny: fall back to the disk.
        a.dir = "/tmp/" + os.path.basename(a.dir)
        shutil.rmtree(a.dir, ignore_errors=True)
        parent, free = "/tmp", shutil.disk_usage("/tmp").free
    if a.layers == "auto":
        a.layers = 40
        while a.layers > 4 and q35_bytes(a.layers) + 2**30 > free:
            a.layers -= 4
        why = (f"auto: {parent} has {free / 2**30:.1f} GiB free; all 40 layers need "
               f"{q35_bytes(40) / 2**30:.1f} GiB")
    else:
        a.layers = int(a.layers)
        why = "as asked"
    rep, failures = [], []
    rep.append(f"## Checkpoint streaming, Qwen3.5-35B-A3B shape, {a.layers} layers, seed {a.seed}\n")
    rep.append(f"- layers: {a.layers} ({why}); folder {a.dir}")
    t0 = time.time()
    w = subprocess.run([a.hypic, "random-checkpoint", "--config", "qwen3.5-35b-a3b",
                        "--layers", str(a.layers), "--seed", str(a.seed), "--out", a.dir],
                       capture_output=True, text=True)
    wt = time.time() - t0
    rep.append(f"- write: `hypic random-checkpoint` rc={w.returncode} in {wt:.1f} s: "
               f"{(w.stdout or '').strip().splitlines()[:1]}")
    if w.returncode != 0:
        rep.append(f"\n```\n{w.stderr[-3000:]}\n```")
        failures.append("random-checkpoint failed")
        return finish(a, rep, failures)
    shards = [os.path.join(a.dir, f) for f in os.listdir(a.dir) if f.endswith(".safetensors")]
    largest = max(os.path.getsize(f) for f in shards)
    total = sum(os.path.getsize(f) for f in shards)
    rep.append(f"- {len(shards)} shards, {total / 1e9:.2f} GB, largest {largest / 2**30:.2f} GiB")

    # The checkpoint, streamed to the GPU.
    t0 = time.time()
    s = Server("load", a.hypic, a.dir, ["--device", "cuda", "--dtype", "bf16"], a.out)
    try:
        s.wait_ready(timeout=540)
        ready = time.time() - t0
        hwm, rss = vm(s.p.pid, "VmHWM"), vm(s.p.pid, "VmRSS")
        got = answers(s, a.max_tokens)
    except Exception as e:  # noqa: BLE001
        failures.append(f"checkpoint server: {e}")
        s.stop()
        return finish(a, rep, failures)
    s.stop()
    log = open(s.logpath).read()
    m = re.search(r"weights loaded to the GPU: (\d+) tensors, ([\d.]+) GB in ([\d.]+) s "
                  r"\(([\d.]+) GB/s\)", log)
    if m:
        rep.append(f"- load (GpuModel::load): {m[1]} tensors, {m[2]} GB in {m[3]} s = **{m[4]} GB/s**")
    else:
        failures.append("no `weights loaded to the GPU` line in the server log")
    rep.append(f"- server start to /health: {ready:.1f} s")
    goal = largest + 2 * 2**30
    ok = hwm is not None and hwm <= goal
    rep.append(f"- peak host memory VmHWM {hwm / 2**30:.2f} GiB (VmRSS {rss / 2**30:.2f} GiB); "
               f"goal ≤ largest shard + 2 GiB = {goal / 2**30:.2f} GiB: {'met' if ok else 'NOT met'}")
    if not ok:
        failures.append("VmHWM above the goal")

    # The same weights generated on the device.
    r = Server("load_random", a.hypic, a.dir,
               ["--device", "cuda", "--dtype", "bf16", "--random-weights", str(a.seed)], a.out)
    try:
        r.wait_ready(timeout=540)
        want = answers(r, a.max_tokens)
    except Exception as e:  # noqa: BLE001
        failures.append(f"random-weight server: {e}")
        r.stop()
        return finish(a, rep, failures)
    r.stop()
    rep.append("\n| prompt | checkpoint server | random-weight server | equal |")
    rep.append("|---|---|---|---|")
    for p, g, x in zip(PROMPTS, got, want):
        rep.append(f"| {p!r} | {g!r} | {x!r} | {'yes' if g == x else 'NO'} |")
    if got != want:
        failures.append("greedy answers differ from the random-weight server")
    return finish(a, rep, failures)


def finish(a, rep, failures):
    if not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)
    rep.append("")
    rep.append("result: " + ("pass" if not failures else "FAIL: " + "; ".join(failures)))
    text = "\n".join(rep) + "\n"
    with open(os.path.join(a.out, "load35b.md"), "w") as f:
        f.write(text)
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
