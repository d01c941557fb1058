#!/usr/bin/env bash
# Whether the training process runs on each worker (pid from logs/train.pid), with the last line
# of its log.
#   scripts/tpu_status.sh --name paragan --zone europe-west4-a [--worker all]
source "$(dirname "$0")/tpu_common.sh"
tpu_parse_args "$@"
REMOTE="pid=\$(cat $REMOTE_PID 2>/dev/null || true);"
REMOTE+=" if [ -n \"\$pid\" ] && kill -0 \"\$pid\" 2>/dev/null;"
REMOTE+=" then state=\"running (pid \$pid)\"; else state='not running'; fi;"
REMOTE+=" echo \"\$(hostname): \$state: \$(tail -n 1 $REMOTE_LOG 2>/dev/null)\""
tpu_ssh "$REMOTE"
