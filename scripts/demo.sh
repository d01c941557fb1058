#!/usr/bin/env bash
# The README demo: a short tour of each package on the simulated 8-device CPU mesh.
# Run through `make demo`, which creates .venv first. Outputs go under runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=runs/demo
mkdir -p "$OUT"

echo "== tapas_jax: devices, mesh and hardware profiles"
"$PY" -m tapas_jax info --mesh data=2,model=4

echo
echo "== tapas_jax: plan a 4-layer GPT on the simulated data=2,model=4 mesh"
"$PY" -m tapas_jax plan --config gpt_demo_cpu --json "$OUT/plan.json"

echo
echo "== serve_jax: offline replay of an Azure conversation-trace sample through the small model"
"$PY" -m serve_jax replay --config cpu_demo --trace conv --num-requests 10 --rate 2 \
  --token-scale 0.1 --max-output-len 32 --json "$OUT/replay.json" \
  executor.min_batch=16 executor.min_chunk=256

echo
echo "== serve_jax: preemption policies in the simulator (Llama-7B on H100, 8 GB of KV)"
"$PY" -m serve_jax simulate --workload reasoning --duration-s 900 --kv-memory-gb 8 \
  --policies fcfs_last,predictive --json "$OUT/simulate.json"

echo
echo "== paragan_jax: a conditional GAN learns scikit-learn's digits (400 steps, about 20 s)"
# Like the other demo outputs, the run is redone each time (a kept workdir would resume at 400).
# The grid's columns are the classes 0-9; TensorBoard (runs/demo/digits/tb) has a grid every 100
# steps and FD/KID/classifier score at steps 200 and 400.
rm -rf "$OUT/digits"
"$PY" -m paragan_jax train --config digits_demo --workdir "$OUT/digits" --no-progress

echo
echo "demo outputs are under $OUT/ (plan.json, replay.json, simulate.json + PNG, digits/)"
echo "the digits the GAN drew: $OUT/digits/samples_step400.png"
