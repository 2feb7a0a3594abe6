#!/usr/bin/env bash
# Checks the flash-attention kernels on the CPU: the real kernel source, with its PTX
# primitives (the block between `<device-primitives>` markers) swapped for the emulations
# in emu.h (and emu_wg.h), runs as one fiber per CUDA thread against a double-precision
# reference. Needs g++ (C++17). Usage:
#   tools/kernel-emu/run.sh [quick]          # flash.cu; cp.async copies land at wait_group
#   EMU_EAGER_CP=1 tools/kernel-emu/run.sh   # ... or as soon as they are issued
#   tools/kernel-emu/run.sh wg [quick] [basic|wg3tmal|wg3tmalb80|all]
#                                            # flash_wg.cu: attn_flash_wg_* and the warp-specialised
#                                            # attn_flash_wg3tmal_* / attn_flash_wg3tmalb80_*
#                                            # (default all);
#                                            # EMU_SMEM_SHIFT=16 offsets the dynamic shared
#                                            # memory base (alignment code)
#   tools/kernel-emu/run.sh wg-mutants       # deliberately broken variants of flash_wg.cu must
#                                            # fail (swizzle, fragments, descriptors, fences on
#                                            # the basic kernel; on wg3tmal: wg3-*: mbarrier
#                                            # parities / waits / releases, proxy fence,
#                                            # ping-pong barriers, setmaxnreg; tma-*: expect_tx
#                                            # bytes, box coordinates / destinations, missing
#                                            # waits, barrier counts; lean-*: tile facts (index,
#                                            # stage slot, stage read), tile count, split m
#                                            # scale, exp2 FMA fold; on wg3tmalb80: leanb80-*,
#                                            # tmab80-*: 80-key tiles and boxes, incl. the host
#                                            # tensor map; a pair [old, new, "host"] edits
#                                            # flash_wg_emu.cpp)
#   EMU_MUTANTS="tma-box-row tma-stage" tools/kernel-emu/run.sh wg-mutants  # a subset
#   tools/kernel-emu/run.sh gdn-rows         # the batched decode kernels of the GDN layers
#                                            # (gdr_recurrent_rows_*, conv1d_update_rows_*)
#                                            # against the one-sequence kernels, bitwise
#   tools/kernel-emu/run.sh attn-rows        # the batched decode-attention kernels
#                                            # (kv_append_rows_*, attn_decode_rows_bf16_*,
#                                            # attn_decode_combine_rows_bf16) against the
#                                            # one-sequence kernels, bitwise (EMU_QUICK=1:
#                                            # without the 8.3k-key case)
#   tools/kernel-emu/run.sh attn-rows-mutants # deliberately broken variants of those kernels
#                                            # (offsets, table entries, split counts) must
#                                            # each fail attn-rows
#   tools/kernel-emu/run.sh lightning-tc     # lightning_tc.cu (the tensor-core chunked prefill,
#                                            # fused, split and two-pass forms) against the fp64
#                                            # recurrence (EMU_QUICK=1: the chunk and step edges only)
#   tools/kernel-emu/run.sh lightning        # lightning.cu (per-token, one- and two-pass
#                                            # chunked, prep, group norm + gate, state
#                                            # rotation, scalar apply) and moe_route_rule
#                                            # against the CPU references
#   tools/kernel-emu/run.sh kda-tc           # kda_tc.cu (tensor-core KDA prefill: prep, state,
#                                            # output) against an fp64 recurrence, T = 1..300
#                                            # (chunk edges) and 1000, strong decays (EMU_QUICK=1: T ≤ 128)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kernels="$here/../../dataplane/kernels"
out="${EMU_OUT:-/tmp/hypic-kernel-emu}"
mkdir -p "$out"
mode="${1:-}"
gen() {  # gen <module> <dst> <with common: 1|0> [python replacement pairs file]
python3 - "$kernels" "$1" "$2" "$3" "${4:-}" <<'PY'
import re, sys, json
k, name, dst, with_common, muts = sys.argv[1:6]
common = open(f"{k}/common.cuh").read().replace("#include <cuda_bf16.h>", "")
src = open(f"{k}/{name}.cu").read()
if muts:
    for pair in json.load(open(muts)):
        if len(pair) > 2:  # [old, new, "host"]: an edit of flash_wg_emu.cpp (gen_host)
            continue
        old, new = pair
        assert src.count(old) >= 1, f"mutation anchor not found: {old}"
        src = src.replace(old, new)
src, n = re.subn(r"// <device-primitives>.*?// </device-primitives>", "", src, flags=re.S)
assert n == 1, "primitives block not found"
decls = {"flash": ("extern __shared__ __align__(16) unsigned char fa_smem[];",
                   "unsigned char* fa_smem = emu_dyn_smem;"),
         "flash_wg": ("extern __shared__ __align__(1024) unsigned char fw_smem[];",
                      "unsigned char* fw_smem = emu_dyn_smem + emu_smem_shift;")}
decl, repl = decls[name]
assert decl in src, "dynamic shared memory declaration not found"
src = src.replace(decl, repl)
open(dst, "w").write((common if with_common == "1" else "") + f'\n#line 1 "{name}.cu"\n' + src)
PY
}
gen_host() {  # gen_host <dst> <mutant pairs file>: flash_wg_emu.cpp with the mutant's host edits
python3 - "$here/flash_wg_emu.cpp" "$1" "$2" <<'PY'
import json, sys
src_path, dst, muts = sys.argv[1:4]
src = open(src_path).read()
for pair in json.load(open(muts)):
    if len(pair) > 2:
        assert pair[2] == "host", f"unknown mutation target: {pair[2]}"
        assert src.count(pair[0]) >= 1, f"host mutation anchor not found: {pair[0]}"
        src = src.replace(pair[0], pair[1])
open(dst, "w").write(src)
PY
}
CXX="g++ -std=c++17 -O2 -Wall -Wno-psabi -Wno-unused-function -Wno-unused-variable -Wno-unknown-pragmas -I$here -I$out"
case "$mode" in
wg)
    shift
    gen flash "$out/gen_flash.inc" 1
    gen flash_wg "$out/gen_flash_wg.inc" 0
    $CXX -o "$out/flash_wg_emu" "$here/flash_wg_emu.cpp"
    "$out/flash_wg_emu" "$@"
    ;;
