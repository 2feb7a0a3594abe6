#!/bin/bash
# Install what a `device_run.sh train` call brought back into models/hypic-tiny
# (or into MODEL_DIR, e.g. MODEL_DIR=models/hypic-ledger).
#   tools/train/install_run.sh /work/.device/N run2 [PYTHON]
# /work/.device/N holds model.safetensors.part-* and results.tgz (the call's files_at).
# Reassembles the fp32 weights, checks their sha256, writes the bf16 model with export.py,
# and copies the run's logs, metrics, predictions and loss.png.
set -euo pipefail
src=$1; name=$2; py=${3:-/work/pyenv/hf/bin/python}; dst=${MODEL_DIR:-models/hypic-tiny}
tmp=$(mktemp -d)
tar xzf "$src/results.tgz" -C "$tmp"
cat "$src"/model.safetensors.part-* > "$tmp/run/model.safetensors"
(cd "$tmp/run" && sha256sum -c model.sha256 2>/dev/null || { sed "s#  .*#  model.safetensors#" model.sha256 | sha256sum -c -; })
"$py" tools/train/export.py "$tmp/run" "$dst"
chmod 644 "$dst/model.safetensors"
mkdir -p "$dst/training/$name"
for f in loss.csv val.csv train.log metrics.json heldout_preds.jsonl heldout_preds_fp32.jsonl config.json model.sha256; do
  [ -f "$tmp/run/$f" ] && cp "$tmp/run/$f" "$dst/training/$name/"
done
[ -f "$tmp/run/loss.png" ] && cp "$tmp/run/loss.png" "$dst/loss.png"
echo "fp32 weights kept at $tmp/run/model.safetensors"
