#!/usr/bin/env bash
# Checks the flash-attention kernels (dataplane/kernels/flash.cu) on the CPU: the real
# kernel source, with its PTX primitives (the block between `<device-primitives>` markers)
# swapped for the emulations in emu.h, runs as one fiber per CUDA thread against a
# double-precision reference. Needs g++ (C++17). Usage:
#   tools/kernel-emu/run.sh [quick]          # cp.async copies land at wait_group
#   EMU_EAGER_CP=1 tools/kernel-emu/run.sh   # ... or as soon as they are issued
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kernels="$here/../../dataplane/kernels"
out="${EMU_OUT:-/tmp/hypic-kernel-emu}"
mkdir -p "$out"
python3 - "$kernels" "$out/gen_flash.inc" <<'PY'
import re, sys
k, dst = sys.argv[1], sys.argv[2]
common = open(f"{k}/common.cuh").read().replace("#include <cuda_bf16.h>", "")
flash = open(f"{k}/flash.cu").read()
flash, n = re.subn(r"// <device-primitives>.*?// </device-primitives>", "", flash, flags=re.S)
assert n == 1, "primitives block not found"
decl = "extern __shared__ __align__(16) unsigned char fa_smem[];"
assert decl in flash, "dynamic shared memory declaration not found"
flash = flash.replace(decl, "unsigned char* fa_smem = emu_dyn_smem;")
open(dst, "w").write(common + '\n#line 1 "flash.cu"\n' + flash)
PY
g++ -std=c++17 -O2 -Wall -Wno-unused-function -Wno-unused-variable -Wno-unknown-pragmas -I"$here" -I"$out" \
  -o "$out/flash_emu" "$here/flash_emu.cpp"
"$out/flash_emu" "$@"
