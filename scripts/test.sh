#!/usr/bin/env bash
# Runs every test of the workspace (unit, golden, control plane, end-to-end).
# Needs: Rust (rustup), and for the Postgres tests a server on 127.0.0.1:5432
# (started here if it is installed but not running).
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v pg_isready >/dev/null && ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  if command -v pg_ctlcluster >/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
  fi
fi
# The Postgres the catalog tests use (control/tests/integration/common: pg_url).
export HYPIC_TEST_PG_URL="${HYPIC_TEST_PG_URL:-postgres://postgres@127.0.0.1:5432/test}"
cargo test --workspace --locked
