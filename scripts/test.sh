#!/usr/bin/env bash
# Runs every test of the workspace (unit, golden, control plane, end-to-end), after
# rustfmt and clippy (with and without the CUDA feature) when no filter is given.
# Needs: Rust (rustup). The catalog tests need PostgreSQL on 127.0.0.1:5432 with a
# `test` database that user `postgres` reaches without a password. When that is
# not there and HYPIC_TEST_PG_URL is not set, this script provides it (see
# ensure_postgres; installing needs root on Debian/Ubuntu). When it is already
# there, it does nothing and prints nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "test.sh: $*" >&2; }

# Runs a command as the `postgres` system user.
as_postgres() {
  if [ "$(id -u)" -eq 0 ]; then
    runuser -u postgres -- "$@"
  else
    sudo -n -u postgres "$@"
  fi
}

pg_reachable() {
  command -v psql >/dev/null &&
    psql -h 127.0.0.1 -p 5432 -U postgres -d test -w -qtAc 'SELECT 1' >/dev/null 2>&1
}

# Installs, initialises and starts PostgreSQL (Debian packaging) when the test
# database cannot be reached: apt-get install postgresql, create the cluster,
# start it, trust user postgres on loopback, create the `test` database.
ensure_postgres() {
  pg_reachable && return 0
  if ! compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
      log "PostgreSQL is not installed; install it (Debian: apt-get install postgresql) or run this as root; the Postgres tests will fail"
      return 0
    fi
    log "installing PostgreSQL (apt-get install postgresql)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq postgresql >/dev/null
  fi
  local ver
  ver=$(ls /usr/lib/postgresql | sort -V | tail -1)
  if [ ! -f "/etc/postgresql/$ver/main/postgresql.conf" ]; then
    log "creating the PostgreSQL $ver cluster"
    pg_createcluster "$ver" main >/dev/null
  fi
  local hba="/etc/postgresql/$ver/main/pg_hba.conf"
  if ! grep -qE '^host\s+all\s+postgres\s+127\.0\.0\.1/32\s+trust' "$hba"; then
    log "trusting user postgres on loopback ($hba)"
    # First match wins in pg_hba.conf: put the trust lines first.
    { printf 'host all postgres 127.0.0.1/32 trust\nhost all postgres ::1/128 trust\n'; cat "$hba"; } >"$hba.new"
    chown --reference="$hba" "$hba.new"
    chmod --reference="$hba" "$hba.new"
    mv "$hba.new" "$hba"
    pg_ctlcluster --skip-systemctl-redirect "$ver" main reload >/dev/null 2>&1 || true
  fi
  if ! pg_isready -h 127.0.0.1 -p 5432 -q; then
    log "starting PostgreSQL $ver"
    pg_ctlcluster --skip-systemctl-redirect "$ver" main start
    for _ in $(seq 1 30); do
      pg_isready -h 127.0.0.1 -p 5432 -q && break
      sleep 0.5
    done
  fi
  if ! as_postgres psql -h 127.0.0.1 -p 5432 -qtAc "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1; then
    log "creating database test"
    as_postgres createdb -h 127.0.0.1 -p 5432 test
  fi
  pg_reachable || log "PostgreSQL set up but postgres://postgres@127.0.0.1:5432/test is still not reachable"
}

# bindgen (the build of nixl-sys, `--features nixl`) needs libclang and clang's
# own headers (stddef.h). Installs Debian's libclang1 and libclang-common-N-dev
# (not the much larger libclang-dev) when absent; needs root.
ensure_libclang() {
  if { [ -n "${LIBCLANG_PATH:-}" ] || compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null; } &&
    compgen -G '/usr/lib/llvm-*/lib/clang/*/include/stddef.h' >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    log "libclang is not installed (Debian: apt-get install libclang-dev); the --features nixl steps will fail"
    return 0
  fi
  log "installing libclang for bindgen (apt-get install libclang1 libclang-common-N-dev)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq libclang1 >/dev/null
  local llvm
  llvm=$(ls -d /usr/lib/llvm-* | sort -V | tail -1)
  apt-get install -y -qq "libclang-common-${llvm##*-}-dev" >/dev/null
}

# Whether libnixl_capi.so can be loaded (after `. .device/nixl/env.sh` when
# scripts/nixl_libs.sh made that folder).
nixl_loadable() {
  local d dirs
  ldconfig -p 2>/dev/null | grep -q 'libnixl_capi\.so ' && return 0
  IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
  for d in "${dirs[@]}"; do
    [ -n "$d" ] && [ -f "$d/libnixl_capi.so" ] && return 0
  done
  return 1
}

