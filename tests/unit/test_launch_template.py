"""deploy/launch_single_node_pd.sh (RFC-2 §4.5's launch template): the four command lines it runs
are ones pd-fsm takes, with P and D each on their chips (their --tp the chip count) and the proxy
routing them."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.cluster.tpu_placement import host_named, placement
from pd_fsm.io_trio.worker.config import config_from_args

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "launch_single_node_pd.sh"


def _dry_run(**env: str) -> list[list[str]]:
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "DRY_RUN": "1", **env}, check=True)
    return [shlex.split(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize(("env", "host", "p_chips", "d_chips"), [
    ({"TPU_HOST": "v6e-8"}, "v6e-8", "0-3", "4-7"),  # the defaults: RFC-2's v6e-8 split
    ({"TPU_HOST": "v5e-4", "P_CHIPS": "0,1", "D_CHIPS": "2-3", "WORKER_ARGS": "--warmup minimal"},
     "v5e-4", "0,1", "2-3"),
])
def test_the_template_runs_what_pd_fsm_takes(env: dict[str, str], host: str, p_chips: str,
                                             d_chips: str) -> None:
    bootstrap, prefill, decode, proxy = _dry_run(**env)
    assert [argv[1] for argv in (bootstrap, prefill, decode, proxy)] == [
        "bootstrap", "serve", "serve", "proxy"]
    parsed = build_parser(bootstrap[1:]).parse_args(bootstrap[1:])
    assert parsed.port == 8000
    for argv, role, chips in ((prefill, "prefill", p_chips), (decode, "decode", d_chips)):
        config = config_from_args(build_parser(argv[1:]).parse_args(argv[1:]))
        assert config.disaggregation_mode == role
        assert config.tpu == placement(chips, host_named(host))
        assert config.tp_size == len(config.tpu.chips)
        assert config.disaggregation_bootstrap_port == 8000
    routed = build_parser(proxy[1:]).parse_args(proxy[1:])
    assert routed.port == 8001
    assert routed.prefill == [["http://127.0.0.1:30000", "9080"]]
    assert routed.decode == ["http://127.0.0.1:30001"]
