#!/usr/bin/env bash
# NIXL entry payloads (dataplane::parallel::nixl) with the real library: a worker
# and a combiner agent in one process READ entries over UCX (DRAM to DRAM) and must
# get the bytes TCP ships, verified by their checksums. The libraries come from
# scripts/nixl_libs.sh (.device/nixl/).
#
#   scripts/nixl_check.sh local   # here: cargo test --features nixl with the libraries
#   scripts/nixl_check.sh build   # here: the test binary, stripped and xz'd, into
#                                 # .device/bin/nixl_tests.xz (and .device/nixl/ when absent)
#   scripts/nixl_check.sh run     # on the GPU machine, through the device tool:
#                                 #   run(command="scripts/nixl_check.sh run",
#                                 #       carry=[".device/nixl", ".device/bin/nixl_tests.xz"])
#
# `run` and `local` fail (never pass) when libnixl_capi.so cannot be loaded; they
# print what the loader is missing. Output: $OUT/nixl.log when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
test_filter="parallel::nixl::"

libs() {
  [ -d .device/nixl/lib ] || scripts/nixl_libs.sh || return 1
  # shellcheck disable=SC1091
  . .device/nixl/env.sh
  local f missing=0
  for f in .device/nixl/lib/libnixl_capi.so .device/nixl/lib/plugins/libplugin_UCX.so; do
    if ldd "$f" | grep 'not found'; then
      echo "nixl_check: $f has unresolved dependencies (above)" >&2
      missing=1
    fi
  done
  return $missing
}

case "$mode" in
  local)
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
    libs || exit 1
    cargo test -p hypic-dataplane --features nixl --lib "$test_filter" -- --include-ignored --nocapture
    ;;
  build)
    set -e
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
    [ -d .device/nixl/lib ] || scripts/nixl_libs.sh
    exe=$(cargo test -p hypic-dataplane --features nixl --lib --no-run --message-format=json \
          2>"$CARGO_TARGET_DIR/nixl-check-build.log" \
          | grep -o '"executable":"[^"]*dataplane-[^"]*"' | tail -1 \
          | sed 's/"executable":"\(.*\)"/\1/')
    [ -n "$exe" ] || { tail -40 "$CARGO_TARGET_DIR/nixl-check-build.log" >&2; exit 1; }
    mkdir -p .device/bin
    cp "$exe" .device/bin/nixl_tests
    strip .device/bin/nixl_tests || true
    rm -f .device/bin/nixl_tests.xz
    xz -T0 -6 .device/bin/nixl_tests
    ls -l .device/bin/nixl_tests.xz
    du -sh --apparent-size .device/nixl .device/bin/nixl_tests.xz
    ;;
  run)
    log="${OUT:-/tmp}/nixl.log"
    {
      [ -f .device/bin/nixl_tests.xz ] && xz -d -f -k .device/bin/nixl_tests.xz
      [ -x .device/bin/nixl_tests ] || chmod +x .device/bin/nixl_tests 2>/dev/null
      [ -f .device/bin/nixl_tests ] || { echo "nixl_check: no .device/bin/nixl_tests: run \`scripts/nixl_check.sh build\` here first"; exit 3; }
      export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
      libs || echo "nixl_check: continuing; the test will say what fails"
      nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 | tail -1
      ldd .device/nixl/nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0 | grep -E "cuda|nvidia-ml"
      .device/bin/nixl_tests --test-threads=1 --include-ignored --nocapture "$test_filter"
    } 2>&1 | tee "$log"
    exit "${PIPESTATUS[0]}"
    ;;
  *) echo "usage: $0 local|build|run" >&2; exit 2 ;;
esac
