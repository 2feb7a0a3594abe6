#!/usr/bin/env bash
# `hypic eval` over the first N held-out prompts, split into S shards that run side by
# side (one single-threaded process per shard), then merged into one report:
#
#   benches/eval_sharded.sh HYPIC_BIN SHARDS N OUT_DIR [extra hypic eval args...]
#
# e.g. on a 16-core machine: benches/eval_sharded.sh target/release/hypic 16 512 eval-512
# Shard i evaluates items [i*ceil(N/S), (i+1)*ceil(N/S)) (`--skip`/`--limit`) into
# OUT_DIR/shard-i/; `hypic eval --merge` then writes OUT_DIR/report.{md,json} and
# OUT_DIR/quality_vs_ttft.svg with the scores and predictions one run over the N prompts
# would give (scores weighted by item counts). TTFT is measured per shard process with
# RAYON_NUM_THREADS=1, so the machine should have at least SHARDS cores.
set -euo pipefail
if (( $# < 4 )) || ! [[ $2 =~ ^[1-9][0-9]*$ && $3 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 HYPIC_BIN SHARDS N OUT_DIR [extra hypic eval args...]  (SHARDS, N >= 1)" >&2
  exit 2
fi
bin=$1 shards=$2 n=$3 out=$4
shift 4
per=$(( (n + shards - 1) / shards ))
mkdir -p "$out"
pids=() reports=()
for ((i = 0; i < shards; i++)); do
  skip=$((i * per))
  (( skip < n )) || break
  lim=$(( n - skip < per ? n - skip : per ))
  RAYON_NUM_THREADS=1 "$bin" eval --skip "$skip" --limit "$lim" --out "$out/shard-$i" "$@" \
    > "$out/shard-$i.log" 2>&1 &
  pids+=($!)
  reports+=("$out/shard-$i/report.json")
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if (( rc != 0 )); then
  echo "a shard failed; logs in $out/shard-*.log" >&2
  tail -n 5 "$out"/shard-*.log >&2
  exit 1
fi
"$bin" eval --merge "${reports[@]}" --out "$out" > /dev/null
cat "$out/report.md"