wg-mutants)
    gen flash "$out/gen_flash.inc" 1
    fails=0
    python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
M = {
  # 128-byte swizzle of the loaders off by one row
  "swizzle": [["((((c >> 3) & 7) ^ (r & 7)) << 4)", "((((c >> 3) & 7) ^ ((r + 1) & 7)) << 4)"]],
  # no swizzle in the loaders (plain row-major 128-byte rows)
  "noswizzle": [["((((c >> 3) & 7) ^ (r & 7)) << 4)", "(((c >> 3) & 7) << 4)"]],
  # register A fragment: rows g / g+8 swapped (a1 <-> a2)
  "frag-a": [["p[kk][1] = fw_pack(s[2 * kk][2], s[2 * kk][3]);", "p[kk][2] = fw_pack(s[2 * kk][2], s[2 * kk][3]);"],
             ["p[kk][2] = fw_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);", "p[kk][1] = fw_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);"]],
  # accumulator layout misread: the masks of the two row halves swapped
  "frag-acc": [["if (!v0 || p0 > qp1) s[n][2] = NEG_INF;", "if (!v0 || p0 > qp0) s[n][2] = NEG_INF;"],
               ["if (!v0 || p0 > qp0) s[n][0] = NEG_INF;", "if (!v0 || p0 > qp1) s[n][0] = NEG_INF;"]],
  # V descriptor: LBO and SBO swapped
  "v-lbo-sbo": [["fw_desc(va + kk * 16 * 128, BC * 128, 1024)", "fw_desc(va + kk * 16 * 128, 1024, BC * 128)"]],
  # K-major k16 step inside the swizzle atom by 16 instead of 32 bytes
  "k-step": [["const unsigned kc = (kk & 3) * 32;", "const unsigned kc = (kk & 3) * 16;"]],
  # no fence.proxy.async after the copies
  "no-proxy-fence": [["    fw_cp_wait_all();\n    fw_fence_proxy_async();\n    __syncthreads();\n    // The wgmma",
                      "    fw_cp_wait_all();\n    __syncthreads();\n    // The wgmma"]],
  # P packed before P V(i) retired (register A overwritten in flight)
  "early-pack": [["            acc[n][3] *= c1;\n        }\n        pack_p();", "            acc[n][3] *= c1;\n        }\n"],
                 ["        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);\n#pragma unroll\n        for (int n = 0; n < NT; ++n) {",
                  "        pack_p();\n        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);\n#pragma unroll\n        for (int n = 0; n < NT; ++n) {"]],
  # O rescaled before P V(i) retired
  "early-rescale": [["        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);\n#pragma unroll\n        for (int n = 0; n < NT; ++n) {\n            acc[n][0] *= c0;\n            acc[n][1] *= c0;\n            acc[n][2] *= c1;\n            acc[n][3] *= c1;\n        }",
                     "#pragma unroll\n        for (int n = 0; n < NT; ++n) {\n            acc[n][0] *= c0;\n            acc[n][1] *= c0;\n            acc[n][2] *= c1;\n            acc[n][3] *= c1;\n        }\n        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);"]],
  # K(i+2) loaded into the stage S(i+1) reads
  "stage": [["if (jnn < je) load_k(jnn, i & 1);", "if (jnn < je) load_k(jnn, (i + 1) & 1);"]],
  # shared memory base not rounded up to 1024 bytes (the mutants run with EMU_SMEM_SHIFT=16)
  "no-align": [["unsigned char* base = fw_smem + ((1024u - (fw_smem_u32(fw_smem) & 1023u)) & 1023u);",
                "unsigned char* base = fw_smem;"]],
  # no wgmma.fence before the loop's wgmma
  "no-fence": [["        fw_wgmma_fence();\n        issue_s((i + 1) & 1);", "        issue_s((i + 1) & 1);"]],
}
W3 = {
  # consumer waits for V(t) with the wrong phase parity
  "wg3-parity-v": [["fw_mbar_wait(bar_vf(sv), (t / S) & 1);", "fw_mbar_wait(bar_vf(sv), ((t / S) & 1) ^ 1);"]],
  # consumer waits for K(t+1) with the wrong phase parity
  "wg3-parity-k": [["if (have_next) fw_mbar_wait(bar_kf(sk), ((t + 1) / S) & 1);",
                    "if (have_next) fw_mbar_wait(bar_kf(sk), (((t + 1) / S) & 1) ^ 1);"]],
  # consumer does not wait for K(t+1) before S(t+1) reads its stage
  "wg3-no-wait-k": [["        if (have_next) fw_mbar_wait(bar_kf(sk), ((t + 1) / S) & 1);\n", ""]],
  # consumer does not wait for Q
  "wg3-no-wait-q": [["    fw_mbar_wait(bar_q(), 0);\n", ""]],
  # no fence.proxy.async between the Q mbarrier wait (Q by cp.async) and the first wgmma
  "wg3-no-proxy-fence": [["    fw_fence_proxy_async();\n    // wgmma unconditionally", "    // wgmma unconditionally"]],
  # V stage released before the wait_group that retires P V (producer refills it in flight)
  "wg3-early-release-v": [["        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);\n        fw_mbar_arrive(bar_ve(sv));",
                           "        fw_mbar_arrive(bar_ve(sv));\n        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);"]],
  # K stage released right after the issue, before S(t+1) retired
  "wg3-early-release-k": [["            fw_mbar_arrive(bar_ke(sk));  // K(t+1)", "            // K(t+1)"],
                          ["        issue_pv(sv);\n", "        issue_pv(sv);\n        if (have_next) fw_mbar_arrive(bar_ke(sk));\n"]],
  # producer waits for the release of a K stage with the wrong parity
  "wg3-producer-parity": [["fw_mbar_wait(bar_ke(sk), (((t + 1) / S) & 1) ^ 1);", "fw_mbar_wait(bar_ke(sk), ((t + 1) / S) & 1);"]],
  # ping-pong: consumer 1 also arrives after its last issue (an arrival nobody syncs on)
  "wg3-pingpong-arrive": [["if (wgc == 0 || have_next) fw_bar_arrive(2 - wgc, 2 * PT);",
                           "fw_bar_arrive(2 - wgc, 2 * PT);"]],
  # ping-pong: consumer 1 does not open consumer 0's first turn
  "wg3-pingpong-open": [["        if (wgc == 1) fw_bar_arrive(1, 2 * PT);  // consumer 0 issues first\n", ""]],
  # fragment / descriptor / ordering mutants of the basic kernel, on the wg3 copy of the code
  "wg3-frag-a": M["frag-a"],
  "wg3-k-step": M["k-step"],
  "wg3-v-lbo-sbo": M["v-lbo-sbo"],
  # P packed before P V(t) retired (register A overwritten in flight)
  "wg3-early-pack": [["        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);\n        fw_mbar_arrive(bar_ve(sv));",
                      "        pack_p();\n        fw_wgmma_wait<0, NT * 4>(&acc[0][0]);\n        fw_mbar_arrive(bar_ve(sv));"]],
  # setmaxnreg not a multiple of 8
  "wg3-regs-align": [["#define FW3_REG_MMA 240", "#define FW3_REG_MMA 236"]],
  # producer keeps 40 registers: the pool cannot grant 2 × 128 × 240
  "wg3-regs-pool": [["fw_setmaxnreg_dec<FW3_REG_LOAD>();", "fw_setmaxnreg_dec<40>();"]],
}
T = {
  # expect_tx one box short: the phase completes before the last box landed
  "tma-expect-tx-small": [["fw_mbar_expect_tx(bar, TBYTES);", "fw_mbar_expect_tx(bar, TBYTES - BC * 128);"]],
  # expect_tx 16 bytes too many: the phase never completes
  "tma-expect-tx-large": [["fw_mbar_expect_tx(bar, TBYTES);", "fw_mbar_expect_tx(bar, TBYTES + 16);"]],
  # box one key further down
  "tma-box-row": [["kh * HD + cb * 64, j * BC, bar);", "kh * HD + cb * 64, j * BC + 1, bar);"]],
  # box of the wrong kv head / column block
  "tma-box-col": [["kh * HD + cb * 64, j * BC, bar);", "cb * 64, j * BC, bar);"]],
  # column block cb landing in the wrong region of the stage
  "tma-box-dst": [["fw_tma_load_2d(dst + cb * BC * 128,", "fw_tma_load_2d(dst + (NCB - 1 - cb) * BC * 128,"]],
  # V into the wrong stage of the ring
  "tma-stage": [["tma_tile(tmv, sVa + sv * TBYTES, bar_vf(sv), j);", "tma_tile(tmv, sVa + (sv + 1 == S ? 0 : sv + 1) * TBYTES, bar_vf(sv), j);"]],
  # consumer does not wait for V(t) (K(t+1): wg3-no-wait-k)
  "tma-no-wait-v": [["        fw_mbar_wait(bar_vf(sv), (t / S) & 1);\n        // TMA writes", "        // TMA writes"]],
  # producer refills a V stage without waiting for its release
  "tma-no-empty-wait": [["            fw_mbar_wait(bar_ve(sv), ((t / S) & 1) ^ 1);\n            if (lane == 0) tma_tile", "            if (lane == 0) tma_tile"]],
  # K full barrier without the expect_tx arrival in its count
  "tma-kf-count": [["fw_mbar_init(bar_kf(st), 33);", "fw_mbar_init(bar_kf(st), 32);"]],
}
L = {
  # lean-* on attn_flash_wg3tmal_*, leanb80-* and tmab80-* on attn_flash_wg3tmalb80_*.
  # producer publishes the wrong tile index in the stage's facts (masking of the next tile)
  "lean-fact-index": [["sFact[2 * st + 1] = j;", "sFact[2 * st + 1] = j + 1;"]],
  # producer publishes the tile index in the facts of the next stage of the ring
  "lean-fact-slot": [["sFact[2 * st + 1] = j;", "sFact[2 * (st + 1 == S ? 0 : st + 1) + 1] = j;"]],
  # tmax of the tile copied into the facts of the next stage of the ring
  "lean-fact-tmax-slot": [["fw_cp_async8z(fw_smem_u32(sFact + 2 * st), tmax + j, true);",
                           "fw_cp_async8z(fw_smem_u32(sFact + 2 * (st + 1 == S ? 0 : st + 1)), tmax + j, true);"]],
  # (Not here: tmax copied after the cp.async.mbarrier.arrive, or j stored after the
  # expect_tx arrival. Both survive: the emulator's shared memory is sequentially consistent,
  # plain loads of sFact are not checked against the mbarrier tags (only wgmma operands are),
  # and its scheduling lets the producer run ahead, so the late copy / store always lands
  # before the consumers read the facts. Dropping fw_count_tiles' smin early exit is harmless:
  # smin is a suffix minimum, so no tile past the exit is visible.)
  # consumer reads the facts of V(t)'s stage instead of K(t+1)'s
  "lean-fact-stage": [["facts(sk, nv, fl);", "facts(sv, nv, fl);"]],
  # consumer tile count one past the range (counts tile je)
  "lean-count-more": [["jj < je && tmin[jj] <= qmax));", "jj <= je && tmin[jj] <= qmax));"]],
  # consumer tile count one short (the last visible tile never consumed)
  "lean-count-less": [["        j += 32;\n    }\n    return n;\n", "        j += 32;\n    }\n    return n > 0 ? n - 1 : 0;\n"]],
  # split output: running max written in the raw score domain (combine expects log2 units)
  "lean-split-m": [["fw_epilogue<HD>(acc, m0 * scale_log2, m1 * scale_log2,", "fw_epilogue<HD>(acc, m0, m1,"]],
  # exponent FMA with the wrong sign of the running max
  "lean-fold-sign": [["const float nb0 = -b0 * scale_log2, nb1 = -b1 * scale_log2;",
                      "const float nb0 = b0 * scale_log2, nb1 = b1 * scale_log2;"]],
  # rescale factor c0 with the old running max left unscaled
  "lean-fold-c0": [["c0 = fw_exp2(fmaf(m0, scale_log2, nb0));", "c0 = fw_exp2(m0 + nb0);"]],
  # 80-key tiles: valid keys of the tile counted with 64-key tiles
  "leanb80-nvalid": [["nvalid = n_kv - (int)sFact[2 * st + 1] * BC;", "nvalid = n_kv - (int)sFact[2 * st + 1] * 64;"]],
  # 80-key TMA: tensor-map boxes of 64 rows (host side, the emulator's encode_kv_map)
  "tmab80-box-rows": [["const unsigned box[2] = {64, (unsigned)bc};", "const unsigned box[2] = {64, 64u};", "host"]],
  # 80-key TMA: box row coordinate of a 64-key tile
  "tmab80-box-row": [["kh * HD + cb * 64, j * BC, bar);", "kh * HD + cb * 64, j * 64, bar);"]],
  # 80-key TMA: column blocks land 64 rows apart (overlapping [80][128 B] regions)
  "tmab80-box-dst": [["fw_tma_load_2d(dst + cb * BC * 128,", "fw_tma_load_2d(dst + cb * 64 * 128,"]],
}
for name, pairs in L.items():
    json.dump(pairs, open(f"{out}/mut_{name}.json", "w"))
