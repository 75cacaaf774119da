"""Where pd_fsm keeps what it builds once and reuses: converted weights (``model/weight_cache``)
and compiled executables (``compilation/cache``), under one root that both read."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$PD_FSM_CACHE_DIR``, else ``~/.cache/pd_fsm`` (made if missing)."""
    root = os.environ.get("PD_FSM_CACHE_DIR") or os.path.join(Path.home(), ".cache", "pd_fsm")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
