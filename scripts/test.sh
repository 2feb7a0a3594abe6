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
# NVRTC and cuBLAS are loaded when a GPU is first used.
step() { echo "test.sh: == $* ==" >&2; }
if [ $# -eq 0 ]; then
  step "cargo fmt --check"
  cargo fmt --all -- --check
  step "cargo clippy -D warnings"
  cargo clippy --workspace --all-targets --locked -- -D warnings
  step "cargo clippy -D warnings, --features cuda"
  cargo clippy --workspace --all-targets --locked --features hypic-control/cuda -- -D warnings
  step "cargo build libraries and binaries, --features cuda"
  start=$SECONDS
  cargo build --workspace --lib --bins --locked --features hypic-control/cuda
  step "cuda build took $((SECONDS - start)) s"
fi
step "cargo test"
cargo test --workspace --locked "$@"
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
