#!/usr/bin/env bash
# Prints the last --lines of each worker's training log (--worker 0 is the one that logs
# progress and metrics; the others log only warnings); --follow keeps following one worker.
#   scripts/tpu_logs.sh --name paragan --zone europe-west4-a [--worker 0] [--lines 50] [--follow]
source "$(dirname "$0")/tpu_common.sh"
WORKER=0
tpu_parse_args "$@"
if [[ $FOLLOW -eq 1 ]]; then
  if [[ $WORKER == all ]]; then echo "--follow needs one --worker" >&2; exit 2; fi
  tpu_ssh "tail -n $LINES -F $REMOTE_LOG"
else
  tpu_ssh "echo \"== \$(hostname)\"; tail -n $LINES $REMOTE_LOG"
fi
