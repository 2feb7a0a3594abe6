#!/bin/bash
# Run HYPIC-tiny training on the lent GPU machine (see tools/README-train.md).
#   tools/train/device_run.sh probe            # ~2 min: install fla, 120 steps, small eval
#   tools/train/device_run.sh train ARGS...    # the real run; ARGS go to train.py
# Needs .whl/ (flash-linear-attention 0.6.0 + fla-core 0.6.0) carried with the call.
# Everything it writes is under $OUT (fp32 weights split into <16 MiB parts + results.tgz).
set -o pipefail
mode=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import fla, torch, transformers, triton, tokenizers; print('fla', fla.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'tokenizers', tokenizers.__version__)" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
R=$OUT/run
mkdir -p $R
if [ "$mode" = probe ]; then
  head -64 models/hypic-tiny/eval/heldout.jsonl > /tmp/h64.jsonl
  python3 tools/train/train.py --device cuda --require-fla --out $R --tokenizer models/hypic-tiny/tokenizer.json \
    --heldout /tmp/h64.jsonl --steps 4000 --time-limit 130 --reserve 40 --val-n 32 --eval-every 0 \
    --ckpt-every 0 --workers 14 --log-every 10 "$@" 2>&1 | grep -v "Writing model shards"
  rc=$?
  rm -f $R/model.safetensors
else
  # hard stop a little after train.py's own wall-clock guard, so the files below still get written
  timeout -s INT ${HARD_LIMIT:-540} python3 tools/train/train.py --device cuda --require-fla --out $R \
    --tokenizer models/hypic-tiny/tokenizer.json --heldout models/hypic-tiny/eval/heldout.jsonl --workers 14 "$@" \
    2>&1 | grep -v "Writing model shards"
  rc=$?
  if [ -f $R/model.safetensors ]; then
    sha256sum $R/model.safetensors | tee $R/model.sha256
    split -b 15m -d $R/model.safetensors $OUT/model.safetensors.part-
    rm $R/model.safetensors
  fi
fi
python3 tools/train/plot_loss.py $R/loss.csv $R/loss.png $R/val.csv || true
tar czf $OUT/results.tgz -C $OUT run
rm -rf $R
ls -la $OUT
exit $rc
