#!/usr/bin/env bash
# `make bench`: short versions of the headline benchmarks of BENCHMARKS.md, one per package, on
# the simulated 8-device CPU mesh (a few minutes in all). Outputs go under runs/bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=runs/bench
mkdir -p "$OUT"

echo "== tapas_jax: folded sharding search against the integer program (GPT, 2-8 layers)"
"$PY" -m tapas_jax bench --layers 2,4,8 --json "$OUT/tapas_search.json"

echo
echo "== serve_jax: preemption policies in the simulator (azure-conv, 10 minutes, 8 GB of KV)"
"$PY" -m serve_jax simulate --workload azure-conv --duration-s 600 --kv-memory-gb 8 \
  --policies fcfs_last,predictive --json "$OUT/serve_simulate.json"

echo
echo "== serve_jax: decode step of the tiny model, batch 16 at context 256 (one CPU device)"
JAXSTACK_CPU_DEVICES=1 "$PY" -m serve_jax bench --micro decode --batch 16 --context 256 \
  --steps 30 --json "$OUT/serve_decode.json"

echo
echo "== paragan_jax: predicted scaling efficiency of BigGAN-128 on TPU v3 slices"
"$PY" -m paragan_jax scaling --model biggan128 --chips 8,64,256,1024 --hardware tpu-v3 \
  --json "$OUT/paragan_scaling.json"

echo
echo "== paragan_jax: async against sync on the ring8 preset, 20 s each (8 simulated devices)"
rm -rf "$OUT/paragan_ring8"
"$PY" -m paragan_jax bench --config ring8_cpu --seconds 20 --devices 8 \
  --workdir "$OUT/paragan_ring8"

echo
echo "benchmark outputs are under $OUT/"
