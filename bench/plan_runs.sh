#!/bin/bash
# Regenerates the figures of bench/RESULTS_plan.md: `pd-fsm plan` on a profile, every run's
# output to bench/plan_runs/, the plots to bench/plots/plan_*.png. Usage:
#   bash bench/plan_runs.sh [PROFILE] [TAG]
# (default: the DERIVED profile bench/tpu_v5e_profile_derived.json, tag "derived"; give the
# measured profile and another tag to rerun on it). Each run is niced and takes the CPU lock.
# ONLY="chat-8 rag-8 ..." runs just those names (the rest takes ~20 runs of 1-3 min of CPU each).
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:-bench/tpu_v5e_profile_derived.json}
TAG=${2:-derived}
OUT=bench/plan_runs/$TAG
mkdir -p "$OUT"
run() {  # NAME ARGS...
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  echo "== $name: pd-fsm plan --profile $PROFILE $*" | tee "$OUT/$name.txt"
  flock /tmp/pdfsm-cpu.lock nice -n 5 .venv/bin/pd-fsm plan --profile "$PROFILE" "$@" \
    >> "$OUT/$name.txt" 2>&1
}
for w in chat rag reasoning; do
  run "$w-8" --chips 8 --workload "$w" --plot "plan_${TAG}_${w}_8"
  run "$w-8-worst" --chips 8 --workload "$w" --itl-measure worst --plot "plan_${TAG}_${w}_8_worst"
done
for w in chat rag; do
  run "$w-8-mixed" --chips 8 --workload "$w" --mixed-extra 0.52
  for n in 64 256; do
    run "$w-$n" --chips "$n" --workload "$w"
    run "$w-$n-worst" --chips "$n" --workload "$w" --itl-measure worst
  done
done
run chat-64-cell16-worst --chips 64 --cell 16 --workload chat --itl-measure worst
run rag-8-link10 --chips 8 --workload rag --net-gbps 10
run rag-8-ici --chips 8 --workload rag --kv-path ici
run rag-8-v6e --chips 8 --host v6e-8 --workload rag
