"""Shared by every test."""

from __future__ import annotations

import importlib.util
import os

# Workers the tests start (in this process or as `pd-fsm serve` children, which inherit the
# environment) run the short warm-up: the full one compiles ~70 executables even for the tiny
# model (33-47 s cold on 2 cores), once per process. tests/integration/test_warmup.py runs the full
# one, the production default, and checks that no request compiles after it.
os.environ.setdefault("PD_FSM_WARMUP", "minimal")

# On a TPU (where libtpu is installed), float32 matrix products run at full precision, as on a
# CPU: the reference tests compare the model's math with float64 numpy to 1e-4, which a TPU's
# default (bfloat16 passes) misses by up to 0.07 (seen on a v5e). Set before JAX is imported.
if importlib.util.find_spec("libtpu") is not None:
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
