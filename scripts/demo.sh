#!/usr/bin/env bash
# Quickstart, main job: install the package, plan and compare schedules, then run them for real
# on a small megatron-core GPT with two gloo processes on this CPU.
source "$(dirname "$0")/_venv.sh"
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
.venv/bin/megatron-zb list
for schedule in 1f1b zb-h1 zb-2p zb-v; do
  .venv/bin/megatron-zb plan --schedule "$schedule" --pp 4 --microbatches 8 "$@"
  echo
done
mkdir -p out
.venv/bin/megatron-zb plan --schedule zb-h2 --pp 4 --microbatches 8 --format html -o out/zb-h2.html
.venv/bin/megatron-zb plan --schedule zb-h2 --pp 4 --microbatches 8 --format chrome-trace -o out/zb-h2.trace.json
.venv/bin/megatron-zb compare --pp 4 --microbatches 8 --plot out/pareto.svg
echo "wrote out/pareto.svg (bubble against peak memory), out/zb-h2.html (open in a browser) and out/zb-h2.trace.json (open in ui.perfetto.dev or chrome://tracing)"
echo
echo "Running megatron-core's 1F1B and our schedules on a small GPT (pp=2, gloo, about a minute):"
.venv/bin/python scripts/bench_runtime.py --rounds 3 --warmup 1
