#!/usr/bin/env bash
# Creates a Cloud TPU VM (v3-8: one host) or a pod slice (v3-32 and up: several hosts).
#   scripts/tpu_create.sh --name paragan --zone europe-west4-a --accelerator v3-32 [--dry-run]
# Large slices are usually only granted through a queued resource: add --queued.
source "$(dirname "$0")/tpu_common.sh"
tpu_parse_args "$@"
echo "# $ACCELERATOR: $CHIPS chips on $HOSTS host(s)"
SPOT_FLAG=()
if [[ $SPOT -eq 1 ]]; then SPOT_FLAG=(--spot); fi
if [[ $QUEUED -eq 1 ]]; then
  run gcloud compute tpus queued-resources create "$TPU_NAME-qr" "${PROJECT_FLAG[@]}" \
    --zone "$ZONE" --node-id "$TPU_NAME" --accelerator-type "$ACCELERATOR" \
    --runtime-version "$RUNTIME" "${SPOT_FLAG[@]}"
  echo "# wait until the queued resource is ACTIVE:"
  run gcloud compute tpus queued-resources describe "$TPU_NAME-qr" "${PROJECT_FLAG[@]}" \
    --zone "$ZONE" --format "value(state.state)"
else
  run gcloud compute tpus tpu-vm create "$TPU_NAME" "${PROJECT_FLAG[@]}" --zone "$ZONE" \
    --accelerator-type "$ACCELERATOR" --version "$RUNTIME" "${SPOT_FLAG[@]}"
fi
run gcloud compute tpus tpu-vm describe "$TPU_NAME" "${PROJECT_FLAG[@]}" --zone "$ZONE" \
  --format "value(state,acceleratorType)"
