#!/usr/bin/env bash
# Rebuilds the built-in HYPIC policies for wasm32-unknown-unknown and copies
# them to dist/. The host build does not need this: dist/*.wasm is committed.
set -euo pipefail
cd "$(dirname "$0")"
rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || true
export CARGO_TARGET_DIR="${POLICY_TARGET_DIR:-$PWD/target}"
cargo build --release --target wasm32-unknown-unknown --workspace --exclude hypic-policy-sdk
mkdir -p dist
for p in lru gdsf quota second_sighting ttl on_update strict shared; do
    cp "$CARGO_TARGET_DIR/wasm32-unknown-unknown/release/hypic_policy_${p}.wasm" "dist/${p}.wasm"
done
ls -l dist
