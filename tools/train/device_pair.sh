#!/bin/bash
# Two train.py runs at once on one GPU machine, for comparing two settings in one call.
# The models are small (~9 M parameters): one run leaves the GPU mostly waiting on kernel
# launches, so two processes share it with little loss each.
#   HARD_LIMIT=540 A_ARGS="--attn-layers 0" B_ARGS="--attn-layers 7" \
#     bash tools/train/device_pair.sh COMMON_TRAIN_ARGS...
# Needs .whl/ carried (tools/README-train.md). Each run goes through device_run.sh train
# with RUN_NAME=A / B and BF16=1, and PAIR_WORKERS (7) data workers of the 16 cores.
# Brings back 8 files, the most a call returns: $OUT/A/{model.safetensors.part-00,-01,
# results.tgz}, the same under $OUT/B/, and the two stdout logs $OUT/A.log, $OUT/B.log.
# Install one with: MODEL_DIR=models/hypic-ledger bash tools/train/install_run.sh FILES_AT/A run1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export SKIP_INSTALL=1 BF16=1
W=${PAIR_WORKERS:-7}
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -l 30 > /tmp/smi.log 2>&1 &
smi=$!
RUN_NAME=A bash tools/train/device_run.sh train "$@" $A_ARGS --workers $W --ckpt-dir /tmp/ck_A > $OUT/A.log 2>&1 &
pa=$!
RUN_NAME=B bash tools/train/device_run.sh train "$@" $B_ARGS --workers $W --ckpt-dir /tmp/ck_B > $OUT/B.log 2>&1 &
pb=$!
wait $pa; ra=$?
wait $pb; rb=$?
kill $smi 2>/dev/null
for n in A B; do
  echo "=== run $n"
  grep -E "^fla |^gpu|gradcheck|^params|layer_types|first step|\[val\]|training stopped|\[heldout|ERROR|Error|Traceback|done in|rounded" $OUT/$n.log | cut -c1-330
  grep -E "^step " $OUT/$n.log | awk 'NR%5==0' | tail -16 | cut -c1-175
done
echo "=== nvidia-smi (utilization, memory) every 30 s"; tr '\n' ';' < /tmp/smi.log | cut -c1-1200; echo
echo "rc A $ra B $rb"
