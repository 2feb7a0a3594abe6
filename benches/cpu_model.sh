#!/usr/bin/env bash
# CPU prefill / decode throughput of the data plane's reference backend next to HF
# transformers, on this machine, for the tiny golden qwen3_next model and a ~0.5B
# random-weight Qwen3-Next-shaped model (made once under data/, which git ignores).
#
#   benches/cpu_model.sh                       # full run (~15-30 min on 2 busy cores)
#   PROMPTS="128" DECODE=8 REPEATS_TINY=2 REPEATS_05B=1 benches/cpu_model.sh   # quick
#
# Writes benches/results/cpu-model-<date>.{json,md,png}: per model and prompt length,
# the median prefill and decode tokens/s of both implementations measured in this run
# (ours then HF, back to back), their ratio ours/HF, CPU-normalised throughput, and the
# machine (lscpu model name, cores) and load average.
#
# Environment: PYTHON (default /work/pyenv/hf/bin/python: torch + transformers, and
# matplotlib for the plot), CARGO_TARGET_DIR (default target/), BIG_MODEL (default
# data/bench/qwen3_next_0.5b), DATE (default today, UTC), PROMPTS, DECODE, REPEATS_TINY,
# REPEATS_05B, THREADS (default: all cores, both sides).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

PY=${PYTHON:-/work/pyenv/hf/bin/python}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
DATE=${DATE:-$(date -u +%Y-%m-%d)}
PROMPTS=${PROMPTS:-"128 512"}
DECODE=${DECODE:-32}
REPEATS_TINY=${REPEATS_TINY:-5}
REPEATS_05B=${REPEATS_05B:-3}
THREADS=${THREADS:-$(nproc)}
TINY=dataplane/tests/fixtures/golden/qwen3_next
BIG=${BIG_MODEL:-data/bench/qwen3_next_0.5b}
OUT=benches/results
PREFIX=$OUT/cpu-model-$DATE
mkdir -p "$OUT"

echo "== building bench_model (release)" >&2
cargo build --release -p hypic-dataplane --example bench_model >&2
BIN=$CARGO_TARGET_DIR/release/examples/bench_model

if [[ ! -f $BIG/model.safetensors.index.json ]]; then
  echo "== making the 0.5B random-weight model in $BIG" >&2
  "$PY" tools/bench_hf_cpu.py --make-model "$BIG" --preset 0.5b >&2
fi

RUNS=$(mktemp "${TMPDIR:-/tmp}/cpu-model-runs.XXXXXX")
trap 'rm -f "$RUNS"' EXIT
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)

# tag LABEL SIDE: adds the label and side to the JSON object on stdin, one line out.
tag() {
  "$PY" -c 'import json, sys; d = json.load(sys.stdin); d.update(label=sys.argv[1], side=sys.argv[2]); print(json.dumps(d))' "$1" "$2"
}

for spec in "tiny-qwen3_next:$TINY:$REPEATS_TINY" "qwen3_next-0.5B:$BIG:$REPEATS_05B"; do
  IFS=: read -r label dir repeats <<<"$spec"
  for L in $PROMPTS; do
    echo "== $label prompt $L decode $DECODE x$repeats: ours" >&2
    "$BIN" --model "$dir" --prompt-len "$L" --decode-tokens "$DECODE" --repeats "$repeats" \
      --threads "$THREADS" | tag "$label" ours >>"$RUNS"
    echo "== $label prompt $L decode $DECODE x$repeats: HF transformers" >&2
    "$PY" tools/bench_hf_cpu.py --model "$dir" --prompt-len "$L" --decode-tokens "$DECODE" \
      --repeats "$repeats" --threads "$THREADS" | tag "$label" hf >>"$RUNS"
  done
done

GIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- dataplane tools || echo "+dirty")
BIG_INFO=$(cat "$BIG/bench_model_info.json" 2>/dev/null || echo '{}')
META=$("$PY" - "$DATE" "$GIT" "$LOAD_START" "$BIG_INFO" <<'EOF'
import json, sys
date, git, load, big = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
models = {
    "tiny-qwen3_next": "golden fixture dataplane/tests/fixtures/golden/qwen3_next: hidden 64, 5 layers "
    "(3 GDN + 2 gated attention), 8 experts top-2 + shared, vocab 320, 0.40 M params",
    "qwen3_next-0.5B": "random weights (tools/bench_hf_cpu.py --make-model --preset 0.5b, HF init, seed 0): "
    "hidden 1024, 24 layers (18 GDN + 6 gated attention, 3:1), GDN 8 key / 16 value heads x 64, "
    "attention 8 q / 2 kv heads x 128 (partial RoPE 25 %, output gate), MoE 32 experts (I=128) top-8 "
    "+ shared expert (I=512) in every layer, vocab 32768 untied, fp32; "
    f"{big.get('params_total', 0) / 1e6:.1f} M params in total "
    f"({big.get('params_experts_routed', 0) / 1e6:.0f} M routed experts), "
    f"~{big.get('params_matmul_per_token', 0) / 1e6:.0f} M weights in each token's matrix products",
}
notes = [
    "HF runs with OMP_WAIT_POLICY=PASSIVE (set by tools/bench_hf_cpu.py): with libgomp's default "
    "spin-waiting HF is 10-25x slower on this shared 2-core machine.",
    "Wall-clock numbers depend on what else runs on the machine; compare the ratios of one run.",
]
print(json.dumps({"date": date, "git": git, "loadavg_start": load, "models": models, "notes": notes}))
EOF
)
"$PY" tools/bench_hf_cpu.py --report "$RUNS" --out-prefix "$PREFIX" --meta "$META"
echo "== wrote $PREFIX.json $PREFIX.md $PREFIX.png" >&2
cat "$PREFIX.md"
