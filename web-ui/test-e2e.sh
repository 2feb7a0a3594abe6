#!/usr/bin/env bash
# End-to-end test of the operator console (web-ui/e2e/run.mjs): installs what is
# absent (Debian's chromium, the npm packages), builds the `hypic` binary unless
# HYPIC_BIN names one, checks that the committed bundle matches the sources, and
# runs the suite against a real `hypic serve` on loopback. Screenshots: docs/ui/.
#
#   web-ui/test-e2e.sh            # everything
#   SKIP_BUNDLE_CHECK=1 web-ui/test-e2e.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null; then
  echo "test-e2e: installing chromium" >&2
  sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo -n"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_ apt-get update -qq >/dev/null
  $sudo_ apt-get install -y -qq chromium >/dev/null
fi
command -v node >/dev/null || { echo "test-e2e: node (>= 20.19) is needed" >&2; exit 1; }

cd web-ui
[ -d node_modules/playwright-core ] && [ -d node_modules/vite ] || npm ci --no-audit --no-fund
npm run --silent test
if [ -z "${SKIP_BUNDLE_CHECK:-}" ]; then
  # The binary embeds dist/: a source change without a rebuilt bundle fails here.
  npm run --silent build >/dev/null
  if ! git diff --quiet -- dist; then
    echo "test-e2e: web-ui/dist differs from a fresh build of web-ui/src; run 'npm run build' in web-ui and commit dist/" >&2
    git diff --stat -- dist >&2
    exit 1
  fi
fi
cd ..

if [ -z "${HYPIC_BIN:-}" ]; then
  cargo build -q -p hypic-control --bin hypic
  HYPIC_BIN=target/debug/hypic
fi
HYPIC_BIN="$HYPIC_BIN" node web-ui/e2e/run.mjs
