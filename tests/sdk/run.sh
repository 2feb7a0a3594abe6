#!/usr/bin/env bash
# The OpenAI Python SDK tests (tests/sdk/test_openai_sdk.py) against `hypic serve` on
# loopback with the bundled model: makes a virtualenv with the SDK (installing
# Debian's python3-venv when venv is missing), starts the server, mints a token, runs
# the checks, stops the server.
# Environment: HYPIC_BIN (default target/debug/hypic), HYPIC_SDK_VENV (default
# target/sdk-venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="${HYPIC_BIN:-target/debug/hypic}"
venv="${HYPIC_SDK_VENV:-target/sdk-venv}"
log() { echo "sdk: $*" >&2; }

apt_install() {
  log "installing $* (apt-get)"
  local sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo -n"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_ apt-get update -qq >/dev/null
  $sudo_ apt-get install -y -qq "$@" >/dev/null
}
command -v python3 >/dev/null || apt_install python3 python3-venv
if [ ! -x "$venv/bin/python" ]; then
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    apt_install python3-venv
    rm -rf "$venv"
    python3 -m venv "$venv"
  fi
fi
if ! "$venv/bin/python" -c 'import openai, jsonschema, pydantic, tokenizers' 2>/dev/null; then
  log "installing the OpenAI SDK into $venv"
  "$venv/bin/pip" install -q --disable-pip-version-check 'openai>=1.40' jsonschema pydantic tokenizers
fi

data=$(mktemp -d)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin" serve --data-dir "$data" --bind "127.0.0.1:$port" >"$data/server.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$data"' EXIT
for _ in $(seq 1 600); do
  python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || { cat "$data/server.log" >&2; exit 1; }
  sleep 0.25
done
token=$("$bin" token --data-dir "$data" --tenant sdk --role tenant)
HYPIC_URL="http://127.0.0.1:$port/v1" HYPIC_TOKEN="$token" \
  HYPIC_TOKENIZER="$PWD/models/hypic-tiny/tokenizer.json" \
  "$venv/bin/python" tests/sdk/test_openai_sdk.py || { tail -20 "$data/server.log" >&2; exit 1; }
