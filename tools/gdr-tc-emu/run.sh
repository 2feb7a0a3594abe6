#!/usr/bin/env bash
# Builds and runs the host emulation of kernels/gdr_tc.cu (g++ >= 12, C++20; no CUDA).
#   tools/gdr-tc-emu/run.sh                # six small cases (T 1..200, Hk/Hv 2/4 and 1/2)
#   tools/gdr-tc-emu/run.sh 1000 -1e-3 0   # one case: T, gate range [g_lo, g_hi]
# Every CUDA thread is an OS thread, so a case takes minutes on two cores.
# Runs gdr_prep_tc2_bf16, gdr_state_tc_bf16_32 and gdr_output_tc2_bf16 (the kernels of
# cuda::gdr). cp.async copies complete at issue here: a missing wait is not caught.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/gdr_tc_emu"
g++ -std=c++20 -O2 -pthread -I"$here" -I"$here/../../dataplane/kernels" "$here/gdr_tc_emu.cpp" -o "$out"
exec "$out" "$@"
