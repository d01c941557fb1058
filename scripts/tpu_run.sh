#!/usr/bin/env bash
# Runs training on every worker of a TPU VM / slice at once. Each worker calls
# jax.distributed.initialize() with no arguments (the TPU runtime supplies the coordinator,
# process count and index), then the ordinary `paragan_jax train` command.
#   scripts/tpu_run.sh --name paragan --zone europe-west4-a --accelerator v3-32 -- \
#       --config biggan128_tpu --workdir gs://my-bucket/runs/biggan128 [--dry-run before --]
# Anything after `--` is passed to `python -m paragan_jax train`.
source "$(dirname "$0")/tpu_common.sh"
tpu_parse_args "$@"
if [[ ${#EXTRA[@]} -eq 0 ]]; then
  EXTRA=(--config biggan128_tpu --workdir "runs/$TPU_NAME")
fi
ARGS=$(printf ' %q' "${EXTRA[@]}")
LOG="~/$REMOTE_DIR/train-\$(hostname).log"
REMOTE="cd ~/$REMOTE_DIR && .venv/bin/python -m paragan_jax train-multihost$ARGS"
REMOTE+=" 2>&1 | tee $LOG"
echo "# training on all $HOSTS worker(s) ($CHIPS chips) of $TPU_NAME"
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${PROJECT_FLAG[@]}" --zone "$ZONE" \
  --worker=all --command "$REMOTE"
