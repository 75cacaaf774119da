#!/usr/bin/env bash
# bench/tpu_serve.py on the TPU machine (the device tool's one v5e chip, unix sockets only), in
# the calls it takes there, on one warm machine; wheels and SmolLM2's GGUF in parts as
# bench/tpu_env.sh says:
#   call 1:  bash bench/tpu_serve.sh qwen      (carry .whl-tpu and .gguf-parts/a)
#   call 2:  bash bench/tpu_profile.sh         (carry .gguf-parts/b)
#   call 3:  bash bench/tpu_serve.sh smollm2   (carry .gguf-parts/c; then the one-chip check)
#   call 4:  bash bench/tpu_serve.sh smollm2long  (its mixed set and 7,936-token prompts)
#   later:   bash bench/tpu_serve.sh qwen17    (a fresh machine: carry .whl-tpu)
#            bash bench/tpu_serve.sh switch    (after qwen on the same machine: its compiles)
#            bash bench/tpu_serve.sh ttft      (a TTFT's parts against the prefill alone)
# Each call's records land in $OUT/<call>.tgz (the device tool brings back 8 files at most) and
# its JSONL beside it; bench/RESULTS_tpu.md has what they said.
set -u
# shellcheck source=bench/tpu_env.sh
. "$(dirname "$0")/tpu_env.sh"
: "${OUT:?set OUT to the folder for the outputs}"
run=$OUT/${1:-none}
mkdir -p "$run"
serve() {  # serve LIMIT ARGS...: one tpu_serve.py run, cut at LIMIT seconds
  local limit=$1; shift
  timeout -s INT "$limit" python3 bench/tpu_serve.py --out "${SERVE_OUT:-$run}" "$@" 2>&1 \
    | grep -v Warning | cut -c 1-400
}
pack() {  # the call's folder as one file, its JSONL records beside it
  cp "$run"/*.jsonl "$OUT"/ 2>/dev/null
  tar czf "$run.tgz" -C "$OUT" "$(basename "$run")" && rm -rf "$run"
}
case "${1:-}" in
  qwen)
    serve 560 --model qwen3-0.6b --engine-timeout 260 --seconds 10 --min-prompts 8 \
      --loads "chat:1024:256:2,4,8,12,16:inf" --loads "mixed:2048:512:4,8::0.1" \
      --loads "rag:8192:256:0.5,1,2:" ;;
  smollm2)
    join_gguf || exit 1
    serve 330 --model smollm2 --load-format auto --context-length 2048 --num-pages 6000 \
      --engine-timeout 150 --seconds 10 --loads "chat:1024:256:2,4,8,16:inf" --min-prompts 8
    OUT=$run ONE_CHIP_MODEL=smollm2 ONE_CHIP_LIMIT=300 bash bench/tpu_one_chip_check.sh run | tail -3 | cut -c 1-600 ;;
  smollm2long)  # SmolLM2's mixed set and its longest prompts: 7,936 in + 256 out fill its
    # 8,192-token context (8,192 in does not fit); the GGUF's parts as for smollm2
    join_gguf || exit 1
    serve 560 --model smollm2 --load-format auto --context-length 8192 --num-pages 6000 \
      --engine-loop "" --seconds 10 --min-prompts 8 --loads "mixed:2048:512:4,8::0.1" \
      --loads "rag:7936:256:0.5,1:" ;;
  qwen17)
    serve 560 --model qwen3-1.7b --engine-timeout 280 --seconds 10 --min-prompts 8 \
      --loads "chat:1024:256:1,2,4,8:inf" --loads "mixed:2048:512:2,4::0.1" \
      --loads "rag:8192:256:0.5,1:" ;;
  switch)  # the saturated load again, the worker's GIL switch interval 1 ms (Python's: 5 ms)
    SERVE_OUT=$run/switch1ms PD_FSM_GIL_SWITCH_MS=1 serve 200 --model qwen3-0.6b --engine-loop "" \
      --loads "chat:1024:256::inf" --seed 700 ;;
  ttft)  # a TTFT's parts at low rates (the worker's queue, prefill, delivery), against the
    # prefill step alone in the same call (and the kernel's tests at the block sizes the chip
    # takes); a fresh machine: the server compiles for itself
    timeout -s INT 120 python3 bench/bench_engine.py --no-kernel-check --shapes qwen3-0.6b \
      --chain-shapes "" --rows 1 --contexts 512 --prefills 1024 --no-mixed --repeats 10 \
      --json "$run/prefill_alone.json" > "$run/prefill_alone.log" 2>&1
    grep '"step": "prefill"' "$run/prefill_alone.log" | cut -c 1-300
    timeout -s INT 90 python3 -m pytest -q -p no:cacheprovider tests/unit/test_step_program.py \
      -k "kernel or block" > "$run/kernel_tests.log" 2>&1
    tail -2 "$run/kernel_tests.log" | cut -c 1-300
    serve 280 --model qwen3-0.6b --engine-loop "" --seconds 10 --min-prompts 8 \
      --loads "chat:1024:256:1,2,4:inf" ;;
  *) echo "usage: $0 qwen|smollm2|smollm2long|qwen17|switch|ttft"; exit 2 ;;
esac
pack