for name, pairs in T.items():
    json.dump(pairs, open(f"{out}/mut_{name}.json", "w"))
for name, pairs in M.items():
    json.dump(pairs, open(f"{out}/mut_{name}.json", "w"))
for name, pairs in W3.items():
    json.dump(pairs, open(f"{out}/mut_{name}.json", "w"))
open(f"{out}/mutants.txt", "w").write("\n".join(list(M) + list(W3) + list(T) + list(L)))
PY
    for m in ${EMU_MUTANTS:-$(cat "$out/mutants.txt")}; do
        # A stale anchor (the kernel changed under the mutant) or a mutant that does not
        # build is a failure of the check, reported, not a catch.
        if ! { gen flash_wg "$out/gen_flash_wg.inc" 0 "$out/mut_$m.json" &&
               gen_host "$out/flash_wg_emu_mut.cpp" "$out/mut_$m.json"; } 2> "$out/mut_$m.log"; then
            echo "MUTANT NOT APPLIED: $m: $(tail -n 1 "$out/mut_$m.log")"; fails=$((fails + 1)); continue
        fi
        if ! $CXX -o "$out/flash_wg_mut" "$out/flash_wg_emu_mut.cpp" > "$out/mut_$m.log" 2>&1; then
            echo "MUTANT DOES NOT BUILD: $m (see $out/mut_$m.log)"; fails=$((fails + 1)); continue
        fi
        case "$m" in
        wg3-* | tma-* | lean-*) variant=wg3tmal ;;
        leanb80-* | tmab80-*) variant=wg3tmalb80 ;;
        *) variant=basic ;;
        esac
        if EMU_SMEM_SHIFT=16 timeout 600 "$out/flash_wg_mut" quick $variant > "$out/mut_$m.log" 2>&1; then
            echo "MUTANT SURVIVED: $m"; fails=$((fails + 1))
        else
            echo "caught $m: $(grep -m1 -E 'EMU ERROR|FAIL' "$out/mut_$m.log" || tail -c 200 "$out/mut_$m.log")"
        fi
    done
    [ "$fails" = 0 ] && echo "all mutants caught" || { echo "$fails mutant(s) survived or not applied"; exit 1; }
    ;;
