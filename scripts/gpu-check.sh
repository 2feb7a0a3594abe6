#!/usr/bin/env bash
# GPU equivalence checks and benchmarks of the CUDA data plane (issue 6).
#
# Two halves, because the GPU machine has no Rust:
#
#   scripts/gpu-check.sh build     # here: builds the test and bench executables with
#                                  # --features cuda, strips them into .device/bin/,
#                                  # and fills .device/kcache with the NVRTC-compiled
#                                  # kernels for sm_90a (needs libnvrtc: set
#                                  # LD_LIBRARY_PATH and HYPIC_CUDA_INCLUDE, see below)
#   scripts/gpu-check.sh run       # on the GPU machine, through the device tool:
#                                  #   run(command="scripts/gpu-check.sh run",
#                                  #       carry=[".device", ".whl"])
#                                  # runs the GPU-vs-CPU tests (cuda_kernels, cuda_attn, cuda_moe,
#                                  # the whole-model cuda_model, the PIC engine
#                                  # cuda_pic, Ring-linear cuda_families, Kimi-Linear
#                                  # cuda_kimi), our benchmark, FLA
#                                  # chunk_gated_delta_rule and torch SDPA,
#                                  # the random-weight model test (cuda_random) and
#                                  # the whole-model benchmark gpu_model_bench at the
#                                  # Qwen3.5-35B-A3B shape (step `modelbench`: up to
#                                  # 1080 s with its batched-decode baselines; MODEL_BENCH_FULL=0
#                                  # leaves the decode tables, up to 840 s;
#                                  # MODEL_BENCH_GDN_AB=0 drops both baselines), at
#                                  # the Ring-mini / Kimi-Linear-48B / Ring-flash shapes
#                                  # (step `familybench`: $OUT/family_model_bench.md,
#                                  # ≤ 175 s per config) and
#                                  # the server end to end (step `serve`: `hypic serve
#                                  # --device cuda` against `--device cpu` on the bundled
#                                  # model, scripts/serve_check.py) in one run, and writes
#                                  # $OUT/report.md (+ logs, and gpu_report.png where
#                                  # matplotlib is installed: tools/plot_gpu_report.py)
#
# Step `load35b` (not in the default list: it writes ~60-70 GB and loads it twice;
# run it alone, GPU_CHECK_STEPS=load35b, for both halves): scripts/load_check.py writes
# a random-weight checkpoint of the Qwen3.5-35B-A3B shape with `hypic random-checkpoint`
# into /dev/shm (as many layers as fit, LOAD35B_LAYERS to choose), serves it with
# `hypic serve --device cuda --dtype bf16 --model DIR` (the streaming GpuModel::load),
# reports load time, GB/s and VmHWM, and requires greedy answers equal to
# `--random-weights` (GpuModel::random, same seed): $OUT/load35b.md.
#
# Step `parallel` (not in the default list): scripts/parallel_check.py starts two
# `hypic worker --device cuda` processes and a `hypic serve --device cuda --workers`
# beside a server without workers, all on the one GPU, in f32 and bf16
# (PARALLEL_DTYPES), and requires equal answers and per-segment outcomes and a real
# scatter: $OUT/parallel.md.
#
# Step `devices` (not in the default list): dataplane/tests/cuda_parallel.rs (the
# device checksum kernel against its CPU reference; two in-process workers and a
# combiner on GPU 0 over the peer transport against one engine, bit for bit, and a
# damaged device entry recomputed; a GPU 1 → GPU 0 case that says "skipped: needs 2
# GPUs" on one GPU), then scripts/parallel_check.py --devices 0,0 (`hypic serve
# --device cuda --devices 0,0` against a server alone, end to end, in PARALLEL_DTYPES):
# $OUT/devices.md.
#
# PIC_TESTS="word ..." limits step `pic` to the cuda_pic tests whose names contain one
# of the words (e.g. PIC_TESTS=batched_prefill).
#
# Step `decode` runs dataplane/tests/cuda_decode.rs (device sampling in the decode
# step against the host path); step `moebench` runs `gpu_bench --moe-grouped` (the
# grouped MoE expert GEMMs against the per-expert cuBLAS loop and torch._grouped_mm,
# 1k/4k/16k tokens at the 35B-A3B shape).
#
# Issue 19's kernel proof: step `families` also times our Lightning prefill
# (`gpu_bench --lightning`, $OUT/lightning_bench.md) and step `kimi` our KDA prefill
# (`gpu_bench --kda`, $OUT/kda_bench.md); step `fla` times FLA 0.6.0
# `chunk_simple_gla` (per-head g_gamma, 16 heads × 128), `chunk_kda` (32 heads × 128)
# and `chunk_gated_delta_rule`, each eagerly and replayed from a CUDA graph (chunk_kda
# last, its Triton autotune being slow; FLA_TIMEOUT seconds for the whole step, default
# 540), and writes $OUT/fla_vs_ours.md (ours against FLA graph and eager, per length;
# a second Lightning table for the two-pass form when the bench has it). Step
# `familybench` runs gpu_model_bench (TTFT full / prefix / hypic, decode, layer split)
# at benches/configs/{ring_mini_linear_2_0,kimi_linear_48b_a3b,ring_flash_linear_2_0}
# in bf16, cut to the layers that fit: $OUT/family_model_bench.md.
#
# GPU_CHECK_STEPS selects steps for both halves: `build` then builds only the
# executables those steps need (e.g. GPU_CHECK_STEPS=serve builds just the stripped
# `hypic` binary, --release --features cuda, plus gpu_bench for the kernel cache).
#
# .device/ and .whl/ are git-ignored (add `/.device/` and `/.whl/` to
# .git/info/exclude if they are not). .whl/ holds the FLA wheels:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl \
#     flash-linear-attention==0.6.0 fla-core==0.6.0
# Precompiling kernels here needs NVRTC 13.0 (e.g. the nvidia-cuda-nvrtc and
# nvidia-cuda-runtime/-cccl 13.0 wheels unpacked somewhere):
#   LD_LIBRARY_PATH=<nvidia/cu13/lib> HYPIC_CUDA_INCLUDE=<nvidia/cu13/include> \
#     scripts/gpu-check.sh build
# Without it the GPU machine compiles the kernels itself on first use (~20 s).
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"

