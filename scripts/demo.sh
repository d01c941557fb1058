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

# Sections below are added as the packages land (tapas plan, serve replay, paragan train).
