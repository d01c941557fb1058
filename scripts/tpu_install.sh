#!/usr/bin/env bash
# Installs this stack on every worker of a TPU VM / slice: ships the committed tree (git archive
# of HEAD), installs uv and Python $PYTHON_VERSION (the TPU images ship 3.10; the stack needs
# >= 3.11), creates ~/$REMOTE_DIR/.venv and installs the package with its gan and tpu extras
# (jax[tpu]: libtpu from PyPI), then prints each worker's local TPU devices.
#   scripts/tpu_install.sh --name paragan --zone europe-west4-a --accelerator v3-32 [--dry-run]
source "$(dirname "$0")/tpu_common.sh"
tpu_parse_args "$@"
TARBALL=${TARBALL:-/tmp/$TPU_NAME-stack.tar.gz}
echo "# installing on all $HOSTS worker(s) of $TPU_NAME ($ACCELERATOR), Python $PYTHON_VERSION"
run git -C "$ROOT" archive --format=tar.gz -o "$TARBALL" HEAD
run gcloud compute tpus tpu-vm scp "$TARBALL" "$TPU_NAME:~/stack.tar.gz" "${PROJECT_FLAG[@]}" \
  --zone "$ZONE" --worker=all
UV='~/.local/bin/uv'
REMOTE="set -e; mkdir -p ~/$REMOTE_DIR && tar xzf ~/stack.tar.gz -C ~/$REMOTE_DIR"
REMOTE+=" && (command -v $UV >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh)"
REMOTE+=" && cd ~/$REMOTE_DIR && $UV python install $PYTHON_VERSION"
REMOTE+=" && $UV venv --python $PYTHON_VERSION --allow-existing .venv"
REMOTE+=" && $UV pip install --python .venv/bin/python -e '.[gan,tpu]'"
REMOTE+=" && .venv/bin/python -c 'import sys, jax;"
REMOTE+=" print(sys.version.split()[0], jax.__version__, jax.device_count(), jax.local_devices())'"
WORKER=all
tpu_ssh "$REMOTE"
