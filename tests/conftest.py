"""Shared by every test."""

from __future__ import annotations

import os

# Workers the tests start (in this process or as `pd-fsm serve` children, which inherit the
# environment) run the short warm-up: the full one compiles ~70 executables even for the tiny
# model (33-47 s cold on 2 cores), once per process. tests/integration/test_warmup.py runs the full
# one, the production default, and checks that no request compiles after it.
os.environ.setdefault("PD_FSM_WARMUP", "minimal")
