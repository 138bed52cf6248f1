#!/usr/bin/env bash
# Quickstart, main job: install the package, then train a small GPT on this CPU with gloo
# processes and mock data: 30 iterations with ZB-V, the same run with 1F1B, and a summary
# comparing their losses (equal: the math is 1F1B's) and measured pipeline bubble.
# Pipeline size 2 on 2 cores, one process per core: with more processes than cores, one rank's
# idle time is another's compute and no schedule can show its bubble. Extra flags are passed on
# (e.g. --pipeline-model-parallel-size 4 --num-layers 16 on a machine with 4+ cores).
source "$(dirname "$0")/_venv.sh"
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
mkdir -p out
rm -f out/1f1b.jsonl out/zb-v.jsonl
MODEL=(--cpu --pipeline-model-parallel-size 2 --num-layers 8 --hidden-size 512 --num-attention-heads 8
       --seq-length 64 --vocab-size 256 --mock-data --micro-batch-size 2 --global-batch-size 16
       --train-iters 30 --lr 1e-3 --lr-warmup-iters 3 --lr-decay-style cosine --min-lr 1e-4
       --hidden-dropout 0 --attention-dropout 0 --log-interval 5 --seed 1234 "$@")
echo "ZB-V as planned (equal F, B and W times; rank r holds layer blocks r and 3-r):"
.venv/bin/megatron-zb plan --schedule zb-v --pp 2 --microbatches 8 --width 100
echo
echo "Training with ZB-V:"
.venv/bin/megatron-zb train "${MODEL[@]}" --pipeline-schedule zb-v \
  --metrics-file out/zb-v.jsonl --trace-file out/zb-v.trace.json
echo
echo "The same run with 1F1B:"
.venv/bin/megatron-zb train "${MODEL[@]}" --pipeline-schedule 1f1b --metrics-file out/1f1b.jsonl
echo
.venv/bin/python -m megatron_zb.training.summary out/1f1b.jsonl out/zb-v.jsonl
echo "wrote out/zb-v.trace.json: the measured passes of the last ZB-V iteration (open in ui.perfetto.dev)"
