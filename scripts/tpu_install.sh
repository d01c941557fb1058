#!/usr/bin/env bash
# Installs this stack on every worker of a TPU VM / slice: ships the committed tree (git
# archive of HEAD), creates a virtualenv and installs the package with jax[tpu].
#   scripts/tpu_install.sh --name paragan --zone europe-west4-a --accelerator v3-32 [--dry-run]
source "$(dirname "$0")/tpu_common.sh"
tpu_parse_args "$@"
TARBALL=${TARBALL:-/tmp/$TPU_NAME-stack.tar.gz}
echo "# installing on all $HOSTS worker(s) of $TPU_NAME ($ACCELERATOR)"
run git -C "$ROOT" archive --format=tar.gz -o "$TARBALL" HEAD
run gcloud compute tpus tpu-vm scp "$TARBALL" "$TPU_NAME:~/stack.tar.gz" "${PROJECT_FLAG[@]}" \
  --zone "$ZONE" --worker=all
REMOTE="set -e; mkdir -p ~/$REMOTE_DIR && tar xzf ~/stack.tar.gz -C ~/$REMOTE_DIR"
REMOTE+=" && cd ~/$REMOTE_DIR && python3 -m venv .venv && .venv/bin/pip install -q -U pip"
REMOTE+=" && .venv/bin/pip install -q -e . 'jax[tpu]'"
REMOTE+=" -f https://storage.googleapis.com/jax-releases/libtpu_releases.html"
REMOTE+=" && .venv/bin/python -c 'import jax; print(jax.process_index(), jax.device_count())'"
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${PROJECT_FLAG[@]}" --zone "$ZONE" \
  --worker=all --command "$REMOTE"
