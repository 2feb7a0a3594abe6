#!/usr/bin/env python3
"""Segment parallelism on one GPU (gpu-check step `parallel`).

Starts two `hypic worker --device DEV --dtype DT` processes and two `hypic serve
--device DEV --dtype DT` servers on the bundled model: one without workers (the
reference) and one with `--workers` naming both. Both servers get the same requests
in the same order (scripts/serve_check.py's workload: registered documents, chat with
the documents as content parts in several orders, streaming, prefix cache, n = 2,
logprobs, four concurrent requests). The check passes when

  * every answer (text, finish reason) of the scattering server equals the
    reference's, and so do the per-segment outcomes (except for the concurrent
    requests, whose order is not fixed);
  * the scattering server really scattered: `hypic_scatter_segments_total` and the
    workers' `hypic_worker_segments_total` moved, nothing was recomputed locally
    after a failure and no frame was refused.

On a GPU, the workers and the servers share the one device (each its own process,
context and model copy): this is the functional check of the GPU worker path, not a
speed-up measurement.

With `--devices 0,0` (gpu-check step `devices`) no worker process is started: the
scattering server is `hypic serve --device cuda --devices 0,0`, whose in-process
worker (its own model replica on GPU 0) ships entries to the combiner device to
device (the peer transport). The same checks apply, and the workers' metrics must
say `transport="peer"`.

Python 3 standard library only. Exit status 0 when every check passes; the report goes
to OUT/parallel.md, the logs to OUT/parallel_*.log.

  python3 scripts/parallel_check.py --hypic .device/bin/hypic --out .device/out
  python3 scripts/parallel_check.py --hypic target/debug/hypic --device cpu   # here
  python3 scripts/parallel_check.py --hypic .device/bin/hypic --devices 0,0 --out .device/out
"""
import argparse
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_check import Server, compare, metric_sum, metrics, workload  # noqa: E402

READY = re.compile(r"worker ready on (\S+) \(model (\w+), ([\d.]+) tokens/s\)")


class Worker:
    def __init__(self, name, exe, model, device, dtype, outdir):
        self.logpath = os.path.join(outdir, f"parallel_{name}.log")
        self.log = open(self.logpath, "w")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("HYPIC_") or k in ("HYPIC_KERNEL_CACHE",)}
        cmd = [exe, "worker", "--listen", "127.0.0.1:0", "--model", model,
               "--device", device, "--dtype", dtype]
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)
        self.addr = self.model = None
        self.tokens_per_s = 0.0

    def wait_ready(self, timeout=300):
        t0 = time.time()
        while time.time() - t0 < timeout:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited with {self.p.poll()} (log {self.logpath})")
            self.log.write(line)
            self.log.flush()
            g = READY.search(line)
            if g:
                self.addr, self.model, self.tokens_per_s = g.group(1), g.group(2), float(g.group(3))
                return
        raise RuntimeError(f"worker not ready after {timeout} s (log {self.logpath})")

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hypic", required=True)
    ap.add_argument("--model", default="models/hypic-tiny")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--out", default=".")
    ap.add_argument("--devices", default=None,
                    help="GPUs of one server (e.g. 0,0): in-process workers over the peer "
                         "transport instead of worker processes (implies --device cuda)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.devices:
        a.device = "cuda"
    dev = ["--device", a.device, "--dtype", a.dtype]
    workers, servers = [], []
    failures = []
    if a.devices:
        lines = [f"# Segment parallelism in one process (--devices {a.devices}, {a.dtype})", ""]
    else:
        lines = [f"# Segment parallelism on one device ({a.device}, {a.dtype})", ""]
    try:
        if not a.devices:
            for i in range(2):
                workers.append(Worker(f"worker{i}", a.hypic, a.model, a.device, a.dtype, a.out))
            for w in workers:
                w.wait_ready()
        ref = Server("single", a.hypic, a.model, dev, a.out)
        servers.append(ref)
        if a.devices:
            par = Server("devices", a.hypic, a.model, dev + ["--devices", a.devices], a.out)
        else:
            par = Server("scatter", a.hypic, a.model,
                         dev + ["--workers", ",".join(w.addr for w in workers)], a.out)
        servers.append(par)
        for s in servers:
            s.wait_ready()
        if a.devices:
            lines.append(f"in-process workers on GPUs {a.devices.split(',', 1)[1] if ',' in a.devices else '(none)'}, "
                         f"combiner on GPU {a.devices.split(',')[0]}")
        else:
            lines.append("workers: " + ", ".join(
                f"{w.addr} (model {w.model[:12]}…, {w.tokens_per_s:.0f} tokens/s at start-up)" for w in workers))
        lines.append("")
        t0 = time.time()
        want = workload(ref)
        t_ref = time.time() - t0
        t0 = time.time()
        got = workload(par)
        t_par = time.time() - t0
        rows = compare(want, got)
        lines += ["| request | equal | note |", "|---|---|---|"]
        for name, ok, note in rows:
            lines.append(f"| {name} | {'yes' if ok else 'NO'} | {note.replace('|', '/')} |")
            if not ok:
                failures.append(f"{name}: {note}")
        m = metrics(par)
        scattered = metric_sum(m, "hypic_scatter_segments_total")
        shipped = metric_sum(m, "hypic_worker_segments_total")
        recomputed = metric_sum(m, "hypic_scatter_recomputed_total")
        corrupt = metric_sum(m, "hypic_scatter_corrupt_total")
        failed = metric_sum(m, "hypic_worker_failures_total")
        lines += ["", f"scattered segments {scattered:.0f}, shipped by workers {shipped:.0f}, "
                  f"recomputed here {recomputed:.0f}, refused frames {corrupt:.0f}, "
                  f"worker failures {failed:.0f}; workload {t_ref:.1f} s single, {t_par:.1f} s scattered "
                  "(the workers share the device: not a speed-up figure)"]
        if scattered < 1 or shipped < 1:
            failures.append(f"nothing was scattered (segments {scattered}, shipped {shipped})")
        if recomputed or corrupt or failed:
            failures.append(f"recomputed {recomputed}, refused {corrupt}, worker failures {failed}")
        kinds = sorted({dict(labels).get("transport", "?") for (n, labels) in m
                        if n == "hypic_worker_segments_total"})
        moved = metric_sum(m, "hypic_worker_transfer_seconds_total")
        lines.append(f"worker transports: {', '.join(kinds) or 'none'}; transfer time {moved * 1e3:.1f} ms")
        want_kind = "peer" if a.devices else "tcp"
        if kinds != [want_kind]:
            failures.append(f"worker transports {kinds}, expected [{want_kind!r}]")
    except Exception as e:  # noqa: BLE001 - the report says what broke
        failures.append(f"error: {e}")
    finally:
        for s in servers:
            s.stop()
        for w in workers:
            w.stop()
    lines += ["", "result: " + ("pass" if not failures else "FAIL")]
    if failures:
        lines += ["", "failures:"] + [f"- {f}" for f in failures]
    report = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "parallel.md"), "w") as f:
        f.write(report)
    print(report)
    sys.exit(0 if not failures else 1)


if __name__ == "__main__":
    main()
