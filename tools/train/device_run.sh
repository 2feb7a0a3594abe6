#!/bin/bash
# Run HYPIC-tiny / HYPIC-ledger training on the lent GPU machine (see tools/README-train.md).
#   tools/train/device_run.sh probe            # ~2 min: install fla, 120 steps, small eval
#   tools/train/device_run.sh train ARGS...    # the real run; ARGS go to train.py
# Needs .whl/ (flash-linear-attention 0.6.0 + fla-core 0.6.0) carried with the call.
# Everything it writes is under $OUT (fp32 weights split into <16 MiB parts + results.tgz).
# Environment (all optional; defaults give the behaviour used for hypic-tiny):
#   RUN_NAME=A     write to $OUT/A/ (parts + results.tgz) and work in /tmp/w_A, so that
#                  two runs can share one machine (tools/train/device_pair.sh)
#   BF16=1         round the weights to bf16 before splitting (half the bytes; export.py
#                  ships bf16 anyway, with the same rounding)
#   SKIP_INSTALL=1 the fla wheels are already installed in /tmp/site
set -o pipefail
mode=$1; shift
if [ -z "$SKIP_INSTALL" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import fla, torch, transformers, triton, tokenizers; print('fla', fla.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'tokenizers', tokenizers.__version__)" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
if [ -n "$RUN_NAME" ]; then DEST=$OUT/$RUN_NAME; WORKD=/tmp/w_$RUN_NAME; else DEST=$OUT; WORKD=$OUT; fi
R=$WORKD/run
mkdir -p $R $DEST
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
    if [ -n "$BF16" ]; then
      python3 -c "
import sys, torch
from safetensors.torch import load_file, save_file
p = sys.argv[1]
sd = load_file(p)
save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}, p, metadata={'format': 'pt'})
print('weights rounded to bf16')" $R/model.safetensors || rc=5
    fi
    sha256sum $R/model.safetensors | tee $R/model.sha256
    split -b 15m -d $R/model.safetensors $DEST/model.safetensors.part-
    rm $R/model.safetensors
  fi
fi
python3 tools/train/plot_loss.py $R/loss.csv $R/loss.png $R/val.csv || true
tar czf $DEST/results.tgz -C $WORKD run
rm -rf $R
ls -la $DEST
exit $rc