build() {
  set -e
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
  local steps=" ${GPU_CHECK_STEPS:-kernels attn moe model pic decode families kimi bench moebench fla modelbench familybench serve} "
  wantb() { [[ "$steps" == *" $1 "* ]]; }
  mkdir -p .device/bin "$CARGO_TARGET_DIR"
  local built=() pair name exe
  # Test executables of each step.
  for pair in kernels:cuda_kernels moe:cuda_moe model:cuda_model pic:cuda_pic \
              modelbench:cuda_random attn:cuda_attn decode:cuda_decode decode:cuda_graph families:cuda_families kimi:cuda_kimi \
              devices:cuda_parallel; do
    wantb "${pair%%:*}" || continue
    name=${pair#*:}
    exe=$(cargo test --release -p hypic-dataplane --features cuda --test "$name" --no-run \
          --message-format=json 2>"$CARGO_TARGET_DIR/gpu-check-$name.log" \
          | grep -o "\"executable\":\"[^\"]*$name[^\"]*\"" | tail -1 \
          | sed 's/"executable":"\(.*\)"/\1/')
    [ -n "$exe" ] || {
      echo "could not build the $name test binary; cargo said:" >&2
      tail -40 "$CARGO_TARGET_DIR/gpu-check-$name.log" >&2
      exit 1
    }
    cp "$exe" ".device/bin/$name"
    built+=(".device/bin/$name")
  done
  # gpu_bench always (it precompiles the kernel cache); gpu_model_bench for modelbench
  # and familybench.
  cargo build --release -p hypic-dataplane --features cuda --example gpu_bench --example gpu_model_bench
  cp "$CARGO_TARGET_DIR/release/examples/gpu_bench" .device/bin/gpu_bench
  built+=(.device/bin/gpu_bench)
  if wantb modelbench || wantb familybench; then
    cp "$CARGO_TARGET_DIR/release/examples/gpu_model_bench" .device/bin/gpu_model_bench
    built+=(.device/bin/gpu_model_bench)
  fi
  # The server (step serve): the `hypic` binary with the CUDA backend.
  if wantb serve || wantb parallel || wantb devices || wantb load35b; then
    cargo build --release -p hypic-control --features cuda --bin hypic
    cp "$CARGO_TARGET_DIR/release/hypic" .device/bin/hypic
    built+=(.device/bin/hypic)
  fi
  strip "${built[@]}" || true
  if HYPIC_KERNEL_CACHE="$PWD/.device/kcache" .device/bin/gpu_bench --precompile sm_90a; then
    echo "kernel cache for sm_90a in .device/kcache"
  else
    echo "note: no NVRTC here; the GPU machine will compile the kernels itself"
  fi
  # The device tool carries at most 64 MiB (working tree included): xz the executables
  # (about 3.5x smaller); `run` unpacks them.
  for exe in "${built[@]}"; do rm -f "$exe.xz"; done
  xz -T0 -6 "${built[@]}"
  ls -l .device/bin
  du -sh .device
}

run() {
  # GPU_CHECK_STEPS: which parts to run (default all): kernels attn moe model pic decode families kimi bench moebench fla modelbench familybench serve
  local steps=" ${GPU_CHECK_STEPS:-kernels attn moe model pic decode families kimi bench moebench fla modelbench familybench serve} "
  want() { [[ "$steps" == *" $1 "* ]]; }
  local s_
  for s_ in $steps; do
    case "$s_" in
      kernels|attn|moe|model|pic|decode|families|kimi|bench|moebench|fla|modelbench|familybench|serve|parallel|devices|load35b) ;;
      *) echo "unknown step \`$s_\` in GPU_CHECK_STEPS (known: kernels attn moe model pic decode families kimi bench moebench fla modelbench familybench serve parallel devices load35b)" >&2
         return 2 ;;
    esac
  done
  OUT="${OUT:-$PWD/.device/out}"
  mkdir -p "$OUT"
  export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
  # Writable copy of the carried kernel cache.
  mkdir -p /tmp/hypic-kcache && cp -r .device/kcache/. /tmp/hypic-kcache/ 2>/dev/null || true
  export HYPIC_KERNEL_CACHE=/tmp/hypic-kcache
  local date_s; date_s=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  {
    echo "# gpu-check $date_s"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
    ls /usr/local/cuda/lib64/libnvrtc.so* /usr/local/cuda/lib64/libcublas.so* 2>&1 | head -5
  } > "$OUT/machine.txt"
  cat "$OUT/machine.txt"

  echo "== equivalence tests"
  local t0=$SECONDS
  python3 - <<'PY'
import glob, lzma, os
for f in glob.glob(".device/bin/*.xz"):
    with lzma.open(f) as src, open(f[:-3], "wb") as dst:
        dst.write(src.read())
    os.chmod(f[:-3], 0o755)