lightning-tc)
    # lightning_tc.cu with its primitives (the HYPIC_HOST_EMU block) from lightning_tc_emu.cpp.
    python3 - "$kernels" "$out/gen_lightning_tc.inc" <<'PY'
import sys
k, dst = sys.argv[1:3]
common = open(f"{k}/common.cuh").read().replace("#include <cuda_bf16.h>", "")
src = open(f"{k}/lightning_tc.cu").read()
decl = "extern __shared__ __align__(16) unsigned char ltc_sm[];"
assert decl in src, f"{decl} not found"
src = src.replace(decl, "unsigned char* ltc_sm = emu_dyn_smem;")
open(dst, "w").write(common + '\n#line 1 "lightning_tc.cu"\n' + src)
PY
    $CXX -ffp-contract=off -o "$out/lightning_tc_emu" "$here/lightning_tc_emu.cpp"
    "$out/lightning_tc_emu"
    echo "(again: EMU_SCHED=rev EMU_EAGER_CP=1 EMU_QUICK=1)"
    EMU_SCHED=rev EMU_EAGER_CP=1 EMU_QUICK=1 "$out/lightning_tc_emu"
    # A three-stage pipeline (LTC_ST=3; the kernel's default is two).
    echo "(again: LTC_ST=3, EMU_QUICK=1)"
    $CXX -ffp-contract=off -DLTC_ST=3 -o "$out/lightning_tc_emu3" "$here/lightning_tc_emu.cpp"
    EMU_QUICK=1 "$out/lightning_tc_emu3"
    ;;
