"""On-disk cache of converted weights and tokenizer files.

Opening and dequantising the GGUF takes seconds; the converted f32 arrays load from an ``.npz`` in
a fraction of that. Entries are keyed by the source file's name, size and mtime, so a changed source
is converted again. Writes go to a temporary name and are renamed into place, because several test
processes may fill the cache at once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("PD_FSM_CACHE_DIR") or os.path.join(Path.home(), ".cache", "pd_fsm")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def source_key(source: Path) -> str:
    st = source.stat()
    return f"{source.stem}-{st.st_size}-{st.st_mtime_ns}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
