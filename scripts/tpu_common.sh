#!/usr/bin/env bash
# Shared flags and helpers of the Cloud TPU scripts (sourced by tpu_create/install/run/logs/
# status/stop/delete.sh).
#
# Every remote action goes through `run`, which prints the command and, unless --dry-run is
# given, executes it. Slice arithmetic (chips, hosts) is done in Python
# (tapas_jax.hardware.tpu_slice), so the scripts and the scaling model agree.
#
# Runtime (TPU software version) defaults follow Google's table "TPU software versions"
# (cloud.google.com/tpu/docs/runtimes): v2/v3/v4 tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite,
# v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e. Those images ship Python 3.10, so tpu_install.sh puts
# Python $PYTHON_VERSION on every worker with uv; libtpu (jax[tpu]) comes from PyPI.

set -euo pipefail

TPU_NAME=${TPU_NAME:-paragan}
ZONE=${ZONE:-europe-west4-a}
PROJECT=${PROJECT:-}
ACCELERATOR=${ACCELERATOR:-v3-8}
RUNTIME=${RUNTIME:-}
REMOTE_DIR=${REMOTE_DIR:-paragan_stack}
PYTHON_VERSION=${PYTHON_VERSION:-3.11}
WORKER=${WORKER:-all}
LINES=${LINES:-50}
FOLLOW=0
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
  --runtime VERSION      TPU software version (default: by accelerator) [RUNTIME]
  --worker W             worker(s) for ssh: all, 0, 1, ... [WORKER=$WORKER]
  --lines N              tpu_logs.sh: lines of each log [LINES=$LINES]
  --follow               tpu_logs.sh: keep following (one worker)
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
      --worker) WORKER=$2; shift 2 ;;
      --lines) LINES=$2; shift 2 ;;
      --follow) FOLLOW=1; shift ;;
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
  if [[ ! $WORKER =~ ^(all|[0-9]+)$ ]]; then
    echo "invalid --worker '$WORKER': 'all' or a worker number" >&2
    exit 2
  fi
  if [[ ! $LINES =~ ^[0-9]+$ ]]; then echo "invalid --lines '$LINES'" >&2; exit 2; fi
  SLICE_INFO=$(tpu_slice_info "$ACCELERATOR") || exit 2
  read -r CHIPS HOSTS <<<"$SLICE_INFO"
  PROJECT_FLAG=()
  if [[ -n $PROJECT ]]; then PROJECT_FLAG=(--project "$PROJECT"); fi
  if [[ -z $RUNTIME ]]; then RUNTIME=$(tpu_default_runtime "$ACCELERATOR"); fi
}

# The TPU software version Google lists for an accelerator type's generation.
tpu_default_runtime() {
  case "$1" in
    v5litepod-*|v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) echo tpu-ubuntu2204-base ;;
  esac
}

# Runs a shell command on the slice's worker(s) (--worker, default all) over gcloud ssh.
tpu_ssh() {
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${PROJECT_FLAG[@]}" --zone "$ZONE" \
    --worker="$WORKER" --command "$1"
}

# Where each worker keeps its run's log and pid (the log is named after the worker's hostname).
REMOTE_LOGS="~/$REMOTE_DIR/logs"
REMOTE_LOG="$REMOTE_LOGS/train-\$(hostname).log"
REMOTE_PID="$REMOTE_LOGS/train.pid"

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
