#!/usr/bin/env bash
# bench_engine.py on the TPU machine (the device tool's one v5e chip), in the calls it takes
# there: wheels and SmolLM2's GGUF in parts as bench/tpu_env.sh says.
#   call 1:  bash bench/tpu_engine.sh shapes     (carry .whl-tpu and .gguf-parts/a)
#   call 2:  bash bench/tpu_engine.sh greedy     (carry .gguf-parts/b and c; the same warm machine)
#   or:      bash bench/tpu_engine.sh prefill    (carry .whl-tpu: a prefill's trace by kind)
#            bash bench/tpu_engine.sh tests      (the step's and the KV copies' tests on the chip)
#            bash bench/tpu_engine.sh sizes      (Qwen3-4B, Llama-3.2-3B, SmolLM2's step)
# Figures land in $OUT; bench/RESULTS_tpu.md has what they said.
set -u
# shellcheck source=bench/tpu_env.sh
. "$(dirname "$0")/tpu_env.sh"
run() {  # run NAME SECONDS ARGS...: one bench process, its records in $OUT/NAME.json
  local name=$1 limit=$2; shift 2
  timeout -s INT "$limit" python3 bench/bench_engine.py --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name: rc=$?"; grep -v Warning "$OUT/$name.log" | grep -v warnings.warn | cut -c 1-330
}
case "${1:-}" in
  shapes)
    run qwen 330 --shapes qwen3-0.6b --chain-shapes qwen3-0.6b --rows 1,8,64,256 \
      --contexts 512,2048 --prefills 128,1024,4096 --variants unroll_dma,fused_proj \
      --variants-at 1x512,64x512 --profile-at 1x512,64x2048 --profile-prefill 1024 \
      --trace-dir "$OUT"
    run others 230 --no-kernel-check --shapes llama-3.2-1b,qwen3-1.7b,smollm2 \
      --chain-shapes smollm2 --rows 1,64 --contexts 512,2048 --prefills 1024 --no-mixed ;;
  greedy)
    join_gguf || exit 1
    run greedy 170 --no-kernel-check --shapes "" --greedy-check --greedy-tokens 64
    run loop 230 --no-kernel-check --shapes "" --scheduler qwen3-0.6b --loop-requests 32 \
      --loop-in 1024 --loop-out 128 ;;
  prefill)  # where a prefill's time goes (the trace by kind), the KV write as whole pages (the
    # default) against one scatter row per token, and the layers' weights stacked (~50 arguments
    # a dispatch instead of ~350: the host's share of a step); first a step's inputs as one
    # transfer against seven (bench_step_inputs.py)
    timeout -s INT 60 python3 bench/bench_step_inputs.py --json "$OUT/inputs.json" \
      > "$OUT/inputs.log" 2>&1
    echo "inputs: rc=$?"; grep '^{' "$OUT/inputs.log"
    run prefill 420 --no-kernel-check --shapes qwen3-0.6b --chain-shapes "" \
      --rows 1,64 --contexts 512 --prefills 1024,4096 --no-mixed --profile-prefill 1024 \
      --variants kv_write=scatter,stacked --variants-at 1x512,64x512 ;;
  sizes)  # the shapes not yet measured (Qwen3-4B, Llama-3.2-3B) and SmolLM2's one-row step,
    # each decode point one at a time and overlapped
    run sizes 420 --no-kernel-check --shapes smollm2,qwen3-4b,llama-3.2-3b --chain-shapes "" \
      --rows 1,64 --contexts 512,2048 --prefills 1024 --no-mixed ;;
  tests)  # the step program's and the KV copies' tests, their chip-only ones compiled there
    timeout -s INT 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_step_program.py \
      tests/unit/test_token_write.py tests/unit/test_jax_pallas_copy.py > "$OUT/tests.log" 2>&1
    echo "tests: rc=$?"; tail -5 "$OUT/tests.log" | cut -c 1-330 ;;
  *) echo "usage: $0 shapes|greedy|prefill|tests|sizes"; exit 2 ;;
esac
