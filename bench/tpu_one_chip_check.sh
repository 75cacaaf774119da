#!/usr/bin/env bash
# The one-chip check of docs/tpu_hosts.md on the project's TPU machine (one v5e chip, unix sockets
# only, JAX + libtpu installed but not pd_fsm's other packages): bench/tpu_one_chip_check.py, its
# record in $OUT. What that machine lacks travels as wheels in .whl-tpu/ (device README), made
# here first:
#   here:     bash bench/tpu_one_chip_check.sh wheels   (what pd_fsm runs on, at .venv's
#                                                        versions, JAX's own left out, for
#                                                        CPython 3.11 x86-64, into .whl-tpu/)
#   there:    bash bench/tpu_serve.sh smollm2           (its last step; or alone, SmolLM2's
#                                                        GGUF joined: ONE_CHIP_MODEL=smollm2
#                                                        bash bench/tpu_one_chip_check.sh)
# On a TPU the model must be one the step's attention kernel takes (head_dim 64 or a multiple of
# 128): ONE_CHIP_MODEL=smollm2; the default, the tiny model (head_dim 8), is for a CPU.
# With `pd-fsm serve --uds` in the checkout it checks two serving workers on unix sockets;
# without it, two processes running pd_fsm's scheduler (no HTTP server can listen there). Exit
# status 0 when the check passes.
set -u
cd "$(dirname "$0")/.."
case "${1:-run}" in
  wheels)
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx "/.whl-tpu/" "$exclude" 2>/dev/null || echo /.whl-tpu/ >> "$exclude"
    # The versions this checkout's .venv runs (its tests), JAX's own left out.
    .venv/bin/python bench/tpu_one_chip_check.py --pins > /tmp/pd_fsm_pins.txt || exit 1
    get() {  # one package, as a wheel for that machine (its glibc not known: 2.28 at most)
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl-tpu "$1" 2>/dev/null
    }
    while read -r pin; do  # the venv's version, else the newest one built for that machine
      get "$pin" || { echo "no wheel of $pin for that machine: the newest that is"; get "${pin%%==*}"; } \
        || { echo "no wheel of ${pin%%==*} at all"; exit 1; }
    done < /tmp/pd_fsm_pins.txt
    du -sh .whl-tpu; ls .whl-tpu | wc -l ;;
  run)
    if [ -d .whl-tpu ]; then
      PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl || exit 1
    fi
    export PYTHONPATH=${PYTHONPATH:-}:/tmp/site PYTHONUNBUFFERED=1
    out=${OUT:-/tmp}
    timeout -s INT "${ONE_CHIP_LIMIT:-540}" python3 bench/tpu_one_chip_check.py --json "$out/one_chip.json" \
      > "$out/one_chip.log" 2>&1
    rc=$?
    cat "$out/one_chip.log"
    exit $rc ;;
  *) echo "usage: $0 [run|wheels]"; exit 2 ;;
esac