PY
  chmod +x .device/bin/* 2>/dev/null || true
  local exe_ st_ missing_=0
  for st_ in kernels:cuda_kernels attn:cuda_attn moe:cuda_moe model:cuda_model pic:cuda_pic \
             decode:cuda_decode decode:cuda_graph families:cuda_families kimi:cuda_kimi bench:gpu_bench moebench:gpu_bench modelbench:cuda_random modelbench:gpu_model_bench familybench:gpu_model_bench serve:hypic \
             parallel:hypic devices:cuda_parallel devices:hypic load35b:hypic; do
    exe_=${st_#*:}
    if want "${st_%%:*}" && [ ! -x ".device/bin/$exe_" ]; then
      echo "missing .device/bin/$exe_ (step ${st_%%:*}): run \`scripts/gpu-check.sh build\` first" >&2
      missing_=1
    fi
  done
  [ "$missing_" -eq 0 ] || return 3
  local test_rc=0 attn_rc=0 moe_rc=0 model_rc=0 pic_rc=0 decode_rc=0 graph_rc=0 families_rc=0 kimi_rc=0 moebench_rc=0
  : > "$OUT/attn_tests.log"
  : > "$OUT/tests.log"; : > "$OUT/tests_moe.log"; : > "$OUT/model_tests.log"; : > "$OUT/pic_tests.log"; : > "$OUT/bench.md"; : > "$OUT/fla.md"
  : > "$OUT/random_tests.log"; : > "$OUT/model_bench.md"
  : > "$OUT/decode_tests.log"; : > "$OUT/moe_bench.md"
  : > "$OUT/lightning_bench.md"; : > "$OUT/kda_bench.md"; : > "$OUT/fla_vs_ours.md"; : > "$OUT/family_model_bench.md"
  if want kernels; then
  .device/bin/cuda_kernels --test-threads=1 --nocapture > "$OUT/tests.log" 2>&1
  test_rc=$?
  fi
  want kernels && echo "tests rc=$test_rc in $((SECONDS - t0)) s" || echo "kernel tests: skipped"
  grep -E "^test |test result|rel .*tol|panicked" "$OUT/tests.log" | grep -v "^test .* ok$" | tail -60

  echo "== attention fast path tests (dataplane/tests/cuda_attn.rs)"
  t0=$SECONDS
  if want attn; then
  timeout 300 .device/bin/cuda_attn --test-threads=1 --nocapture > "$OUT/attn_tests.log" 2>&1
  attn_rc=$?
  fi
  want attn && echo "attn tests rc=$attn_rc in $((SECONDS - t0)) s" || echo "attn tests: skipped"
  grep -E "rel .*tol|FAIL|test result|panicked|SKIP" "$OUT/attn_tests.log" | grep -v " ok$" | tail -40

  echo "== MoE / SwiGLU / sampling tests"
  t0=$SECONDS
  if want moe; then
  .device/bin/cuda_moe --test-threads=1 --nocapture > "$OUT/tests_moe.log" 2>&1
  moe_rc=$?
  fi
  want moe && echo "moe tests rc=$moe_rc in $((SECONDS - t0)) s" || echo "moe tests: skipped"
  grep -E "FAIL|test result|panicked|skipped" "$OUT/tests_moe.log" | tail -40

  echo "== whole-model tests (GPU vs CPU, dataplane/tests/cuda_model.rs)"
  t0=$SECONDS
  # HYPIC_CUDA_POISON=1 (here and for cuda_pic / cuda_random): Gpu::scratch buffers start
  # as NaN, so a kernel that reads an element nobody wrote fails the comparison.
  # Run from the repository root (fixtures and models/hypic-tiny are read from it);
  # a missing device is a failure here, not a skip.
  # Each test in its own process, so that a kernel fault (which poisons the CUDA
  # context) in one does not take the others with it.
  local name rc
  local list_model=""
  want model && list_model=$(.device/bin/cuda_model --list --format=terse 2>/dev/null | sed -n 's/: test$//p')
  if want model && [ -z "$list_model" ]; then
    echo "cuda_model lists no tests" | tee -a "$OUT/model_tests.log" >&2
    model_rc=1
  fi
  want model && for name in $list_model; do
    HYPIC_CUDA_POISON=${HYPIC_CUDA_POISON:-1} HYPIC_REPO_ROOT="$PWD" HYPIC_GREEDY_ITEMS=${HYPIC_GREEDY_ITEMS:-64} timeout 240 .device/bin/cuda_model --exact "$name" \
      --test-threads=1 --nocapture >> "$OUT/model_tests.log" 2>&1
    rc=$?
    echo "cuda_model $name rc=$rc" >> "$OUT/model_tests.log"
    [ "$rc" -ne 0 ] && model_rc=$rc
  done
  want model && echo "model tests rc=$model_rc in $((SECONDS - t0)) s" || echo "model tests: skipped"
  grep -E "^test |test result|rel .*tol|FAIL|panicked|greedy|^cuda_model gpu::" "$OUT/model_tests.log" \
    | grep -v "^test .* ok$" | tail -60

  echo "== PIC engine tests (GPU vs CPU, dataplane/tests/cuda_pic.rs)"
  t0=$SECONDS
  local list_pic=""
  want pic && list_pic=$(.device/bin/cuda_pic --list --format=terse 2>/dev/null | sed -n 's/: test$//p')
  # PIC_TESTS="a b": only the cuda_pic tests whose names contain one of these words.
  if [ -n "${PIC_TESTS:-}" ]; then
    list_pic=$(for n in $list_pic; do for w in $PIC_TESTS; do [[ "$n" == *"$w"* ]] && echo "$n" && break; done; done)
    [ -z "$list_pic" ] && { echo "no cuda_pic test matches PIC_TESTS=$PIC_TESTS" | tee -a "$OUT/pic_tests.log" >&2; pic_rc=1; }
  fi
  if want pic && [ -z "$list_pic" ]; then
    echo "cuda_pic lists no tests" | tee -a "$OUT/pic_tests.log" >&2
    pic_rc=1
  fi
  want pic && for name in $list_pic; do
    HYPIC_CUDA_POISON=${HYPIC_CUDA_POISON:-1} HYPIC_REPO_ROOT="$PWD" timeout 300 .device/bin/cuda_pic --exact "$name" \
      --test-threads=1 --nocapture >> "$OUT/pic_tests.log" 2>&1
    rc=$?
    echo "cuda_pic $name rc=$rc" >> "$OUT/pic_tests.log"
    [ "$rc" -ne 0 ] && pic_rc=$rc
  done
  want pic && echo "pic tests rc=$pic_rc in $((SECONDS - t0)) s" || echo "pic tests: skipped"
  grep -E "^test |test result|FAIL|panicked|^cuda_pic gpu::" "$OUT/pic_tests.log" \
    | grep -v "^test .* ok$" | tail -60

  echo "== decode-step tests: device sampling (dataplane/tests/cuda_decode.rs)"
  t0=$SECONDS
  if want decode; then
    HYPIC_CUDA_POISON=${HYPIC_CUDA_POISON:-1} HYPIC_REPO_ROOT="$PWD" timeout 300 .device/bin/cuda_decode \
      --test-threads=1 --nocapture > "$OUT/decode_tests.log" 2>&1
    decode_rc=$?
    grep -q "running [1-9][0-9]* test" "$OUT/decode_tests.log" || { echo "cuda_decode ran no test" >&2; decode_rc=1; }
    # CUDA graphs of the decode step against the eager step, bit for bit (tests/cuda_graph.rs).
    HYPIC_CUDA_POISON=${HYPIC_CUDA_POISON:-1} HYPIC_REPO_ROOT="$PWD" timeout 300 .device/bin/cuda_graph \
      --test-threads=1 --nocapture > "$OUT/graph_tests.log" 2>&1
    graph_rc=$?
    grep -q "running [1-9][0-9]* test" "$OUT/graph_tests.log" || { echo "cuda_graph ran no test" >&2; graph_rc=1; }
    grep -q "skipped:" "$OUT/graph_tests.log" && { echo "cuda_graph skipped (no device)" >&2; graph_rc=1; }
    [ "$decode_rc" -eq 0 ] && decode_rc=$graph_rc
    echo "decode tests rc=$decode_rc (cuda_graph rc=$graph_rc) in $((SECONDS - t0)) s"
  else
    echo "decode tests: skipped"
  fi
  grep -E "^  |FAIL|test result|panicked" "$OUT/decode_tests.log" | tail -60
  grep -E "^  |FAIL|test result|panicked|skipped" "$OUT/graph_tests.log" 2>/dev/null | tail -30

  echo "== model families: Ring-linear-2.0 on the GPU vs the CPU (dataplane/tests/cuda_families.rs)"
  t0=$SECONDS
  if want families; then
    HYPIC_CUDA_POISON=${HYPIC_CUDA_POISON:-1} HYPIC_REPO_ROOT="$PWD" timeout 600 .device/bin/cuda_families \
      --test-threads=1 --nocapture > "$OUT/families_tests.log" 2>&1
    families_rc=$?
    grep -q "running [1-9][0-9]* test" "$OUT/families_tests.log" || { echo "cuda_families ran no test" >&2; families_rc=1; }
    grep -q "skipped:" "$OUT/families_tests.log" && { echo "cuda_families skipped its tests (no device)" >&2; families_rc=1; }
    echo "families tests rc=$families_rc in $((SECONDS - t0)) s"
    # Our Lightning kernels' times (FLA's chunk_simple_gla is timed in step fla).
    timeout 240 .device/bin/gpu_bench --lightning > "$OUT/lightning_bench.md" 2>&1 || echo "gpu_bench --lightning failed" >&2
  else
    echo "families tests: skipped"
  fi
  grep -E "^  |FAIL|test result|panicked" "$OUT/families_tests.log" 2>/dev/null | tail -80

  echo "== model families: Kimi-Linear on the GPU vs the CPU (dataplane/tests/cuda_kimi.rs)"
  t0=$SECONDS
  if want kimi; then
    HYPIC_CUDA_POISON=${HYPIC_CUDA_POISON:-1} HYPIC_REPO_ROOT="$PWD" timeout 600 .device/bin/cuda_kimi \
      --test-threads=1 --nocapture > "$OUT/kimi_tests.log" 2>&1
    kimi_rc=$?
    grep -q "running [1-9][0-9]* test" "$OUT/kimi_tests.log" || { echo "cuda_kimi ran no test" >&2; kimi_rc=1; }
    grep -q "skipped:" "$OUT/kimi_tests.log" && { echo "cuda_kimi skipped its tests (no device)" >&2; kimi_rc=1; }
    echo "kimi tests rc=$kimi_rc in $((SECONDS - t0)) s"
    # Our KDA kernels' times (FLA's chunk_kda is timed in step fla).
    timeout 240 .device/bin/gpu_bench --kda > "$OUT/kda_bench.md" 2>&1 || echo "gpu_bench --kda failed" >&2
  else
    echo "kimi tests: skipped"
  fi
  grep -E "FAIL|test result|panicked|greedy" "$OUT/kimi_tests.log" 2>/dev/null | tail -80

  echo "== MoE prefill: grouped expert GEMMs vs per-expert cuBLAS and torch._grouped_mm (gpu_bench --moe-grouped)"
  t0=$SECONDS
  if want moebench; then
    timeout 240 .device/bin/gpu_bench --moe-grouped > "$OUT/moe_bench.md" 2>&1
    moebench_rc=$?
    echo "moebench rc=$moebench_rc in $((SECONDS - t0)) s"
    cat "$OUT/moe_bench.md"
    # The same-run anchor: torch._grouped_mm replayed from a CUDA graph (kernel time).
    timeout 180 python3 tools/bench_grouped_mm.py --json "$OUT/grouped_mm.json" > "$OUT/grouped_mm.md" 2>&1 \
      || echo "torch._grouped_mm anchor failed (rc=$?)"
    cat "$OUT/grouped_mm.md"
  else
    echo "moebench: skipped"
  fi

  echo "== our benchmark"
  t0=$SECONDS
  local bench_rc=0
  if want bench; then
    timeout 240 .device/bin/gpu_bench ${BENCH_ARGS:-} > "$OUT/bench.md" 2>&1
    bench_rc=$?
    echo "bench rc=$bench_rc in $((SECONDS - t0)) s"
  else
    echo "bench: skipped"
  fi

  echo "== random-weight model (GPU vs CPU) and whole-model benchmark at the Qwen3.5-35B-A3B shape"
  t0=$SECONDS
  local random_rc=0 mbench_rc=0 rc_=0
  if want modelbench; then
    HYPIC_CUDA_POISON=${HYPIC_CUDA_POISON:-1} HYPIC_REPO_ROOT="$PWD" timeout 120 .device/bin/cuda_random --test-threads=1 --nocapture \
      > "$OUT/random_tests.log" 2>&1
    random_rc=$?
    # MODEL_BENCH_FULL=0: only the decode-graph tables below.
    : > "$OUT/model_bench.md"
    if [ "${MODEL_BENCH_FULL:-1}" != 0 ]; then
      timeout 240 .device/bin/gpu_model_bench --config benches/configs/qwen3_5_35b_a3b --random-weights \
        --dtype bf16 --seed 0 ${MODEL_BENCH_ARGS:-} > "$OUT/model_bench.md" 2>&1
      mbench_rc=$?
      echo "(gpu_model_bench rc=$mbench_rc)" >> "$OUT/model_bench.md"
    fi
    # Decode step at batch 1 / 8 / 64: CUDA graphs against eager, with the weight-read floor.
    timeout 240 .device/bin/gpu_model_bench --config benches/configs/qwen3_5_35b_a3b --random-weights \
      --dtype bf16 --seed 0 --decode-graphs ${DECODE_GRAPH_ARGS:-} >> "$OUT/model_bench.md" 2>&1
    rc_=$?
    echo "(gpu_model_bench --decode-graphs rc=$rc_)" >> "$OUT/model_bench.md"
    [ "$mbench_rc" -eq 0 ] && mbench_rc=$rc_
    # The same table with the attention layers sequence by sequence
    # (HYPIC_CUDA_ATTN_ROWS=0), then with the GDN layers so too (HYPIC_CUDA_GDN_ROWS=0):
    # the same-run baselines of the batched decode kernels. MODEL_BENCH_GDN_AB=0 skips both.
    if [ "${MODEL_BENCH_GDN_AB:-1}" != 0 ]; then
      echo -e "\n### Baseline: attention layers sequence by sequence (HYPIC_CUDA_ATTN_ROWS=0)\n" >> "$OUT/model_bench.md"
      HYPIC_CUDA_ATTN_ROWS=0 timeout 240 .device/bin/gpu_model_bench --config benches/configs/qwen3_5_35b_a3b \
        --random-weights --dtype bf16 --seed 0 --decode-graphs ${DECODE_GRAPH_ARGS:-} >> "$OUT/model_bench.md" 2>&1
      echo "(gpu_model_bench --decode-graphs, HYPIC_CUDA_ATTN_ROWS=0, rc=$?)" >> "$OUT/model_bench.md"
      echo -e "\n### Baseline: attention and GDN layers sequence by sequence (HYPIC_CUDA_ATTN_ROWS=0 HYPIC_CUDA_GDN_ROWS=0)\n" >> "$OUT/model_bench.md"
      HYPIC_CUDA_ATTN_ROWS=0 HYPIC_CUDA_GDN_ROWS=0 timeout 240 .device/bin/gpu_model_bench \
        --config benches/configs/qwen3_5_35b_a3b --random-weights --dtype bf16 --seed 0 --decode-graphs \
        ${DECODE_GRAPH_ARGS:-} >> "$OUT/model_bench.md" 2>&1
      echo "(gpu_model_bench --decode-graphs, both per sequence, rc=$?)" >> "$OUT/model_bench.md"
    fi
  fi
  want modelbench && echo "random tests rc=$random_rc, model bench rc=$mbench_rc in $((SECONDS - t0)) s" \
    || echo "random-weight tests and model bench: skipped"
  grep -E "rel |test result|panicked|FAIL" "$OUT/random_tests.log" | tail -20
  cat "$OUT/model_bench.md"

  echo "== whole-model benchmark at the Ring-mini / Kimi-Linear-48B / Ring-flash shapes (gpu_model_bench, random weights)"
  # TTFT full / prefix cache / hypic, decode, per-layer-kind split, one config at a time
  # (FAMILY_BENCH_CONFIGS), bf16 by default (FAMILY_BENCH_DTYPE), cut to the largest
  # layer cut that fits. Each run ≤ FAMILY_BENCH_TIMEOUT (175) s; the
  # rows printed before a timeout are kept.
  t0=$SECONDS
  local fbench_rc=0 cfg_ rc_f
  if want familybench; then
    for cfg_ in ${FAMILY_BENCH_CONFIGS:-ring_mini_linear_2_0 kimi_linear_48b_a3b ring_flash_linear_2_0}; do
      timeout "${FAMILY_BENCH_TIMEOUT:-175}" .device/bin/gpu_model_bench --config "benches/configs/$cfg_" \
        --random-weights --dtype "${FAMILY_BENCH_DTYPE:-bf16}" --seed 0 \
        ${FAMILY_BENCH_ARGS---quick} > "$OUT/family_$cfg_.md" 2>&1
      rc_f=$?
      {
        echo "## $cfg_"; echo
        cat "$OUT/family_$cfg_.md"
        echo; echo "(gpu_model_bench $cfg_ rc=$rc_f$([ "$rc_f" -eq 124 ] && echo ", timed out"))"; echo
      } >> "$OUT/family_model_bench.md"
      # A timeout keeps the rows printed so far (reported above), not a failure.
      [ "$rc_f" -ne 0 ] && [ "$rc_f" -ne 124 ] && fbench_rc=$rc_f
      echo "familybench $cfg_ rc=$rc_f in $((SECONDS - t0)) s"
    done
    cat "$OUT/family_model_bench.md"
  else
    echo "familybench: skipped"
  fi

  echo "== FLA 0.6.0 and torch SDPA"
  t0=$SECONDS
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 && export PYTHONPATH=/tmp/site
  fi
  want fla && PYTHONUNBUFFERED=1 timeout "${FLA_TIMEOUT:-540}" python3 - > "$OUT/fla.md" 2>&1 <<'PY'
import math, torch, torch.nn.functional as F
from triton.testing import do_bench
print("## Public kernels (same run)\n")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
dev = "cuda"


def graph_ms(f, warmup=20, rep=100):
    """Median ms of `f` replayed from a CUDA graph (kernel time, not the eager
    launch overhead); `f` has run eagerly before (Triton autotuning done)."""
    s_ = torch.cuda.Stream()
    s_.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s_):
        f()
    torch.cuda.current_stream().wait_stream(s_)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f()
    ms = do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    del graph
    return ms


def both(f):
    """(eager ms, graph-replay ms or the capture error) of `f`."""
    f(); torch.cuda.synchronize()
    eager = do_bench(f, warmup=50, rep=300, return_mode="median")
    try:
        g = f"{graph_ms(f):.3f}"
    except Exception as e:
        # One table cell: no newline or pipe from the message may break the row.
        msg = " ".join(str(e).split()).replace("|", "/")[:80]
        g = f"– ({type(e).__name__}: {msg})"
    torch.cuda.synchronize()
    return eager, g


try:
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    print(f"fla {getattr(fla, '__version__', '?')}\n")
    print("| T | FLA chunk_gated_delta_rule ms | FLA chunk_gated_delta_rule graph replay ms |")
    print("|---|---|---|")
    H, HV, K, V = 16, 32, 128, 128
    for T in (1024, 4096, 16384, 32768):
        torch.manual_seed(0)
        q = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).mul(K ** -0.5).bfloat16()
        k = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
        v = torch.rand(1, T, HV, V, device=dev).mul(2).sub(1).bfloat16()
        g = -torch.rand(1, T, HV, device=dev) * 0.1
        beta = torch.rand(1, T, HV, device=dev).clamp_min(0.01)
        h0 = torch.rand(1, HV, K, V, device=dev).mul(2).sub(1)
        f = lambda: chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, initial_state=h0,
                                           output_final_state=True, use_qk_l2norm_in_kernel=False)
        ms, gms = both(f)
        print(f"| {T} | {ms:.3f} | {gms} |")
except Exception as e:
    print(f"FLA failed: {type(e).__name__}: {e}")
try:
    # Lightning attention (Ring-linear; our kernel: gpu_bench --lightning) as FLA runs
    # it: chunk_simple_gla with a per-head data-independent log decay g_gamma = −slope_h
    # (ALiBi slopes of 16 heads; fla.ops.lightning_attn scales them by a per-layer
    # factor), bf16 q/k/v, fp32 initial state, final state out.
    from fla.ops.simple_gla import chunk_simple_gla
    H, K = 16, 128
    start = 2.0 ** (-(2.0 ** -(math.log2(H) - 3)))
    slopes = [start ** (i + 1) for i in range(H)]
    g_gamma = -torch.tensor(slopes, device=dev, dtype=torch.float32)
    print("\n| T | FLA chunk_simple_gla (16 heads × 128, per-head g_gamma = −ALiBi slope, bf16 q/k/v), graph replay ms | eager ms |")
    print("|---|---|---|")
    for T in (1024, 4096, 16384, 32768):
        torch.manual_seed(0)
        q = torch.rand(1, T, H, K, device=dev).mul(0.2).sub(0.1).bfloat16()
        k = torch.rand(1, T, H, K, device=dev).mul(0.2).sub(0.1).bfloat16()
        v = torch.rand(1, T, H, K, device=dev).mul(2).sub(1).bfloat16()
        h0 = torch.rand(1, H, K, K, device=dev).mul(2).sub(1)
        f = lambda: chunk_simple_gla(q, k, v, g_gamma=g_gamma, scale=K ** -0.5,
                                     initial_state=h0, output_final_state=True)
        ms, gms = both(f)
        print(f"| {T} | {gms} | {ms:.3f} |")
except Exception as e:
    print(f"FLA chunk_simple_gla failed: {type(e).__name__}: {e}")
print("\n| T | torch SDPA (16 q / 2 kv × 256, causal, bf16) ms |")
print("|---|---|")
sdpa_in = {}
for T in (4096, 16384):
    q = torch.randn(1, 16, T, 256, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 2, T, 256, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, 2, T, 256, device=dev, dtype=torch.bfloat16)
    sdpa_in[T] = (q, k, v)
    f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    f(); torch.cuda.synchronize()
    print(f"| {T} | {do_bench(f, warmup=25, rep=200, return_mode='median'):.3f} |")
# The same call pinned to each SDPA backend (the default above is torch's own choice).
print("\n| T | SDPA backend | ms |")
print("|---|---|---|")
from torch.nn.attention import sdpa_kernel, SDPBackend
for T, (q, k, v) in sdpa_in.items():
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                f(); torch.cuda.synchronize()
                ms = do_bench(f, warmup=25, rep=200, return_mode='median')
            print(f"| {T} | {name} | {ms:.3f} |")
        except Exception as e:
            print(f"| {T} | {name} | not available: {type(e).__name__} |")
try:
    # Kimi Delta Attention (our kernel: gpu_bench --kda), timed replayed from a CUDA
    # graph (kernel time, not the eager launch overhead), and eagerly. Last: its
    # Triton autotune takes minutes, and a timeout here loses nothing else (rows are
    # printed as they come).
    from fla.ops.kda import chunk_kda
    print("\n| T | FLA chunk_kda (32 heads × 128, bf16 q/k/v), graph replay ms | eager ms |")
    print("|---|---|---|")
    H, K = 32, 128
    for T in (1024, 4096, 16384, 32768):
        torch.manual_seed(0)
        q = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).mul(K ** -0.5).bfloat16()
        k = F.normalize(torch.randn(1, T, H, K, device=dev), dim=-1).bfloat16()
        v = torch.rand(1, T, H, K, device=dev).mul(2).sub(1).bfloat16()
        g = -torch.rand(1, T, H, K, device=dev) * 0.1
        beta = torch.rand(1, T, H, device=dev).clamp_min(0.01)
        h0 = torch.rand(1, H, K, K, device=dev).mul(2).sub(1)
        f = lambda: chunk_kda(q, k, v, g, beta, scale=1.0, initial_state=h0,
                              output_final_state=True)
        ms, gms = both(f)
        print(f"| {T} | {gms} | {ms:.3f} |")
except Exception as e:
    print(f"FLA chunk_kda failed: {type(e).__name__}: {e}")
PY
  local fla_rc=$?
  want fla && echo "fla rc=$fla_rc in $((SECONDS - t0)) s" || echo "fla: skipped"

  # Our flash attention against torch SDPA, both measured in this run (bench + fla steps).
  python3 - "$OUT/bench.md" "$OUT/fla.md" > "$OUT/flash_vs_sdpa.md" 2>&1 <<'PY'
import re, sys
def lines(p):
    try:
        return open(p).read().splitlines()
    except OSError:
        return []
names = {"flash": "attn::prefill_flash (FA-2, mma.sync)",
         "flash-wg": "attn::prefill_flash_wg, Basic (wgmma)",
         "flash-wg3tmal": "attn::prefill_flash_wg, WarpSpecializedTmaLean",
         "flash-wg3tmalb80": "attn::prefill_flash_wg, WarpSpecializedTmaLeanBc80",
         "cuBLAS": "attn::prefill_fast (cuBLAS)"}
times = {k: {} for k in names}
sdpa, sdpa_fa = {}, {}
sec = False
for l in lines(sys.argv[1]):
    if l.startswith("## "):
        sec = l.startswith("## Attention prefill")
    # Kernel column "flash (FA-2 ...)", "flash-wg (wgmma ...)", "flash-wg3tmal (...)",
    # "flash-wg3tmalb80 (...)", "cuBLAS ..."; "variant: ..." rows are skipped.
    m = re.match(r"\|\s*(\d+)\s*\|\s*(flash-wg3tmalb80|flash-wg3tmal|flash-wg|flash|cuBLAS)\b(?!-)[^|]*\|\s*([\d.]+)\s*\|", l) if sec else None
    if m:
        times[m.group(2)][int(m.group(1))] = float(m.group(3))
on = False
for l in lines(sys.argv[2]):
    if "torch SDPA" in l:
        on = True
        continue
    m = re.match(r"\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*$", l) if on else None
    if m:
        sdpa[int(m.group(1))] = float(m.group(2))
    m = re.match(r"\|\s*(\d+)\s*\|\s*FLASH_ATTENTION\s*\|\s*([\d.]+)\s*\|", l)
    if m:
        sdpa_fa[int(m.group(1))] = float(m.group(2))
print("## Flash attention vs torch SDPA (same run; bf16, 16 q / 2 kv heads × 256, causal)\n")
if not any(times.values()):
    print("no flash rows in bench.md (step `bench` not run, or it failed)\n")
if not sdpa:
    print("no torch SDPA times in fla.md (step `fla` not run, or torch missing)\n")
print("| T | kernel | ms | vs SDPA default backend (goal ≥ 0.90) | vs SDPA pinned to FLASH_ATTENTION |")
print("|---|---|---|---|---|")
r = lambda ms, t, ref: f"{ref[t] / ms:.2f}×" if t in ref and ms > 0 else "–"
for t in sorted(set(sdpa) | {t for d in times.values() for t in d}):
    print(f"| {t} | torch SDPA, default backend | {sdpa[t]:.3f} | 1× | – |" if t in sdpa else f"| {t} | torch SDPA | – | – | – |")
    if t in sdpa_fa:
        print(f"| {t} | torch SDPA, FLASH_ATTENTION | {sdpa_fa[t]:.3f} | {r(sdpa_fa[t], t, sdpa)} | 1× |")
    for k, name in names.items():
        if t in times[k]:
            ms = times[k][t]
            print(f"| {t} | {name} | {ms:.3f} | {r(ms, t, sdpa)} | {r(ms, t, sdpa_fa)} |")
PY
  cat "$OUT/flash_vs_sdpa.md"
  # Our GDR prefill (bench step) against FLA (fla step) from this run, as in the reports.
  : > "$OUT/gdr_vs_fla.md"
  if want bench && want fla; then
    python3 - "$OUT" > "$OUT/gdr_vs_fla.md" 2>&1 <<'PY'
import re, sys
out = sys.argv[1]
bench = open(f"{out}/bench.md").read().splitlines()
fla = open(f"{out}/fla.md").read().splitlines()
ours, stages, flams, flag = {}, {}, {}, {}
sec = None
for l in bench:
    if l.startswith("## "):
        sec = "gdr" if l.startswith("## Gated delta rule chunked prefill") else None
        continue
    if sec != "gdr":
        continue
    m = re.match(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| [+-]?[\d.]+ % \|", l)
    if m:
        ours[int(m[1])] = (float(m[2]), float(m[3]))
        continue
    m = re.match(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| [\d.]+ \|$", l)
    if m and int(m[1]) not in stages:
        stages[int(m[1])] = (float(m[2]), float(m[3]), float(m[4]))
on = False
for l in fla:
    if "FLA chunk_gated_delta_rule ms" in l:
        on = True
        continue
    if on:
        m = re.match(r"^\| (\d+) \| ([\d.]+) \|(?: ([\d.]+)[^|]*\|| [^|]*\|)?$", l)
        if m:
            flams[int(m[1])] = float(m[2])
            if m[3]:
                flag[int(m[1])] = float(m[3])
        elif l.strip() and not l.startswith("|---"):
            break
goal = {1024: "≥ 2×", 4096: "≥ 2×", 32768: "≥ 1×"}
print("## Gated delta rule prefill vs FLA (same run; H 16, HV 32, dk = dv = 128, bf16)\n")
print("| T | ours ms | + T_C ms | FLA `chunk_gated_delta_rule` ms | ours vs FLA | goal | A / B / C ms | FLA graph replay ms | ours vs FLA graph |")
print("|---|---|---|---|---|---|---|---|---|")
for t in sorted(ours):
    o, ot = ours[t]
    f = flams.get(t)
    ratio = f"{f / o:.2f}×" if f else "-"
    st = " / ".join(f"{x:.3f}" for x in stages[t]) if t in stages else "-"
    fg = flag.get(t)
    gr = f"{fg / o:.2f}×" if fg else "-"
    print(f"| {t} | {o:.3f} | {ot:.3f} ({100 * (ot / o - 1):+.1f} %) | {f if f else '-'} | {ratio} | {goal.get(t, '—')} | {st} | {fg if fg else '-'} | {gr} |")
if not ours:
    print("(no GDR rows in bench.md)")
if not flams:
    print("(no FLA rows in fla.md)")
PY
    echo "== GDR prefill vs FLA (same run)"
    cat "$OUT/gdr_vs_fla.md"
  fi
  # Our Lightning (families step) and KDA (kimi step) prefill kernels against FLA's
  # chunk_simple_gla and chunk_kda (fla step), all from this run (issue 19's goal:
  # FLA graph replay / ours ≥ 1.2× at every length).
  if want fla; then
    python3 - "$OUT" > "$OUT/fla_vs_ours.md" 2>&1 <<'PY'
import re, sys
out = sys.argv[1]
def lines(name):
    try:
        return open(f"{out}/{name}").read().splitlines()
    except OSError:
        return []
def section(ls, start):
    """Rows `| T | ... |` (cells as strings) of the table under the first line that
    contains `start`, up to the first line that is neither a row nor blank."""
    rows, on = {}, False
    for l in ls:
        if not on:
            on = start in l
            continue
        if l.startswith("|---"):
            continue
        m = re.match(r"^\|\s*(\d+)\s*\|(.*)\|\s*$", l)
        if m:
            rows[int(m[1])] = [c.strip() for c in m[2].split("|")]
        elif rows or (l.strip() and not l.startswith("|")):
            break
    return rows
def num(x):
    m = re.match(r"^([\d.]+)$", x or "")
    return float(m[1]) if m else None
# Our tables: lightning_bench.md `| T | chunked | two-pass | state-only | per-token |
# Mtok/s | span |` (ours = span, the kernel the layer takes; else the faster of the
# two chunked forms); kda_bench.md `| T | prefill | tc | prefill + T_C | per-token |`
# (no `tc` column in older reports).
lt_ours, lt_two = {}, {}
lt_tc = False
for t, c in section(lines("lightning_bench.md"), "## Lightning attention prefill").items():
    # The tensor-core column (bf16, what a bf16 model takes) when present, else span.
    tc = num(c[6]) if len(c) > 6 else None
    span = num(c[5]) if len(c) > 5 else None
    chunked = [x for x in (num(c[0]), num(c[1]) if len(c) > 1 else None) if x is not None]
    lt_ours[t] = tc if tc is not None else (span if span is not None else (min(chunked) if chunked else None))
    lt_tc = lt_tc or tc is not None
    # The two-pass tensor-core form (`tensor-core two-pass ms`, column 11 after T) when present.
    if len(c) > 10 and num(c[10]) is not None:
        lt_two[t] = num(c[10])
def header(ls, start):
    """Header cells after `T` of the table under the first line that contains `start`."""
    on = False
    for l in ls:
        if not on:
            on = start in l
        elif l.startswith("| T |"):
            return [c.strip() for c in l.strip().strip("|").split("|")][1:]
    return []
# KDA: the tensor-core column `tc ms` (kda::chunked_tc, what a bf16 layer takes) when
# the table has it, else `prefill ms` (the SIMT kernel).
kda_head = header(lines("kda_bench.md"), "## KDA chunked prefill")
kda_tc = "tc ms" in kda_head
kda_col = kda_head.index("tc ms") if kda_tc else 0
kda_ours = {t: num(c[kda_col]) if len(c) > kda_col else None
            for t, c in section(lines("kda_bench.md"), "## KDA chunked prefill").items()}
fla = lines("fla.md")
# fla.md: `| T | graph replay ms | eager ms |` under each kernel's header.
lt_fla = section(fla, "FLA chunk_simple_gla (16")
kda_fla = section(fla, "FLA chunk_kda (32")
lt_dtype = next((l for l in lines("lightning_bench.md") if l.startswith("## Lightning")), "")
lt_dtype = ("bf16 q/k/v/o on tensor cores (lightning::chunked_tc)" if lt_tc
            else "fp32 q/k/v" if "fp32 q/k/v" in lt_dtype else "dtype as in lightning_bench.md")
# FLA on the H200, 2026-12-01, graph replay (issue 19; another run, for scale only).
ref = {"lt": {1024: 0.021, 4096: 0.072, 16384: 0.252, 32768: 0.484},
       "kda": {1024: 0.154, 4096: 0.513, 16384: 1.976, 32768: 3.940}}
def table(title, ours, fl, key, src_ours, src_fla):
    print(f"## {title}\n")
    if not ours:
        print(f"(no rows of ours: {src_ours} missing or empty; its step not run, or it failed)\n")
    if not fl:
        print(f"(no FLA rows: {src_fla} missing in fla.md; step `fla` not run, or FLA failed)\n")
    print("| T | ours ms | FLA graph ms | FLA eager ms | FLA graph / ours (goal ≥ 1.2×) | FLA eager / ours | FLA graph ms, issue 19's H200 run (other run) |")
    print("|---|---|---|---|---|---|---|")
    for t in sorted(set(ours) | set(fl)):
        o = ours.get(t)
        c = fl.get(t, [])
        g = num(c[0]) if len(c) > 0 else None
        e = num(c[1]) if len(c) > 1 else None
        f = lambda x: f"{x:.3f}" if x is not None else "–"
        r = lambda x: f"{x / o:.2f}×" if x is not None and o else "–"
        gcell = f(g) if g is not None else (c[0] if c else "–")
        print(f"| {t} | {f(o)} | {gcell} | {f(e)} | {r(g)} | {r(e)} | {f(ref[key].get(t))} |")
    print()
table(f"Lightning prefill vs FLA chunk_simple_gla (same run; 16 heads × 128, per-head g_gamma; ours {lt_dtype}, FLA bf16 q/k/v)",
      lt_ours, lt_fla, "lt", "lightning_bench.md (step families)", "chunk_simple_gla")
if lt_two:
    table("Lightning prefill, two-pass tensor-core form (TcForm::TwoPass), vs FLA chunk_simple_gla (same run, as above)",
          lt_two, lt_fla, "lt", "lightning_bench.md (step families)", "chunk_simple_gla")
table("KDA prefill vs FLA chunk_kda (same run; 32 heads × 128; ours bf16 q/k/v, fp32 state"
      + (", tensor cores" if kda_tc else ", SIMT") + "; FLA bf16 q/k/v)",
      kda_ours, kda_fla, "kda", "kda_bench.md (step kimi)", "chunk_kda")
print("ours = lightning_bench.md's `tensor-core bf16` column (lightning::chunked_tc, what a bf16 model's layer takes; the fp32 `span` column in older reports) and kda_bench.md's `tc` column (kda::chunked_tc, the tensor-core kernels a bf16 layer takes; the SIMT `prefill` column in older reports; no transition T_C), CUDA-event medians; FLA graph = the call replayed from a CUDA graph (triton do_bench median), FLA eager = the same call launched from Python.")
PY
    echo "== Lightning / KDA prefill vs FLA (same run)"
    cat "$OUT/fla_vs_ours.md"
  fi
  echo "== server end to end: hypic serve --device cuda vs --device cpu (scripts/serve_check.py)"
  t0=$SECONDS
  local serve_rc=0
  : > "$OUT/serve.md"
  if want serve; then
    timeout 540 python3 scripts/serve_check.py --hypic .device/bin/hypic --model models/hypic-tiny \
      --out "$OUT" > "$OUT/serve_check.log" 2>&1
    serve_rc=$?
    [ -s "$OUT/serve.md" ] || echo "serve check wrote no report (rc=$serve_rc); see serve_check.log" > "$OUT/serve.md"
    cat "$OUT/serve.md"
    tail -20 "$OUT/serve_check.log" | grep -A20 "^failures:" || true
    echo "serve rc=$serve_rc in $((SECONDS - t0)) s"
  else
    echo "serve: skipped"
  fi

  echo "== segment parallelism: two GPU workers and a combiner on the one GPU (scripts/parallel_check.py)"
  t0=$SECONDS
  local parallel_rc=0
  : > "$OUT/parallel.md"
  if want parallel; then
    local dt_
    for dt_ in ${PARALLEL_DTYPES:-f32 bf16}; do
      mkdir -p "$OUT/parallel-$dt_"
      timeout 300 python3 scripts/parallel_check.py --hypic .device/bin/hypic --model models/hypic-tiny \
        --device cuda --dtype "$dt_" --out "$OUT/parallel-$dt_" > "$OUT/parallel_check_$dt_.log" 2>&1 \
        || parallel_rc=$?
      cat "$OUT/parallel-$dt_/parallel.md" >> "$OUT/parallel.md" 2>/dev/null \
        || echo "parallel check ($dt_) wrote no report; see parallel_check_$dt_.log" >> "$OUT/parallel.md"
    done
    cat "$OUT/parallel.md"
    echo "parallel rc=$parallel_rc in $((SECONDS - t0)) s"
  else
    echo "parallel: skipped"
  fi

  echo "== GPUs of one process: peer transport (dataplane/tests/cuda_parallel.rs, parallel_check.py --devices 0,0)"
  t0=$SECONDS
  local devices_rc=0
  : > "$OUT/devices.md"; : > "$OUT/devices_tests.log"
  if want devices; then
    local list_dev="" dt_
    list_dev=$(.device/bin/cuda_parallel --list --format=terse 2>/dev/null | sed -n 's/: test$//p')
    if [ -z "$list_dev" ]; then
      echo "cuda_parallel lists no tests" | tee -a "$OUT/devices_tests.log" >&2
      devices_rc=1
    fi
    for name in $list_dev; do
      HYPIC_CUDA_POISON=${HYPIC_CUDA_POISON:-1} HYPIC_REPO_ROOT="$PWD" timeout 300 .device/bin/cuda_parallel --exact "$name" \
        --test-threads=1 --nocapture >> "$OUT/devices_tests.log" 2>&1
      rc=$?
      # A test that could not run (one GPU where it needs two) is a skip, not a pass.
      if [ "$rc" -eq 0 ] && grep -q "${name##*::}: skipped" "$OUT/devices_tests.log"; then
        echo "cuda_parallel $name SKIPPED" >> "$OUT/devices_tests.log"
      else
        echo "cuda_parallel $name rc=$rc" >> "$OUT/devices_tests.log"
      fi
      [ "$rc" -ne 0 ] && devices_rc=$rc
    done
    {
      echo "### dataplane/tests/cuda_parallel.rs"; echo; echo '```'
      grep -E "^  |FAIL|panicked|^cuda_parallel " "$OUT/devices_tests.log"
      echo '```'; echo
    } >> "$OUT/devices.md"
    for dt_ in ${PARALLEL_DTYPES:-f32 bf16}; do
      mkdir -p "$OUT/devices-$dt_"
      timeout 300 python3 scripts/parallel_check.py --hypic .device/bin/hypic --model models/hypic-tiny \
        --devices "${DEVICES_LIST:-0,0}" --dtype "$dt_" --out "$OUT/devices-$dt_" > "$OUT/devices_check_$dt_.log" 2>&1 \
        || devices_rc=$?
      cat "$OUT/devices-$dt_/parallel.md" >> "$OUT/devices.md" 2>/dev/null \
        || echo "devices check ($dt_) wrote no report; see devices_check_$dt_.log" >> "$OUT/devices.md"
    done
    cat "$OUT/devices.md"
    echo "devices rc=$devices_rc in $((SECONDS - t0)) s"
  else
    echo "devices: skipped"
  fi

  echo "== checkpoint streaming at the Qwen3.5-35B-A3B shape (scripts/load_check.py)"
  t0=$SECONDS
  local load_rc=0
  : > "$OUT/load35b.md"
  if want load35b; then
    timeout 580 python3 scripts/load_check.py --hypic .device/bin/hypic --out "$OUT" \
      --layers "${LOAD35B_LAYERS:-auto}" > "$OUT/load_check.log" 2>&1
    load_rc=$?
    [ -s "$OUT/load35b.md" ] || echo "load check wrote no report (rc=$load_rc); see load_check.log" > "$OUT/load35b.md"
    cat "$OUT/load35b.md"
    echo "load35b rc=$load_rc in $((SECONDS - t0)) s"
  else
    echo "load35b: skipped"
  fi

  {
    echo "# HYPIC CUDA data plane: gpu-check report ($date_s)"
    echo; echo '```'; cat "$OUT/machine.txt"; echo '```'
    echo; echo "## Equivalence tests (rc=$test_rc)"; echo; echo '```'
    grep -E "rel .*tol|^test |test result|panicked" "$OUT/tests.log"
    echo '```'
    echo; echo "## Attention fast path tests (tests/cuda_attn.rs, rc=$attn_rc)"; echo; echo '```'
    grep -E "rel .*tol|zeros|FAIL|SKIP|^test |test result|panicked|: (Err|Ok)" "$OUT/attn_tests.log"
    echo '```'
    echo; echo "## MoE / SwiGLU / sampling tests (rc=$moe_rc)"; echo; echo '```'
    grep -E "^-- |rel .*tol|routing|χ²|argmax|equal|outside|FAIL|skipped|^test |test result|panicked|workspace|→" "$OUT/tests_moe.log"
    echo '```'
    echo; echo "## Whole-model GPU vs CPU (rc=$model_rc)"; echo; echo '```'
    grep -E "rel .*tol|^test |panicked|FAIL|greedy|  (cpu|gpu) |^cuda_model gpu::" "$OUT/model_tests.log"
    echo '```'
    echo; echo "Layer and state breakdowns: model_tests.log"
    if want decode; then
      echo; echo "## Decode step: device sampling (tests/cuda_decode.rs, rc=$decode_rc)"; echo; echo '```'
      grep -E "^  |FAIL|panicked|^test |test result" "$OUT/decode_tests.log"
      echo '```'
      echo; echo "## Decode step: CUDA graphs against eager (tests/cuda_graph.rs)"; echo; echo '```'
      grep -E "^  |FAIL|panicked|^test |test result|skipped" "$OUT/graph_tests.log" 2>/dev/null
      echo '```'
    fi
    if want families; then
      echo; echo "## Model families: Ring-linear-2.0 (tests/cuda_families.rs, rc=$families_rc)"; echo; echo '```'
      grep -E "^  |FAIL|panicked|^test |test result" "$OUT/families_tests.log"
      echo '```'
      cat "$OUT/lightning_bench.md" 2>/dev/null
    fi
    if want kimi; then
      echo; echo "## Model families: Kimi-Linear (tests/cuda_kimi.rs, rc=$kimi_rc)"; echo; echo '```'
      grep -E "^  |FAIL|panicked|^test |test result" "$OUT/kimi_tests.log"
      echo '```'
      cat "$OUT/kda_bench.md" 2>/dev/null
    fi
    if want moebench; then
      echo; echo "(moebench rc=$moebench_rc)"; echo; cat "$OUT/moe_bench.md"
    fi
    echo; echo "## PIC engine GPU vs CPU (rc=$pic_rc)"; echo; echo '```'
    grep -E "^  |^-- |FAIL|panicked|^test |^cuda_pic gpu::" "$OUT/pic_tests.log"
    echo '```'
    echo; cat "$OUT/bench.md"
    echo; cat "$OUT/fla.md"
    echo; cat "$OUT/flash_vs_sdpa.md"
    echo; cat "$OUT/gdr_vs_fla.md"
    if want modelbench; then
      echo; echo "## Random-weight model, GPU vs CPU (tests/cuda_random.rs, rc=$random_rc)"; echo; echo '```'
      grep -E "rel |params|refusal|^test |test result|panicked" "$OUT/random_tests.log"
      echo '```'
      echo; cat "$OUT/model_bench.md"
    fi
    if want familybench; then
      echo; echo "## Whole model at the Ring / Kimi shapes (gpu_model_bench, rc=$fbench_rc)"; echo
      cat "$OUT/family_model_bench.md"
    fi
    if want fla; then
      echo; cat "$OUT/fla_vs_ours.md"
    fi
    if want serve; then
      echo; echo "## Server end to end (rc=$serve_rc)"; echo
      cat "$OUT/serve.md"
    fi
    if want parallel; then
      echo; echo "## Segment parallelism on one GPU (rc=$parallel_rc)"; echo
      cat "$OUT/parallel.md"
    fi
    if want devices; then
      echo; echo "## GPUs of one process, peer transport (rc=$devices_rc)"; echo
      cat "$OUT/devices.md"
    fi
    if want load35b; then
      echo; echo "## Checkpoint streaming (rc=$load_rc)"; echo
      cat "$OUT/load35b.md"
    fi
  } > "$OUT/report.md"
  # The figure of the run's comparisons (kernels vs FLA / SDPA, TTFT, decode), where the
  # machine's Python has matplotlib; not fatal.
  python3 tools/plot_gpu_report.py "$OUT" --title "gpu-check $date_s" 2>&1 | tail -1 || true
  echo "== report"; sed -n '/## Gated delta rule/,$p' "$OUT/report.md" | head -80
  [ "$test_rc" -ne 0 ] && return "$test_rc"
  [ "$attn_rc" -ne 0 ] && return "$attn_rc"
  [ "$moe_rc" -ne 0 ] && return "$moe_rc"
  [ "$random_rc" -ne 0 ] && return "$random_rc"
  [ "$model_rc" -ne 0 ] && return "$model_rc"
  [ "$pic_rc" -ne 0 ] && return "$pic_rc"
  [ "$decode_rc" -ne 0 ] && return "$decode_rc"
  [ "$families_rc" -ne 0 ] && return "$families_rc"
  [ "$kimi_rc" -ne 0 ] && return "$kimi_rc"
  [ "$moebench_rc" -ne 0 ] && return "$moebench_rc"
  [ "$bench_rc" -ne 0 ] && return "$bench_rc"
  [ "$mbench_rc" -ne 0 ] && return "$mbench_rc"
  [ "$fbench_rc" -ne 0 ] && return "$fbench_rc"
  want fla && [ "$fla_rc" -ne 0 ] && return "$fla_rc"
  [ "$serve_rc" -ne 0 ] && return "$serve_rc"
  [ "$parallel_rc" -ne 0 ] && return "$parallel_rc"
  [ "$devices_rc" -ne 0 ] && return "$devices_rc"
  [ "$load_rc" -ne 0 ] && return "$load_rc"
  return 0
}

case "$mode" in
  build) build ;;
  run) run ;;
  *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
