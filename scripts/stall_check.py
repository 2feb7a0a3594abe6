#!/usr/bin/env python3
"""Head-of-line blocking behind a long cold prompt, measured on `hypic serve`.

One server per configuration (its `serve` flags after `--config NAME=FLAGS`), each
measured the same way:
1. a short request alone (its time to first token, TTFT);
2. a decode stream is started (greedy, `ignore_eos`), then a long cold prompt, then,
   SHORT_DELAY s later, the short request again: reported are the short request's
   TTFT, the long prompt's TTFT and the longest gap between two tokens of the stream
   while the long prompt is prefilled.

TTFT is measured client-side from the request's send to its first streamed token.
Python 3 standard library only; the report (a markdown table) goes to stdout.

  python3 scripts/stall_check.py --hypic target/debug/hypic --model models/hypic-tiny \
      --config "whole=--step-tokens 100000000 --prefill-chunk-tokens 100000000" \
      --config "budget=" --long-tokens 7898
"""
import argparse
import json
import os
import shlex
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_check import Server  # noqa: E402

WORDS = ("the harbour town keeps a ledger of ships cargo and tides each morning "
         "clerks write the names of captains and the weight of grain").split()


def stream(url, body, out, key):
    """POSTs a streamed completion; records send time, each token chunk's arrival
    time and the prompt token count (from the usage chunk) into out[key]."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    r = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                               method="POST", headers={"content-type": "application/json"})
    rec = {"sent": time.time(), "tokens": [], "prompt_tokens": None}
    out[key] = rec
    with urllib.request.urlopen(r, timeout=600) as resp:
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                rec["prompt_tokens"] = ev["usage"].get("prompt_tokens")
            if any(c.get("text") for c in ev.get("choices", [])):
                rec["tokens"].append(time.time())


def ttft(rec):
    return rec["tokens"][0] - rec["sent"] if rec["tokens"] else float("nan")


def measure(srv, long_tokens, short_delay, salt):
    # The tiny tokenizer turns a word into about 1-2 tokens: grow the text until
    # the server counts `long_tokens` prompt tokens.
    words = [f"{WORDS[i % len(WORDS)]}{salt}" if i % 97 == 0 else WORDS[i % len(WORDS)]
             for i in range(long_tokens)]
    short = {"prompt": f"Question {salt}: who keeps the ledger?\nAnswer:",
             "max_tokens": 4, "temperature": 0}
    res = {}
    stream(srv.url, short, res, "alone")
    long_body = {"prompt": " ".join(words), "max_tokens": 1, "temperature": 0}
    res_st = {}
    bg = {"prompt": f"Stream {salt}:", "max_tokens": 100000, "temperature": 0,
          "ignore_eos": True}
    ts = threading.Thread(target=stream, args=(srv.url, bg, res_st, "stream"), daemon=True)
    ts.start()
    while "stream" not in res_st or len(res_st["stream"]["tokens"]) < 3:
        time.sleep(0.01)
    tl = threading.Thread(target=stream, args=(srv.url, long_body, res, "long"))
    tl.start()
    time.sleep(short_delay)
    stream(srv.url, dict(short, prompt=short["prompt"] + " again"), res, "behind")
    tl.join()
    long_sent, long_first = res["long"]["sent"], res["long"]["tokens"][0]
    toks = [t for t in res_st["stream"]["tokens"] if long_sent <= t <= long_first + 0.5]
    gap = max((b - a for a, b in zip(toks, toks[1:])), default=float("nan"))
    return {
        "short_alone": ttft(res["alone"]),
        "short_behind": ttft(res["behind"]),
        "long": ttft(res["long"]),
        "long_tokens": res["long"]["prompt_tokens"],
        "stream_gap": gap,
        "stream_tokens": len(toks),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hypic", required=True)
    ap.add_argument("--model", default="models/hypic-tiny")
    ap.add_argument("--config", action="append", required=True,
                    help="NAME=extra serve flags")
    ap.add_argument("--long-tokens", type=int, default=7898)
    ap.add_argument("--short-delay", type=float, default=0.3)
    a = ap.parse_args()
    out = tempfile.mkdtemp(prefix="stall-")
    rows = []
    for i, c in enumerate(a.config):
        name, _, flags = c.partition("=")
        srv = Server(name, a.hypic, a.model, shlex.split(flags), out)
        try:
            srv.wait_ready()
            r = measure(srv, a.long_tokens, a.short_delay, i)
        finally:
            srv.p.terminate()
            srv.p.wait()
        rows.append((name, flags, r))
        print(f"{name}: {r}", file=sys.stderr)
    print("| configuration | serve flags | long prompt tokens | long TTFT s | short alone TTFT s "
          "| short behind long TTFT s | stream: longest gap s (tokens) during the long prefill |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, flags, r in rows:
        print(f"| {name} | `{flags or '(defaults)'}` | {r['long_tokens']} | {r['long']:.2f} "
              f"| {r['short_alone']:.2f} | {r['short_behind']:.2f} "
              f"| {r['stream_gap']:.2f} ({r['stream_tokens']}) |")


if __name__ == "__main__":
    main()