# A server the caller chose is used as is.
if [ -z "${HYPIC_TEST_PG_URL:-}" ]; then
  ensure_postgres
fi
# The Postgres the catalog tests use (control/tests/integration/common: pg_url).
export HYPIC_TEST_PG_URL="${HYPIC_TEST_PG_URL:-postgres://postgres@127.0.0.1:5432/test}"
# Lints and the CUDA backend, on a full run (no test filter given): formatting,
# clippy with warnings as errors, clippy again with `--features cuda` over every
# target (libraries, binaries, examples, tests: all type- and borrow-checked), and a
# linked build of the libraries and the `hypic` binary with `--features cuda`, so the
# GPU code compiles as it ships. The GPU test binaries are built where they run
# (scripts/gpu-check.sh). No CUDA toolkit is needed at build time: the driver,
# NVRTC and cuBLAS are loaded when a GPU is first used. The same clippy and build
# include `--features nixl` (NIXL entry payloads, nixl-sys's stub API: no NIXL at
# build time, libnixl_capi.so loaded at run time; bindgen needs libclang).
step() { echo "test.sh: == $* ==" >&2; }
if [ $# -eq 0 ]; then
  step "cargo fmt --check"
  cargo fmt --all -- --check
  step "cargo clippy -D warnings"
  cargo clippy --workspace --all-targets --locked -- -D warnings
  ensure_libclang
  step "cargo clippy -D warnings, --features cuda,nixl"
  cargo clippy --workspace --all-targets --locked --features hypic-control/cuda,hypic-control/nixl -- -D warnings
  step "cargo build libraries and binaries, --features cuda,nixl"
  start=$SECONDS
  cargo build --workspace --lib --bins --locked --features hypic-control/cuda,hypic-control/nixl
  step "cuda,nixl build took $((SECONDS - start)) s"
fi
step "cargo test"
cargo test --workspace --locked "$@"
# The real NIXL transfer (a worker and a combiner agent READ entries over UCX), on a
# full run, where libnixl_capi.so loads (scripts/nixl_libs.sh extracts it into
# .device/nixl/); otherwise it is reported as skipped, not passed.
if [ $# -eq 0 ]; then
  (
    # shellcheck disable=SC1091
    if [ -f .device/nixl/env.sh ]; then . .device/nixl/env.sh; fi
    if nixl_loadable; then
      step "NIXL transfer (--features nixl, libnixl_capi.so found)"
      cargo test -p hypic-dataplane --locked --features nixl --lib parallel::nixl -- --include-ignored
    else
      step "NIXL transfer: SKIPPED: libnixl_capi.so not found (scripts/nixl_libs.sh extracts it)"
    fi
  )
fi
# CUDA kernels without a GPU, on a full run: the host emulator (tools/kernel-emu) runs
# the real kernel sources of the batched GDN and attention decode steps, of Lightning attention
# and of the tensor-core KDA and Lightning prefills against their references. Needs g++; without it the step
# is reported as skipped.
if [ $# -eq 0 ]; then
  if command -v g++ >/dev/null; then
    step "CUDA kernels in the host emulator (gdn-rows, attn-rows and its mutants, lightning, kda-tc, lightning-tc)"
    tools/kernel-emu/run.sh gdn-rows
    tools/kernel-emu/run.sh attn-rows
    tools/kernel-emu/run.sh attn-rows-mutants | tail -n 1
    tools/kernel-emu/run.sh lightning | tail -n 3
    tools/kernel-emu/run.sh kda-tc | tail -n 1
    tools/kernel-emu/run.sh lightning-tc | tail -n 1
  else
    step "CUDA kernels in the host emulator: SKIPPED: no g++"
  fi
fi
# The operator console, on a full run: vitest, the committed bundle against a fresh
# build, and the Playwright suite in Debian's chromium against a real `hypic serve`
# (web-ui/test-e2e.sh installs chromium and the npm packages when absent).
if [ $# -eq 0 ]; then
  step "web-ui: vitest, bundle check, Playwright end-to-end"
  HYPIC_BIN=target/debug/hypic web-ui/test-e2e.sh
  # The official OpenAI Python SDK against a real server (tests/sdk/run.sh makes its
  # virtualenv): structured output, tool calls, sampling controls, token-id prompts.
  step "OpenAI Python SDK"
  HYPIC_BIN=target/debug/hypic tests/sdk/run.sh
fi
