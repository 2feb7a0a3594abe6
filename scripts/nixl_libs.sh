#!/usr/bin/env bash
# Extracts the NIXL libraries that `hypic --features nixl` loads at run time (the
# C API, the NIXL core, the UCX backend plugin and what they link) from the PyPI
# wheel `nixl-cu13` into .device/nixl/ (git-ignored), for a machine without NIXL
# installed and without network (the GPU machine: pass carry=[".device/nixl"]).
#
#   scripts/nixl_libs.sh [WHEEL]        # default: .whl/nixl_cu13-*.whl, else
#                                       # `pip download nixl-cu13==1.5.1` into .whl/
#   NIXL_LIBS_IB=1 scripts/nixl_libs.sh # also UCX's InfiniBand/RoCE modules
#                                       # (cross-node RDMA; about 6 MB more, xz'd)
#   scripts/nixl_libs.sh --unpack       # on the target: xz -d the carried files
#
# Layout (the wheel's relative RUNPATHs keep working):
#   .device/nixl/lib/            libnixl_capi.so and the NIXL core
#   .device/nixl/lib/plugins/    libplugin_UCX.so        (NIXL_PLUGIN_DIR)
#   .device/nixl/nixl_cu13.libs/ UCX, gRPC, etcd, abseil (bundled by the wheel)
#   .device/nixl/nixl_cu13.libs/ucx/  UCX transport modules (cma, cuda; ib with
#                                     NIXL_LIBS_IB=1)
#   .device/nixl/env.sh          `. .device/nixl/env.sh` sets LD_LIBRARY_PATH and
#                                NIXL_PLUGIN_DIR
# Every library is xz-compressed (the device tool carries at most 64 MiB);
# `--unpack` (also run by env.sh) restores them. The check at the end runs `ldd`
# on the C API, the plugin and the modules with the folder on the loader path and
# lists what the base system must provide (CUDA's libcuda/libcudart/libnvidia-ml
# for the cuda module only).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.device/nixl

if [ "${1:-}" = "--unpack" ]; then
  find "$dest" -name '*.xz' -print0 | xargs -0 -r xz -d -f
  exit 0
fi

wheel="${1:-}"
if [ -z "$wheel" ]; then
  wheel=$(ls .whl/nixl_cu13-*.whl 2>/dev/null | tail -1 || true)
fi
if [ -z "$wheel" ]; then
  echo "nixl_libs.sh: no wheel given; downloading nixl-cu13==1.5.1 into .whl/" >&2
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d .whl nixl-cu13==1.5.1
  wheel=$(ls .whl/nixl_cu13-*.whl | tail -1)
fi
[ -f "$wheel" ] || { echo "nixl_libs.sh: $wheel is not a file" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unzip -q "$wheel" '.nixl_cu13.mesonpy.libs/*' 'nixl_cu13.libs/*' \
  'nixl_cu13-*.dist-info/licenses/*' -d "$tmp"
core="$tmp/.nixl_cu13.mesonpy.libs"
bundled="$tmp/nixl_cu13.libs"

rm -rf "$dest"
mkdir -p "$dest/lib/plugins" "$dest/nixl_cu13.libs/ucx" "$dest/licenses"
cp "$tmp"/nixl_cu13-*.dist-info/licenses/LICENSE "$dest/licenses/"
cp "$tmp"/nixl_cu13-*.dist-info/licenses/licenses/* "$dest/licenses/" 2>/dev/null || true

# Roots: the C API, the UCX plugin and UCX's modules for shared memory (cma) and
# GPU memory (cuda); the InfiniBand ones on request.
roots=("$core/libnixl_capi.so" "$core/plugins/libplugin_UCX.so"
       "$bundled/ucx/libuct_cma.so.0.0.0" "$bundled/ucx/libuct_cuda.so.0.0.0"
       "$bundled/ucx/libucm_cuda.so.0.0.0")
if [ "${NIXL_LIBS_IB:-0}" = 1 ]; then
  roots+=("$bundled/ucx/libuct_ib.so.0.0.0" "$bundled/ucx/libuct_ib_mlx5.so.0.0.0")
fi

# The closure over DT_NEEDED within the wheel (names not in the wheel are the base
# system's: libc, libstdc++, libssl, libz, CUDA).
declare -A seen=()
system=()
queue=("${roots[@]}")
while [ ${#queue[@]} -gt 0 ]; do
  f=${queue[0]}; queue=("${queue[@]:1}")
  [ -n "${seen[$f]:-}" ] && continue
  seen[$f]=1
  for n in $(readelf -d "$f" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p'); do
    hit=""
    for d in "$core" "$bundled" "$bundled/ucx"; do
      [ -f "$d/$n" ] && { hit="$d/$n"; break; }
    done
    if [ -n "$hit" ]; then queue+=("$hit"); else system+=("$n"); fi
  done
done
for f in "${!seen[@]}"; do
  case "$f" in
    "$core"/plugins/*) cp "$f" "$dest/lib/plugins/" ;;
    "$core"/*) cp "$f" "$dest/lib/" ;;
    "$bundled"/ucx/*) cp "$f" "$dest/nixl_cu13.libs/ucx/" ;;
    "$bundled"/*) cp "$f" "$dest/nixl_cu13.libs/" ;;
  esac
done

cat > "$dest/env.sh" <<'EOF'
# Sourced: puts the extracted NIXL libraries on the loader path (unpacking them
# first when they are still xz-compressed).
_nixl_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if find "$_nixl_dir" -name '*.xz' | grep -q .; then
  find "$_nixl_dir" -name '*.xz' -print0 | xargs -0 -r xz -d -f
fi
export LD_LIBRARY_PATH="$_nixl_dir/lib:$_nixl_dir/nixl_cu13.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$_nixl_dir/lib/plugins"
unset _nixl_dir
EOF

# Check: every library resolves from the folder and the base system.
echo "nixl_libs.sh: dependencies not in the folder (the base system's):"
printf '%s\n' "${system[@]}" | sort -u | sed 's/^/  /'
missing=0
while IFS= read -r -d '' f; do
  nf=$(LD_LIBRARY_PATH="$PWD/$dest/lib:$PWD/$dest/nixl_cu13.libs" ldd "$f" 2>&1 | grep 'not found' || true)
  if [ -n "$nf" ]; then
    echo "  $f:"; echo "$nf" | sed 's/^/    /'
    case "$f" in *ucx/*cuda*) ;; *) missing=1 ;; esac
  fi
done < <(find "$dest" -name '*.so*' -print0)
[ "$missing" = 0 ] || { echo "nixl_libs.sh: unresolved dependencies above" >&2; exit 1; }
echo "nixl_libs.sh: unpacked $(du -sh "$dest" | cut -f1)"
find "$dest" -name '*.so*' -print0 | xargs -0 xz -T0 -9e
echo "nixl_libs.sh: $(find "$dest" -name '*.xz' | wc -l) files, $(du -sh --apparent-size "$dest" | cut -f1) xz-compressed in $dest"
