#!/usr/bin/env bash
# Serving under load (issue 18's proof): `hypic serve` on one backend with a model
# folder or a random-weight config, and `hypic bench --url` against it: a RAG-like
# workload (system prompt, Zipf-drawn documents, a question, multi-turn sessions),
# Poisson arrivals over a rate sweep, one run per mode. Writes $OUT/bench-<mode>/
# (summary.md, summary.json, samples.jsonl, plots), $OUT/serve.log and the server's
# /metrics at the end ($OUT/metrics.txt).
#
#   scripts/load_bench.sh                       # CPU, bundled model, a small workload
#   LOAD_DEVICE=cuda LOAD_DTYPE=bf16 LOAD_CONFIG=benches/configs/qwen3_5_35b_a3b \
#     LOAD_RATES=1,2,4 scripts/load_bench.sh    # the 35B-A3B shape, random weights
#
# LOAD_CONFIG: a folder with a config.json; its weights are not read (random weights,
# seed 0) and the bundled model's tokenizer is used. Other knobs: LOAD_MODES,
# LOAD_RATES, LOAD_REQUESTS, LOAD_DOCS, LOAD_DOCS_PER_REQUEST, LOAD_DOC_WORDS,
# LOAD_SYSTEM_WORDS, LOAD_QUERY_WORDS, LOAD_MAX_TOKENS, LOAD_MULTI_TURN, LOAD_WARMUP,
# LOAD_PRIME=1 (`hypic bench --prime`: each run's documents cached ahead), HYPIC_BIN, and
# LOAD_SERVE_ARGS (more `hypic serve` flags, e.g. pool sizes). The bench sends its
# documents inline, so the server caches them in the tenant's private pool: with
# LOAD_PRIME=1 size `--private-pool-mib` for the documents a run retrieves (at the
# Qwen3.5-35B-A3B shape about 150 MB per 1k-token document: recurrent states, KV and
# the dense transition pair), e.g.
#   LOAD_SERVE_ARGS="--public-pool-mib 2000 --private-pool-mib 36000 --kv-budget-mib 12000 \
#     --step-tokens 8192 --prefill-chunk-tokens 4096"
# and LOAD_DOC_WORDS=470 LOAD_SYSTEM_WORDS=930 LOAD_QUERY_WORDS=30 give ~1k-token
# documents, a ~2k-token system prompt and a ~64-token question with the bundled tokenizer.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/load}"
mkdir -p "$OUT"
bin="${HYPIC_BIN:-target/release/hypic}"
model=models/hypic-tiny
extra=()
if [ -n "${LOAD_CONFIG:-}" ]; then
  model=$(mktemp -d)
  cp "$LOAD_CONFIG/config.json" "$model/"
  cp models/hypic-tiny/tokenizer.json models/hypic-tiny/tokenizer_config.json "$model/"
  [ -f models/hypic-tiny/generation_config.json ] && cp models/hypic-tiny/generation_config.json "$model/"
  extra+=(--random-weights 0)
fi
port=$((20000 + RANDOM % 20000))
data=$(mktemp -d)
"$bin" serve --model "$model" --model-id load --bind "127.0.0.1:$port" --data-dir "$data" \
  --disable-auth --invalidation-sweep-ms 0 --device "${LOAD_DEVICE:-cpu}" \
  --dtype "${LOAD_DTYPE:-f32}" "${extra[@]}" ${LOAD_SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 2400); do
  python3 -c "import urllib.request,sys; urllib.request.urlopen(\"http://127.0.0.1:$port/health\", timeout=2)" >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { echo "load_bench: the server exited:" >&2; tail -20 "$OUT/serve.log" >&2; exit 1; }
  sleep 0.25
done
echo "load_bench: server ready after $SECONDS s" >&2
# One bench run per mode (results in $OUT/bench-<mode>/), so that a run cut short
# keeps the modes it finished.
IFS=, read -r -a modes <<< "${LOAD_MODES:-hypic,prefix_cache,full_recompute,naive_addition}"
for mode in "${modes[@]}"; do
  "$bin" bench --url "http://127.0.0.1:$port" --quiet --out "$OUT/bench-${mode//:/_}" \
    --modes "$mode" \
    --rates "${LOAD_RATES:-0.5,1}" --requests "${LOAD_REQUESTS:-16}" \
    --docs "${LOAD_DOCS:-200}" --docs-per-request "${LOAD_DOCS_PER_REQUEST:-8}" \
    --doc-words "${LOAD_DOC_WORDS:-160}" --system-words "${LOAD_SYSTEM_WORDS:-120}" \
    --query-words "${LOAD_QUERY_WORDS:-24}" --max-tokens "${LOAD_MAX_TOKENS:-16}" \
    --multi-turn "${LOAD_MULTI_TURN:-0.2}" --warmup "${LOAD_WARMUP:-2}" \
    $([ "${LOAD_PRIME:-0}" = 1 ] && echo --prime)
  echo "load_bench: $mode done after $SECONDS s" >&2
done
# The server's counters at the end (scheduler events such as batched prefills, pools).
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/metrics', timeout=10).read().decode())" \
  > "$OUT/metrics.txt" 2>/dev/null || echo "load_bench: could not read /metrics" >&2
echo "load_bench: done after $SECONDS s" >&2
