#!/usr/bin/env python3
"""End-to-end check of `hypic serve` on the GPU against the CPU (gpu-check step `serve`).

Starts `hypic serve --device cpu` and `hypic serve --device cuda` (f32) on the bundled
model, each on a free loopback port with its own data directory, and sends both the
same requests in the same order (greedy, temperature 0):

  * three segments registered through POST /v1/segments (ahead-of-time prefill);
  * completions that use them by id, then in another order (segment-cache hits);
  * a chat completion with the documents as content parts, the same with the
    documents reordered (hits), and a streaming one (SSE) in a third order;
  * a prefix_cache-mode request sent twice (private-pool prefix hit), n = 2, logprobs,
    and four requests at once (decoded together in one batch).

The GPU answers must equal the CPU answers (text and finish reason), the per-segment
outcomes must be equal (except for the concurrent requests, whose order is not
fixed), the GPU server's /health and /metrics must say `cuda`, and its pool hit
counters must have moved. Then two more GPU servers answer the same requests: one
with a public pool too small for the entries and a host spill tier (answers must
still equal the CPU's; spill and spill_restore counters must move), and one with
`--dtype bf16` (answers are reported, not required to be equal).

Python 3 standard library only. Exit status 0 when every check passes; the report
goes to OUT/serve.md and the server logs to OUT/serve_*.log.

  python3 scripts/serve_check.py --hypic .device/bin/hypic --out .device/out
  python3 scripts/serve_check.py --hypic target/debug/hypic --device cpu   # dry run here
"""
import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

SYS = "You answer questions from the documents. Answer with a short phrase."
DOCS = {
    "doc-zentrix": "Zentrix was founded by Mara Quell in 1987 in the harbour town of Ostel, "
    "where it first built lighthouse lenses before moving into optical sensors.",
    "doc-lumora": "Lumora is a cooperative bank headquartered in the city of Vell; its "
    "current chair is Tobin Arkwright, who succeeded Ilse Varn in 2019.",
    "doc-kessel": "The Kessel engine was invented by Orrin Tate, an engineer from Dunmore, "
    "who patented the design in 1911 and sold it to the Harlow railway.",
}
ORDER = list(DOCS)
QS = [
    "Who founded Zentrix?",
    "Who is the chair of Lumora?",
    "Who invented the Kessel engine?",
    "Where is Lumora headquartered?",
]


