#!/usr/bin/env bash
# `pd-fsm profile` and bench_kv_legs.py on the TPU machine (the device tool's one v5e chip), in
# one call. That machine has JAX + libtpu but not pd_fsm's other packages, and no index: the
# wheels travel in .whl-tpu/ (device README), installed under /tmp/site. No TCP socket opens
# there: the profile says the loopback pull was not measured, and why.
#   bash bench/tpu_profile.sh [all|profile|legs]     (carry .whl-tpu; default all)
# Outputs in $OUT: profile_tpu_v5e_qwen3-0.6b.json + profile.log, kv_legs.json + kv_legs.log.
#
# Budget, ~9 minutes of the call's 10 (PROFILE_LIMIT 330 s + LEGS_LIMIT 200 s + the install);
# points the profile reaches after PROFILE_BUDGET (250 s) are skipped and named in the file:
# the chip opens in ~10 s a process; a step shape compiles in 15-40 s there (the scheduler's
# loop compiled 7 in 202 s: bench/tpu_runs/2026-12-07/run3_loop.json). The profile's step
# shapes are a 64-row runner's (model_runner.step_shapes): prefill 256 and 1,024 tokens (longer
# prompts run as chunks of 1,024: no new shape), decode 8 and 64 sequences (the context is data,
# not shape); one prompt's prefill runs at 8 sequences (before 2026-12-07 10:00 UTC at 64):
# 4 compiles;
# its KV legs time only the methods P and D run (XLA take, the Pallas scatter). The legs bench
# compiles only copies (seconds each); the XLA methods' run loop gets 5 s to compile in the
# background, else their quick tier is what is timed (the table says which). Each step is cut by
# `timeout` (SIGINT); the legs bench writes its JSON as it goes. Grids by env (below).
#
# Here (no chip), a tiny grid on the CPU, the accelerator's step and pool forced:
#   OUT=/tmp/o JAX_PLATFORMS=cpu PROFILE_MODEL=tiny PROFILE_LOAD=auto PROFILE_PREFILL=16,64 \
#     PROFILE_ROWS=1,4 PROFILE_CONTEXTS=32,128 LEGS_TOKENS=64 LEGS_SHAPES=tiny \
#     PROFILE_EXTRA="--backend accelerator-on-cpu" LEGS_EXTRA=--accelerator-on-cpu \
#     PYTHON=.venv/bin/python bash bench/tpu_profile.sh
set -u
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the outputs}"
# shellcheck source=bench/tpu_env.sh
. "$(dirname "$0")/tpu_env.sh"
PY=${PYTHON:-python3}  # here: PYTHON=.venv/bin/python
MODEL=${PROFILE_MODEL:-qwen3-0.6b}
NAME=${PROFILE_NAME:-profile_tpu_v5e_$MODEL}
PREFILL=${PROFILE_PREFILL:-128,1024,4096,8192}
# The rows of tpu_serve.sh's worker (--max-running 64: decode steps of 8 and 64 sequences), so
# the simulator's validation runs on the steps that worker ran; 64 rows x 2,048 tokens and more
# do not fit the chip's pool at this shape (skipped and named).
ROWS=${PROFILE_ROWS:-1,8,64}
CONTEXTS=${PROFILE_CONTEXTS:-256,1024,2048,8192}
MAX_RUNNING=${PROFILE_MAX_RUNNING:-64}
PROFILE_LEGS=${PROFILE_LEGS_TOKENS:-1024,4096}
LEGS=${LEGS_TOKENS:-1024,4096,16384}
# Qwen3-1.7B's KV is Qwen3-0.6B's (28 layers x 8 KV heads x 128): the same bytes, the same legs.
SHAPES=${LEGS_SHAPES:-qwen3-0.6b,qwen3-4b}
show() { grep -v Warning "$1" | grep -v warnings.warn | cut -c 1-330; }

part=${1:-all}
case "$part" in all|profile|legs) ;; *) echo "usage: $0 [all|profile|legs]"; exit 2 ;; esac

if [ "$part" != legs ]; then
# shellcheck disable=SC2086  # the extra arguments split on purpose
timeout -s INT "${PROFILE_LIMIT:-330}" "$PY" -m pd_fsm.cli profile --model "$MODEL" \
  --load-format "${PROFILE_LOAD:-dummy}" --prefill-tokens "$PREFILL" --decode-rows "$ROWS" \
  --decode-contexts "$CONTEXTS" --max-running "$MAX_RUNNING" --legs-tokens "$PROFILE_LEGS" \
  --copy-mib 1,16,64 --repeats 3 \
  --legs-tier-wait-s 20 --budget-s "${PROFILE_BUDGET:-250}" ${PROFILE_EXTRA:-} \
  --out "$OUT/$NAME.json" > "$OUT/profile.log" 2>&1
echo "profile: rc=$?"; show "$OUT/profile.log"
fi

[ "$part" = profile ] && exit 0

# shellcheck disable=SC2086
timeout -s INT "${LEGS_LIMIT:-200}" "$PY" bench/bench_kv_legs.py --shapes "$SHAPES" \
  --tokens "$LEGS" --repeats 3 --tier-wait-s 5 ${LEGS_EXTRA:-} --json "$OUT/kv_legs.json" \
  > "$OUT/kv_legs.log" 2>&1
echo "kv_legs: rc=$?"; show "$OUT/kv_legs.log"
