#!/usr/bin/env bash
# Shared flags and helpers of the Cloud TPU scripts (sourced by tpu_create/install/run/delete.sh).
#
# Every remote action goes through `run`, which prints the command and, unless --dry-run is
# given, executes it. Slice arithmetic (chips, hosts) is done in Python
# (tapas_jax.hardware.tpu_slice), so the scripts and the scaling model agree.

set -euo pipefail

TPU_NAME=${TPU_NAME:-paragan}
ZONE=${ZONE:-europe-west4-a}
PROJECT=${PROJECT:-}
ACCELERATOR=${ACCELERATOR:-v3-8}
RUNTIME=${RUNTIME:-tpu-ubuntu2204-base}
REMOTE_DIR=${REMOTE_DIR:-paragan_stack}
DRY_RUN=0
QUEUED=0
SPOT=0
EXTRA=()

tpu_usage() {
  cat <<USAGE
options (environment variables in brackets):
  --name NAME            TPU VM / slice name            [TPU_NAME=$TPU_NAME]
  --zone ZONE            zone                           [ZONE=$ZONE]
  --project PROJECT      GCP project (default: gcloud's) [PROJECT]
  --accelerator TYPE     v3-8, v3-32, v3-1024, v5litepod-16, ... [ACCELERATOR=$ACCELERATOR]
  --runtime VERSION      TPU VM software version        [RUNTIME=$RUNTIME]
  --queued               create through a queued resource (large slices)
  --spot                 spot capacity
  --dry-run              print every command, run none
  --                     the rest goes to the remote command (tpu_run.sh)
USAGE
}

tpu_parse_args() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --name) TPU_NAME=$2; shift 2 ;;
      --zone) ZONE=$2; shift 2 ;;
      --project) PROJECT=$2; shift 2 ;;
      --accelerator) ACCELERATOR=$2; shift 2 ;;
      --runtime) RUNTIME=$2; shift 2 ;;
      --queued) QUEUED=1; shift ;;
      --spot) SPOT=1; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) tpu_usage; exit 0 ;;
      --) shift; EXTRA=("$@"); break ;;
      *) echo "unknown option: $1" >&2; tpu_usage >&2; exit 2 ;;
    esac
  done
  if [[ ! $TPU_NAME =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]]; then
    echo "invalid --name '$TPU_NAME': lowercase letters, digits and '-', starting with a letter" >&2
    exit 2
  fi
  SLICE_INFO=$(tpu_slice_info "$ACCELERATOR") || exit 2
  read -r CHIPS HOSTS <<<"$SLICE_INFO"
  PROJECT_FLAG=()
  if [[ -n $PROJECT ]]; then PROJECT_FLAG=(--project "$PROJECT"); fi
}

# "chips hosts" of an accelerator type, from tapas_jax.hardware.tpu_slice.
tpu_slice_info() {
  local py=${PY:-}
  if [[ -z $py ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then py="$ROOT/.venv/bin/python"; else py=python3; fi
  fi
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$py" -c '
import sys
from tapas_jax.hardware import tpu_slice
try:
    s = tpu_slice(sys.argv[1])
except ValueError as e:
    sys.exit(f"error: {e}")
print(s.chips, s.hosts)
' "$1"
}

# Prints a command (shell-quoted) and runs it unless --dry-run.
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [[ $DRY_RUN -eq 0 ]]; then
    "$@"
  fi
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