lightning)
    # lightning.cu whole, plus moe_route_rule cut out of moe.cu (its other kernels use PTX).
    python3 - "$kernels" "$out/gen_lightning.inc" <<'PY'
import re, sys
k, dst = sys.argv[1:3]
common = open(f"{k}/common.cuh").read().replace("#include <cuda_bf16.h>", "")
lt = open(f"{k}/lightning.cu").read()
for name in ("lp_sm", "lc_sm"):
    decl = f"extern __shared__ float {name}[];"
    assert decl in lt, f"{decl} not found"
    lt = lt.replace(decl, f"float* {name} = (float*)emu_dyn_smem;")
moe = open(f"{k}/moe.cu").read()
a = moe.index("__device__ __forceinline__ bool moe_better")
b = moe.index("// ----", a)
open(dst, "w").write(common + '\n#line 1 "lightning.cu"\n' + lt + "\n#define MOE_EPL 16\n" + moe[a:b])
PY
    $CXX -ffp-contract=off -o "$out/lightning_emu" "$here/lightning_emu.cpp"
    "$out/lightning_emu"
    ;;
kda-tc)
    # kda_tc.cu whole; its PTX primitives (the HYPIC_HOST_EMU block) come from kda_tc_emu.cpp.
    python3 - "$kernels" "$out/gen_kda_tc.inc" <<'PY'
