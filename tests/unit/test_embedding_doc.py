"""docs/embedding.md is executed: its code blocks run in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"


def test_embedding_doc_runs(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 2
    namespace: dict[str, object] = {"__name__": "embedding_doc"}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "P: leg of room 5882942782861604684 answered" in out
    assert "wake P at 31.0" in out
    assert "lease expired" in out
