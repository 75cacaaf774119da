#!/usr/bin/env bash
# RFC-2 §4.5's minimal deployment, its D3 launch template: one TPU host, four processes. The
# bootstrap server and the proxy hold no chip; P opens chips P_CHIPS and D chips D_CHIPS, each told
# so before JAX starts (`pd-fsm serve --tpu-chips`: TPU_VISIBLE_CHIPS, the bounds and a libtpu port
# of its own, docs/tpu_hosts.md). `pd-fsm cluster` does the same in one command (with its default
# split, P the first half of the chips and D the second); this script is for running the four
# yourself (systemd units, a container each, another launcher): copy it and change what you need.
#
#   deploy/launch_single_node_pd.sh                        # a v6e-8: P on 0-3, D on 4-7
#   TPU_HOST=v5e-4 P_CHIPS=0-1 D_CHIPS=2-3 deploy/launch_single_node_pd.sh
#   DRY_RUN=1 deploy/launch_single_node_pd.sh              # print the commands, start nothing
#
# Ctrl-C or SIGTERM stops all four (SIGTERM: the workers drain); one that exits stops the others
# (exit 1, its log's last lines). Every wait has a deadline (STARTUP_TIMEOUT, STOP_TIMEOUT).
set -euo pipefail

TPU_HOST=${TPU_HOST:-auto}        # `serve --tpu-host`: v4-8, v5e-4, v5e-8, v6e-8, ...; auto: found
P_CHIPS=${P_CHIPS:-0-3}           # `serve --tpu-chips`: 1, 2 or 4 aligned chips, or the host's all
D_CHIPS=${D_CHIPS:-4-7}
# `serve --model`: a checkpoint directory of yours; its kv-heads must divide by each worker's
# chip count (its --tp). The default, tiny, is the random test model (4 kv-heads): it runs anywhere.
MODEL=${MODEL:-tiny}
HOST=${HOST:-127.0.0.1}
# RFC-2 §4.5's ports: bootstrap 8000, proxy 8001, then "+1 per role". KV moves over the transfer
# server of jax.experimental.transfer, whose port each worker picks and registers; libtpu's own
# port is serve's default, 8476 + the first chip (8476 for P, 8480 for D).
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8000}
PROXY_PORT=${PROXY_PORT:-8001}
P_PORT=${P_PORT:-30000}           # HTTP
D_PORT=${D_PORT:-30001}
P_SIDE_PORT=${P_SIDE_PORT:-9080}  # P's ZMQ side channel, its bootstrap port for routers
WORKER_ARGS=${WORKER_ARGS:-}      # more `pd-fsm serve` flags for both workers
LOG_DIR=${LOG_DIR:-./pd-fsm-logs}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}  # seconds for every /health (a model loads, compiles)
STOP_TIMEOUT=${STOP_TIMEOUT:-40}          # seconds after SIGTERM before SIGKILL (a drain: 30)
PD_FSM=${PD_FSM:-pd-fsm}
PYTHON=${PYTHON:-python3}

count_chips() {  # "0-3" -> 4, "4,5" -> 2, "6" -> 1: the worker's --tp (one device per chip)
  local n=0 part
  IFS=, read -ra parts <<< "$1"
  for part in "${parts[@]}"; do
    if [[ $part == *-* ]]; then n=$((n + ${part#*-} - ${part%-*} + 1)); else n=$((n + 1)); fi
  done
  echo "$n"
}

host_flag=()
[ "$TPU_HOST" != auto ] && host_flag=(--tpu-host "$TPU_HOST")
read -ra extra <<< "$WORKER_ARGS"
registry=(--disaggregation-bootstrap-host "$HOST" --disaggregation-bootstrap-port "$BOOTSTRAP_PORT")
names=(bootstrap prefill decode proxy)
declare -A argv_of
argv_of[bootstrap]="$PD_FSM bootstrap --host $HOST --port $BOOTSTRAP_PORT"
argv_of[prefill]="$PD_FSM serve --host $HOST --port $P_PORT --model $MODEL \
--disaggregation-mode prefill ${registry[*]} --disaggregation-side-channel-port $P_SIDE_PORT \
--tpu-chips $P_CHIPS --tp $(count_chips "$P_CHIPS") ${host_flag[*]} ${extra[*]}"
argv_of[decode]="$PD_FSM serve --host $HOST --port $D_PORT --model $MODEL \
--disaggregation-mode decode ${registry[*]} \
--tpu-chips $D_CHIPS --tp $(count_chips "$D_CHIPS") ${host_flag[*]} ${extra[*]}"
argv_of[proxy]="$PD_FSM proxy --host $HOST --port $PROXY_PORT \
--prefill http://$HOST:$P_PORT $P_SIDE_PORT --decode http://$HOST:$D_PORT"
declare -A url_of=([bootstrap]="http://$HOST:$BOOTSTRAP_PORT" [prefill]="http://$HOST:$P_PORT"
                   [decode]="http://$HOST:$D_PORT" [proxy]="http://$HOST:$PROXY_PORT")

if [ -n "${DRY_RUN:-}" ]; then
  for name in "${names[@]}"; do echo "${argv_of[$name]}" | tr -s ' ' | sed 's/ $//'; done
  exit 0
fi

mkdir -p "$LOG_DIR"
declare -A pid_of
stop_all() {  # SIGTERM to each (a worker drains), SIGKILL to those left after STOP_TIMEOUT
  trap - EXIT INT TERM
  local name deadline=$((SECONDS + STOP_TIMEOUT))
  for name in proxy decode prefill bootstrap; do
    [ -n "${pid_of[$name]:-}" ] && kill -TERM "${pid_of[$name]}" 2>/dev/null || true
  done
  for name in "${!pid_of[@]}"; do
    while kill -0 "${pid_of[$name]}" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
    kill -KILL "${pid_of[$name]}" 2>/dev/null || true
  done
}
trap 'stop_all; exit 0' INT TERM
trap stop_all EXIT

healthy() {
  "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
    "$1/health" 2>/dev/null
}

died() {  # died NAME: its exit, its log's last lines, and everything stopped
  echo "launch_single_node_pd: $1 exited; last lines of $LOG_DIR/$1.log:" >&2
  tail -n 20 "$LOG_DIR/$1.log" >&2
  exit 1
}

for name in "${names[@]}"; do
  # shellcheck disable=SC2086  # the command line splits into its words on purpose
  ${argv_of[$name]} > "$LOG_DIR/$name.log" 2>&1 &
  pid_of[$name]=$!
  deadline=$((SECONDS + STARTUP_TIMEOUT))
  until healthy "${url_of[$name]}"; do
    kill -0 "${pid_of[$name]}" 2>/dev/null || died "$name"
    [ $SECONDS -lt $deadline ] || { echo "launch_single_node_pd: $name not healthy after" \
      "$STARTUP_TIMEOUT s" >&2; exit 1; }
    sleep 1
  done
  echo "launch_single_node_pd: $name up at ${url_of[$name]} (log $LOG_DIR/$name.log)"
done
echo "launch_single_node_pd: ready; send requests to ${url_of[proxy]} (Ctrl-C stops all four)"

while true; do  # until a signal, or one of the four exits
  for name in "${names[@]}"; do kill -0 "${pid_of[$name]}" 2>/dev/null || died "$name"; done
  sleep 2
done