import sys
k, dst = sys.argv[1:3]
common = open(f"{k}/common.cuh").read().replace("#include <cuda_bf16.h>", "")
src = open(f"{k}/kda_tc.cu").read()
assert "#ifndef HYPIC_HOST_EMU" in src, "primitives block not found"
open(dst, "w").write(common + '\n#line 1 "kda_tc.cu"\n' + src)
PY
    # -fno-strict-aliasing: the kernel reads bf16 pairs and fragments through 32-bit loads.
    $CXX -ffp-contract=off -fno-strict-aliasing -o "$out/kda_tc_emu" "$here/kda_tc_emu.cpp"
    "$out/kda_tc_emu"
    # Again with copies landing as issued and threads resumed in reverse order (hazards
    # between warps that the default order hides); wait_group is exact in both runs.
    echo "(again: EMU_SCHED=rev EMU_EAGER_CP=1 EMU_QUICK=1)"
    EMU_SCHED=rev EMU_EAGER_CP=1 EMU_QUICK=1 "$out/kda_tc_emu"
    ;;
gdn-rows)
    # The one-token recurrence section of gdr.cu (with its batched form) and conv.cu.
    python3 - "$kernels" "$out/gen_gdn_rows.inc" <<'PY'
import sys
k, dst = sys.argv[1:3]
common = open(f"{k}/common.cuh").read().replace("#include <cuda_bf16.h>", "")
gdr = open(f"{k}/gdr.cu").read()
end = gdr.index("GDR_REC_ROWS(bf16, bf16, 256)") + len("GDR_REC_ROWS(bf16, bf16, 256)")
conv = open(f"{k}/conv.cu").read()
open(dst, "w").write(common + '\n#line 1 "gdr.cu"\n' + gdr[:end] + '\n#line 1 "conv.cu"\n' + conv)
PY
    $CXX -ffp-contract=off -o "$out/gdn_rows_emu" "$here/gdn_rows_emu.cpp"
    "$out/gdn_rows_emu"
    ;;