def im(role, text, gen=False):
    s = f"<|im_start|>{role}\n{text}<|im_end|>\n"
    return s + ("<|im_start|>assistant\n" if gen else "")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Server:
    def __init__(self, name, exe, model, args, outdir):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data = tempfile.mkdtemp(prefix=f"hypic-serve-{name}-")
        self.logpath = os.path.join(outdir, f"serve_{name}.log")
        self.log = open(self.logpath, "w")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("HYPIC_") or k in ("HYPIC_KERNEL_CACHE",)}
        cmd = [exe, "serve", "--model", model, "--bind", f"127.0.0.1:{self.port}",
               "--data-dir", self.data, "--disable-auth", "--invalidation-sweep-ms", "0",
               "--default-max-tokens", "16"] + args
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout=300):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.p.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.p.returncode} "
                                   f"(log {self.logpath}):\n{self.tail()}")
            try:
                st, h = self.get_json("/health")
                if st == 200:
                    return h
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server {self.name} not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n=30):
        self.log.flush()
        with open(self.logpath) as f:
            return "".join(f.readlines()[-n:])

    def _req(self, method, path, body=None, timeout=300):
        data = None if body is None else json.dumps(body).encode()
        r = urllib.request.Request(self.url + path, data=data, method=method,
                                   headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(r, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def get_json(self, path):
        st, t = self._req("GET", path, timeout=10)
        return st, json.loads(t) if t else None

    def get_text(self, path):
        return self._req("GET", path, timeout=30)[1]

    def post(self, path, body):
        st, t = self._req("POST", path, body)
        try:
            return st, json.loads(t)
        except ValueError:
            return st, {"raw": t}

    def stream(self, path, body):
        """SSE: returns (status, text, finish_reason, hypic, usage)."""
        r = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                   method="POST", headers={"content-type": "application/json"})
        text, finish, hyp, usage, done = "", None, None, None, False
        try:
            with urllib.request.urlopen(r, timeout=300) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    ch = json.loads(payload)
                    if "error" in ch:
                        return 500, json.dumps(ch), None, None, None
                    hyp = hyp or ch.get("hypic")
                    usage = ch.get("usage") or usage
                    for c in ch.get("choices", []):
                        text += (c.get("delta") or {}).get("content") or c.get("text") or ""
                        finish = c.get("finish_reason") or finish
                return (200 if done else 599), text, finish, hyp, usage
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(), None, None, None

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()
        shutil.rmtree(self.data, ignore_errors=True)


def outcomes(h):
    return [s.get("outcome") for s in (h or {}).get("segments", [])]


def chat_msgs(order, q):
    return [{"role": "system", "content": SYS},
            {"role": "user", "content": [{"type": "text", "text": DOCS[d] + "\n\n"} for d in order]},
            {"role": "user", "content": "Question: " + q}]


def ids_prompt(order, q):
    return ([{"text": im("system", SYS) + "<|im_start|>user\n"}]
            + [{"id": d} for d in order]
            + [{"text": "\n\nQuestion: " + q + "<|im_end|>\n<|im_start|>assistant\n"}])


def workload(s):
    """Sends every request to server `s` in a fixed order; returns {name: result}."""
    res = {}

    def rec(name, st, body, kind):
        r = {"status": st}
        if st == 200:
            ch = body["choices"]
            if kind == "chat":
                r["texts"] = [c["message"]["content"] for c in ch]
            else:
                r["texts"] = [c["text"] for c in ch]
            r["finish"] = [c.get("finish_reason") for c in ch]
            r["outcomes"] = outcomes(body.get("hypic"))
            r["hits"] = (body.get("hypic") or {}).get("hits")
            r["cached"] = body.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
            lp = [c.get("logprobs") for c in ch if c.get("logprobs")]
            if lp:
                r["logprobs"] = [[t["logprob"] for t in x["content"]] for x in lp]
                r["lp_tokens"] = [[t["token"] for t in x["content"]] for x in lp]
        else:
            r["error"] = body
        res[name] = r

    greedy = {"temperature": 0, "max_tokens": 12}
    for d in ORDER:
        st, b = s.post("/v1/segments", {"id": d, "name": d, "content": DOCS[d]})
        res["register " + d] = {"status": st,
                                "resident": ((b.get("hypic") or {}).get("residency") or {}).get("resident")
                                if st == 200 else b}
    st, b = s.post("/v1/completions", dict(greedy, segments=ids_prompt(ORDER[:2], QS[0])))
    rec("completions by id", st, b, "cmpl")
    st, b = s.post("/v1/completions", dict(greedy, segments=ids_prompt([ORDER[2], ORDER[0], ORDER[1]], QS[1])))
    rec("completions by id, reordered", st, b, "cmpl")
    st, b = s.post("/v1/chat/completions", dict(greedy, messages=chat_msgs(ORDER, QS[0])))
    rec("chat", st, b, "chat")
    st, b = s.post("/v1/chat/completions", dict(greedy, messages=chat_msgs(ORDER[::-1], QS[0])))
    rec("chat, documents reordered", st, b, "chat")
    st, text, fin, hyp, usage = s.stream("/v1/chat/completions", dict(
        greedy, messages=chat_msgs([ORDER[1], ORDER[2], ORDER[0]], QS[2]), stream=True,
        stream_options={"include_usage": True}))
    res["chat, streaming, reordered"] = (
        {"status": st, "texts": [text], "finish": [fin], "outcomes": outcomes(hyp),
         "hits": (hyp or {}).get("hits"),
         "cached": ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")}
        if st == 200 else {"status": st, "error": text})
    pc = dict(greedy, messages=chat_msgs(ORDER, QS[3]), hypic={"mode": "prefix_cache"})
    st, b = s.post("/v1/chat/completions", pc)
    rec("prefix_cache", st, b, "chat")
    st, b = s.post("/v1/chat/completions", pc)
    rec("prefix_cache, repeated", st, b, "chat")
    st, b = s.post("/v1/chat/completions", dict(greedy, n=2, messages=chat_msgs(ORDER[1:], QS[1])))
    rec("n=2", st, b, "chat")
    st, b = s.post("/v1/chat/completions", dict(greedy, logprobs=True, top_logprobs=2,
                                                messages=chat_msgs(ORDER[:1], QS[0])))
    rec("logprobs", st, b, "chat")
    # Four at once: decoded together (batch of 4 in the scheduler).
    out = [None] * 4

    def one(i):
        order = ORDER[i % 3:] + ORDER[:i % 3]
        out[i] = s.post("/v1/chat/completions", dict(greedy, max_tokens=16,
                                                     messages=chat_msgs(order, QS[i])))
    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i, (st, b) in enumerate(out):
        rec(f"concurrent {i}", st, b, "chat")
    return res


METRIC = re.compile(r'^(\w+)(?:\{([^}]*)\})?\s+(\S+)$')


def metrics(s):
    """{(name, sorted label pairs): value} of the server's /metrics."""
    m = {}
    for line in s.get_text("/metrics").splitlines():
        g = METRIC.match(line)
        if g:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', g.group(2) or ""))
            m[(g.group(1), tuple(sorted(labels.items())))] = float(g.group(3))
    return m


def metric_sum(m, name):
    """Sum of metric `name` over all its label sets."""
    return sum(v for (n, _), v in m.items() if n == name)


def metric(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def compare(ref, got, exact_outcomes=True):
    """Returns a list of (request, ok, note)."""
    rows = []
    for name, r in ref.items():
        g = got.get(name, {})
        if name.startswith("register"):
            ok = g.get("status") == 200 and r.get("status") == 200 and g.get("resident") is True
            rows.append((name, ok, f"status {g.get('status')}, resident {g.get('resident')}"))
            continue
        if g.get("status") != 200 or r.get("status") != 200:
            rows.append((name, False, f"status cpu {r.get('status')} / gpu {g.get('status')}: "
                         f"{str(g.get('error') or r.get('error'))[:200]}"))
            continue
        notes, ok = [], True
        if g["texts"] != r["texts"] or g["finish"] != r["finish"]:
            ok = False
            notes.append(f"answers differ: cpu {r['texts']!r} ({r['finish']}) / gpu {g['texts']!r} ({g['finish']})")
        else:
            notes.append(f"{g['texts'][0]!r}")
        if exact_outcomes and not name.startswith("concurrent") and g["outcomes"] != r["outcomes"]:
            ok = False
            notes.append(f"outcomes differ: cpu {r['outcomes']} / gpu {g['outcomes']}")
        else:
            notes.append(f"outcomes {','.join(g['outcomes'])}")
        if "logprobs" in r and "logprobs" in g:
            if g["lp_tokens"] != r["lp_tokens"]:
                ok = False
                notes.append("logprob tokens differ")
            else:
                d = max((abs(a - b) for x, y in zip(r["logprobs"], g["logprobs"]) for a, b in zip(x, y)),
                        default=0.0)
                notes.append(f"max |Δ logprob| {d:.2e}")
        rows.append((name, ok, "; ".join(notes)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hypic", default=".device/bin/hypic")
    ap.add_argument("--model", default="models/hypic-tiny")
    ap.add_argument("--out", default=os.environ.get("OUT", ".device/out"))
    ap.add_argument("--device", default="cuda", help="device under test (cpu: a dry run without a GPU)")
    ap.add_argument("--skip-extra", action="store_true", help="skip the spill and bf16 servers")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    report = [f"## `hypic serve --device {a.device}` vs `--device cpu` (scripts/serve_check.py)", ""]
    failures = []

    def check(ok, what):
        report.append(f"- {'PASS' if ok else 'FAIL'}: {what}")
        if not ok:
            failures.append(what)

    servers = []

    def start(name, args):
        s = Server(name, a.hypic, a.model, args, a.out)
        servers.append(s)
        t0 = time.time()
        h = s.wait_ready()
        return s, h, time.time() - t0

    try:
        cpu, hc, tc = start("cpu", ["--device", "cpu"])
        ref = workload(cpu)
        cpu.stop()
        gpu, hg, tg = start(a.device, ["--device", a.device, "--dtype", "f32", "--spill-mib", "64"])
        report.append(f"Servers ready in {tc:.1f} s (cpu) and {tg:.1f} s ({a.device}); "
                      f"/health: cpu {hc.get('backend')!r}, {a.device} {hg.get('backend')!r}.")
        report.append("")
        t0 = time.time()
        got = workload(gpu)
        dt = time.time() - t0
        m = metrics(gpu)
        gpu.stop()
        rows = compare(ref, got)
        report += ["| request | ok | notes |", "|---|---|---|"]
        report += [f"| {n} | {'PASS' if ok else 'FAIL'} | {note.replace('|', '/')} |" for n, ok, note in rows]
        report.append("")
        report.append(f"Workload on {a.device}: {dt:.1f} s.")
        report.append("")
        for n, ok, note in rows:
            if not ok:
                failures.append(f"{n}: {note}")
        check(hg.get("device") == a.device and hg.get("dtype") == "f32",
              f"/health reports device {hg.get('device')!r}, dtype {hg.get('dtype')!r}")
        info = [k for k in m if k[0] == "hypic_backend_info" and m[k] == 1.0]
        check(any(dict(k[1]).get("device") == a.device and dict(k[1]).get("dtype") == "f32" for k in info),
              f"/metrics hypic_backend_info: {[dict(k[1]) for k in info]}")
        ph = metric(m, "hypic_pool_events_total", pool="public", event="hit")
        pr = metric(m, "hypic_pool_events_total", pool="private", event="hit")
        seg_hits = sum(v for k, v in m.items() if k[0] == "hypic_segments_total" and dict(k[1]).get("outcome") == "hit")
        check(ph > 0 and pr > 0 and seg_hits > 0,
              f"cache hit counters moved: public pool hits {ph:.0f}, private pool hits {pr:.0f}, "
              f"hypic_segments_total{{outcome=hit}} {seg_hits:.0f}")
        check(got.get("chat, documents reordered", {}).get("hits", 0) or 0,
              f"reordered chat hits {got.get('chat, documents reordered', {}).get('hits')} segments "
              f"({got.get('chat, documents reordered', {}).get('outcomes')})")
        check("prefix_hit" in got.get("prefix_cache, repeated", {}).get("outcomes", []),
              f"repeated prefix_cache request: {got.get('prefix_cache, repeated', {}).get('outcomes')}")

        if not a.skip_extra:
            report += ["", f"### {a.device}, public pool 2 MiB + 64 MiB host spill (`--pool-policy lru`)", ""]
            sp, _, _ = start(f"{a.device}-spill", ["--device", a.device, "--public-pool-mib", "2",
                                                    "--spill-mib", "64", "--pool-policy", "lru"])
            got_sp = workload(sp)
            msp = metrics(sp)
            sp.stop()
            rows = compare(ref, got_sp, exact_outcomes=False)
            bad = [f"{n}: {note}" for n, ok, note in rows if not ok]
            check(not bad, f"answers equal the CPU's with entries spilled and restored ({len(rows) - len(bad)}/{len(rows)})"
                  + ("".join(f"\n  - {b}" for b in bad)))
            spilled = metric(msp, "hypic_pool_events_total", pool="public", event="spill")
            restored = metric(msp, "hypic_pool_events_total", pool="public", event="spill_restore")
            check(spilled > 0 and restored > 0,
                  f"spill counters moved: spill {spilled:.0f}, spill_restore {restored:.0f}, "
                  f"checksum failures {metric(msp, 'hypic_pool_events_total', pool='public', event='spill_checksum_failure'):.0f}")

            if a.device == "cuda":
                report += ["", "### cuda, `--dtype bf16` (reported; answers may differ from f32)", ""]
                bf, hb, _ = start("cuda-bf16", ["--device", "cuda", "--dtype", "bf16"])
                got_bf = workload(bf)
                mbf = metrics(bf)
                bf.stop()
                rows = compare(ref, got_bf, exact_outcomes=False)
                served = [n for n, r in got_bf.items() if r.get("status") == 200]
                check(len(served) == len(ref), f"bf16 answered {len(served)}/{len(ref)} requests with 200 "
                      f"(/health dtype {hb.get('dtype')!r})")
                same = sum(1 for n, ok, _ in rows if ok)
                report.append(f"- bf16 answers equal to the CPU's: {same}/{len(rows)}; public pool hits "
                              f"{metric(mbf, 'hypic_pool_events_total', pool='public', event='hit'):.0f}")
                for n, ok, note in rows:
                    if not ok:
                        report.append(f"  - {n}: {note}")
    except Exception as e:  # noqa: BLE001 - reported, then the run fails
        failures.append(f"{type(e).__name__}: {e}")
        report.append(f"- FAIL: {type(e).__name__}: {e}")
    finally:
        for s in servers:
            try:
                s.stop()
            except Exception:  # noqa: BLE001
                pass
    report += ["", f"**serve check: {'PASS' if not failures else 'FAIL (' + str(len(failures)) + ')'}**", ""]
    text = "\n".join(report)
    with open(os.path.join(a.out, "serve.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    if failures:
        print("\nfailures:\n" + "\n".join(f"  {x}" for x in failures), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
