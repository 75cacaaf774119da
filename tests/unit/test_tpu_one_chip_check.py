"""bench/tpu_one_chip_check.py's verdict, which only the one-chip machine can give for real: it
passes only when the chip process saw the TPU, the other only the CPU, both served at the same
time, and a process told nothing was refused the held chip; and what it carries there is what
pd_fsm runs on, JAX's own left out."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import tpu_one_chip_check as check  # bench/, not a package: found by the path above


def _passing() -> dict[str, Any]:
    return {
        "chip_info": {"tpu": {"chips": [0]}, "devices": ["tpu:TPU v5 lite"]},
        "cpu_info": {"tpu": {"chips": []}, "devices": ["cpu:cpu"]},
        "plain": {"event": "refused", "error": "Internal error when accessing libtpu "
                                                "multi-process lockfile"},
        "chip_served": {"tokens": 160, "first": 10.0, "last": 30.0, "errors": []},
        "cpu_served": {"tokens": 320, "first": 11.0, "last": 31.0, "errors": []},
    }


def test_a_passing_run_passes() -> None:
    assert check.verdict(_passing()) == []
    engine = {k.replace("_info", "_devices"): v for k, v in _passing().items()}
    assert check.verdict(engine) == []  # the engine way's records


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("chip_info", {"devices": ["cpu:cpu"]}, "the chip process saw no TPU"),
    ("cpu_info", {"devices": ["tpu:TPU v5 lite"]}, "the no-chip process did not run on the CPU"),
    ("cpu_info", None, "the no-chip process did not run on the CPU"),
    ("plain", {"event": "devices", "devices": ["cpu:cpu"]},
     "a process told nothing was not refused"),
    ("plain", None, "a process told nothing was not refused"),
    ("cpu_served", {"tokens": 0, "first": 11.0, "last": 31.0, "errors": []}, "not both served"),
    ("chip_served", {"tokens": 16, "first": 10.0, "last": 30.0, "errors": ["503 busy"]},
     "not both served"),
    ("cpu_served", {"tokens": 16, "first": 30.5, "last": 40.0, "errors": []},
     "they did not run at the same time"),
])
def test_each_failure_is_named(key: str, value: Any, problem: str) -> None:
    out = {**_passing(), key: value}
    problems = check.verdict(out)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_what_travels_is_pd_fsm_s_packages_without_jax() -> None:
    pins = dict(line.split("==") for line in check.pins())
    assert {"trio", "httpx", "starlette", "hypercorn", "attrs", "tokenizers"} <= set(pins)
    assert not {"jax", "jaxlib", "numpy"} & set(pins)
