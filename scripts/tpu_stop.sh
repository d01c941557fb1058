#!/usr/bin/env bash
# Stops a detached run on every worker with SIGTERM: the processes agree on a step (JAX's
# preemption sync point), save a checkpoint there and exit 0; tpu_run.sh resumes from it.
#   scripts/tpu_stop.sh --name paragan --zone europe-west4-a
source "$(dirname "$0")/tpu_common.sh"
tpu_parse_args "$@"
REMOTE="pid=\$(cat $REMOTE_PID 2>/dev/null || true);"
REMOTE+=" if [ -n \"\$pid\" ] && kill -TERM \"\$pid\" 2>/dev/null;"
REMOTE+=" then echo \"\$(hostname): SIGTERM sent to \$pid\"; else echo \"\$(hostname): not running\"; fi"
WORKER=all
tpu_ssh "$REMOTE"