attn-rows|attn-rows-mutants)
    # attn.cu's one-row KV append and its decode-attention section (the rest of the file
    # is the prefill kernels); EMU_ATTN_MUT="old|||new" applies one replacement first.
    gen_attn_rows() {
    python3 - "$kernels" "$out/gen_attn_rows.inc" <<'PY'
import os, sys
k, dst = sys.argv[1:3]
common = open(f"{k}/common.cuh").read().replace("#include <cuda_bf16.h>", "")
attn = open(f"{k}/attn.cu").read()
mut = os.environ.get("EMU_ATTN_MUT")
if mut:
    old, new = (x.replace("\\n", "\n") for x in mut.split("|||"))
    assert old in attn, f"mutation anchor not found: {old}"
    attn = attn.replace(old, new, 1)
a = attn.index("// One row appended to a KV cache at the row index")
b = attn.index("// ----", a)
c = attn.index("// Decode attention (split over the keys")
dec = attn[c:]
decl = "extern __shared__ float dw[];"
assert decl in dec, f"{decl} not found"
dec = dec.replace(decl, "float* dw = (float*)emu_dyn_smem;")
open(dst, "w").write(common + '\n#line 1 "attn.cu"\n' + attn[a:b] + "\n" + dec)
PY
    # -fno-strict-aliasing: the kernel reads bf16 pairs through uint4/uint2 loads.
    $CXX -ffp-contract=off -fno-strict-aliasing -o "$out/attn_rows_emu" "$here/attn_rows_emu.cpp"
    }
    if [ "$mode" = attn-rows ]; then
      gen_attn_rows
      "$out/attn_rows_emu"
    else
      caught=0 total=0
      while IFS= read -r m; do
        [ -n "$m" ] || continue
        total=$((total + 1))
        if ! EMU_ATTN_MUT="$m" gen_attn_rows > "$out/mutant.log" 2>&1; then
          echo "  BROKEN (does not apply or build): ${m%%|||*}"
        elif (EMU_QUICK=1 "$out/attn_rows_emu"; exit $?) >> "$out/mutant.log" 2>&1; then
          echo "  NOT CAUGHT: ${m%%|||*}"
        else
          caught=$((caught + 1))
          echo "  caught: ${m%%|||*}"
        fi
      done <<'MUT'
(const bf16*)tbl[bsz + b], (const i64*)tbl|||(const bf16*)tbl[b], (const i64*)tbl
wo + at * nh * HD, wml + at * nh * 2, n|||wo + at * nh * HD, wml, n
wo + at * nh * hd, wml + at * nh * 2, o + (size_t)b * nh * hd|||wo + at * nh * hd, wml + at * nh * 2, o
q + (size_t)b * nh * HD, q_pos + b|||q + (size_t)b * nh * HD, q_pos
pos + b, (T*)tbl[b]|||pos, (T*)tbl[b]
v + (size_t)b * row, pos|||v, pos
for (int j = 0; j < b; ++j) base|||for (int j = 0; j <= b; ++j) base
                             decode_plan_splits(n_kv[b]));|||                             1);
MUT
      echo "attn-rows mutants: $caught of $total caught"
      [ "$caught" -eq "$total" ]
    fi
    ;;
*)
    gen flash "$out/gen_flash.inc" 1
    $CXX -o "$out/flash_emu" "$here/flash_emu.cpp"
    "$out/flash_emu" "$@"
    ;;
esac
