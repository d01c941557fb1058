#!/usr/bin/env bash
# Starts training on every worker of a TPU VM / slice, detached (nohup): a dropped ssh session
# does not end the run. Each worker calls jax.distributed.initialize() with no arguments (the TPU
# runtime supplies the coordinator, process count and index), then the ordinary
# `paragan_jax train` command; its output goes to ~/$REMOTE_DIR/logs/train-<hostname>.log and its
# pid to logs/train.pid. Follow with tpu_logs.sh / tpu_status.sh; tpu_stop.sh sends SIGTERM
# (a checkpoint at the current step, exit 0), as a spot VM's preemption notice does. Rerunning
# tpu_run.sh with the same --workdir resumes from the newest checkpoint.
#   scripts/tpu_run.sh --name paragan --zone europe-west4-a --accelerator v3-32 -- \
#       --config biggan128_tpu --workdir gs://my-bucket/runs/biggan128 [--dry-run before --]
# Anything after `--` is passed to `python -m paragan_jax train`.
source "$(dirname "$0")/tpu_common.sh"
tpu_parse_args "$@"
if [[ ${#EXTRA[@]} -eq 0 ]]; then
  EXTRA=(--config biggan128_tpu --workdir "runs/$TPU_NAME")
fi
ARGS=$(printf ' %q' "${EXTRA[@]}" --no-progress)
REMOTE="cd ~/$REMOTE_DIR && mkdir -p logs"
REMOTE+=" && nohup .venv/bin/python -m paragan_jax train-multihost$ARGS"
REMOTE+=" > $REMOTE_LOG 2>&1 < /dev/null & echo \$! > $REMOTE_PID"
REMOTE+=" && echo \"\$(hostname): started pid \$(cat $REMOTE_PID), log $REMOTE_LOG\""
echo "# training on all $HOSTS worker(s) ($CHIPS chips) of $TPU_NAME, detached"
WORKER=all
tpu_ssh "$REMOTE"
