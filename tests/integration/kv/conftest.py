"""One fleet for the KV-format tests of this package (dtype, checksums, streamed parts).

Each module used to start its own (5 or 6 workers, 20-45 s of start-up on 2 cores, most of it
each process importing JAX); they differ only in which flags their pairs have, so one fleet
with every pair serves all three, started once. Real processes, the tiny model,
``failure_support``'s short windows:

- ``p0``, ``d0``, ``c``: no flag (float32 KV) — the plain pair and the reference answers;
- ``pk``, ``dk``: ``--disaggregation-kv-checksum`` (test_kv_checksum.py, and with ``psk`` the
  checksummed parts of test_streamed_kv.py);
- ``ps``: ``--disaggregation-stream-tokens 8``; ``psk``: the same with checksums;
- ``p16``, ``d16``, ``c16``: ``--kv-dtype bfloat16`` (test_kv_dtype.py).

Every test ends with the workers it used holding nothing (``wait_clean``, or ``refused_by_name``
which waits for it) and compares counters before and after itself, so the next test starts
from a clean fleet; a test that reads the registry picks its own P's records out by address.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.failure_support import Fleet

CHECKSUM = ["--disaggregation-kv-checksum"]
STREAM = ["--disaggregation-stream-tokens", "8"]  # 2 pages of the tiny model's 4 tokens
BF16 = ["--kv-dtype", "bfloat16"]


@pytest.fixture(scope="package")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("kv"))
    f.bootstrap()
    f.prefill("p0")
    f.decode("d0")
    f.colocated("c")
    f.prefill("pk", extra=CHECKSUM)
    f.decode("dk", extra=CHECKSUM)
    f.prefill("ps", extra=STREAM)
    f.prefill("psk", extra=[*STREAM, *CHECKSUM])
    f.prefill("p16", extra=BF16)
    f.decode("d16", extra=BF16)
    f.colocated("c16", extra=BF16)
    f.start()
    yield f
    f.close()
