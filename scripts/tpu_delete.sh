#!/usr/bin/env bash
# Deletes the TPU VM / slice (and its queued resource, with --queued).
#   scripts/tpu_delete.sh --name paragan --zone europe-west4-a [--queued] [--dry-run]
source "$(dirname "$0")/tpu_common.sh"
tpu_parse_args "$@"
if [[ $QUEUED -eq 1 ]]; then
  run gcloud compute tpus queued-resources delete "$TPU_NAME-qr" "${PROJECT_FLAG[@]}" \
    --zone "$ZONE" --force --quiet
else
  run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${PROJECT_FLAG[@]}" --zone "$ZONE" --quiet
fi
