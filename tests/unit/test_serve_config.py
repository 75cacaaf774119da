"""`pd-fsm serve` / `pd-fsm proxy` flags: every RFC-2 §7 flag reaches the config object, bad
values are refused, and the CLI's light constants match the modules they mirror."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.proxy.cli import parse_prefill
from pd_fsm.io_trio.worker import flags as cfg
from pd_fsm.io_trio.worker.cli import make_backend
from pd_fsm.io_trio.worker.config import ServeConfig, config_from_args


def test_constants_mirror_their_sources() -> None:
    from pd_fsm.jax_engine.model.dummy import SHAPE_NAMES
    from pd_fsm.jax_engine.model.registry import LOAD_FORMATS, MODEL_NAMES
    from pd_fsm.schedulers.args import DISAGGREGATION_MODES, KV_DTYPES
    from pd_fsm.schedulers.disaggregation.args import FAILURE_POLICIES

    assert cfg.MODEL_NAMES == MODEL_NAMES
    assert cfg.LOAD_FORMATS == LOAD_FORMATS and cfg.SHAPE_NAMES == SHAPE_NAMES
    assert cfg.DISAGGREGATION_MODES == DISAGGREGATION_MODES
    assert cfg.FAILURE_POLICIES == FAILURE_POLICIES
    assert cfg.DTYPES == KV_DTYPES


def test_every_flag_reaches_the_config(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    args = build_parser().parse_args([
        "serve", "--model", "tiny", "--host", "127.0.0.1", "--port", "31000",
        "--disaggregation-mode", "decode", "--num-pages", "300", "--page-size", "8",
        "--max-running", "3", "--max-batched-tokens", "512", "--context-length", "900",
        "--disaggregation-bootstrap-host", "10.0.0.1", "--disaggregation-bootstrap-port", "9001",
        "--disaggregation-bootstrap-heartbeat-interval", "2.5",
        "--disaggregation-bootstrap-heartbeat-ttl", "7.5",
        "--disaggregation-transfer-backend", "jax", "--cluster-secret-file", str(secret),
        "--disaggregation-failure-policy", "recompute", "--disaggregation-queue-timeout", "42",
        "--disaggregation-side-channel-port", "7002", "--served-model-name", "m",
        "--warmup", "minimal", "--compilation-cache-dir", str(tmp_path / "xla"),
        "--disaggregation-pull-workers", "4", "--transfer-nice", "-5",
        "--advertise-host", "10.0.0.2", "--disaggregation-kv-checksum",
        "--load-format", "dummy",
    ])
    c = config_from_args(args)
    assert c == ServeConfig(
        host="127.0.0.1", port=31000, advertise_host="10.0.0.2", model="tiny",
        load_format="dummy", served_model_name="m",
        disaggregation_mode="decode", num_pages=300, page_size=8, max_running=3,
        max_batched_tokens=512, context_length=900,
        disaggregation_bootstrap_host="10.0.0.1", disaggregation_bootstrap_port=9001,
        disaggregation_bootstrap_heartbeat_interval=2.5,
        disaggregation_bootstrap_heartbeat_ttl=7.5, disaggregation_transfer_backend="jax",
        cluster_secret_file=secret, disaggregation_failure_policy="recompute",
        disaggregation_queue_timeout=42.0, disaggregation_side_channel_port=7002,
        warmup="minimal", compilation_cache_dir=tmp_path / "xla",
        disaggregation_pull_workers=4, transfer_nice=-5, disaggregation_kv_checksum=True,
        cores_at_start=frozenset(os.sched_getaffinity(0)),
    )
    assert c.cluster_secret() == b"s3cret"
    sa = c.scheduler_args()
    assert (sa.num_pages, sa.page_size, sa.context_length, sa.disaggregation_mode,
            sa.load_format) == (300, 8, 900, "decode", "dummy")
    from pd_fsm.io_trio.worker.pd_backends import disaggregation_args

    da = disaggregation_args(c)
    assert (da.pull_workers, da.pull_thread_nice, da.kv_checksum) == (4, -5, True)
    assert not disaggregation_args(ServeConfig(disaggregation_mode="decode")).kv_checksum


@pytest.mark.parametrize("flags", [
    ["--num-pages", "0"], ["--page-size", "-1"], ["--context-length", "1"], ["--port", "70000"],
    ["--disaggregation-queue-timeout", "0"],
    # A heartbeat every 10 s cannot keep a 15 s registration alive through one lost heartbeat.
    ["--disaggregation-bootstrap-heartbeat-interval", "10"],
    ["--cpus", "one"], ["--cpus", "3-1"], ["--cpus", ""], ["--api-key", ""], ["--api-key", "a b"],
    ["--no-compilation-cache", "--compilation-cache-dir", "/tmp/x"],
    ["--disaggregation-pull-workers", "0"], ["--transfer-nice", "1"], ["--transfer-nice", "-21"],
])
def test_bad_values_refused(flags: list[str]) -> None:
    args = build_parser().parse_args(["serve", "--model", "tiny", *flags])
    with pytest.raises(ValueError):
        config_from_args(args)


@pytest.mark.parametrize(("flags", "reason"), [
    (["--nnodes", "0"], "--nnodes must be >= 1"),
    (["--node-rank", "1"], "for --nnodes > 1"),
    (["--dist-init-addr", "h:1"], "for --nnodes > 1"),
    (["--nnodes", "2", "--tp", "2"], "needs --dist-init-addr HOST:PORT"),
    (["--nnodes", "2", "--tp", "2", "--dist-init-addr", "h:65535"], "PORT < 65535"),
    (["--nnodes", "2", "--tp", "3", "--dist-init-addr", "h:1"], "does not split"),
    (["--nnodes", "2", "--tp", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
     "--node-rank must be in 0..1"),
    (["--nnodes", "2", "--tp", "2", "--dist-init-addr", "h:1", "--disaggregation-kv-checksum"],
     "--disaggregation-kv-checksum is not supported with --nnodes > 1"),
    (["--cpu-pools", "some"], "--cpu-pools must be cpus, all or a thread count >= 1"),
    (["--cpu-pools", "0", "--cpus", "0"], "a thread count >= 1, got '0'"),
    (["--cpu-pools", "1"], "--cpu-pools 1 needs --cpus"),
    (["--cpu-pools", "3", "--cpus", "0-1"], "more threads than --cpus 0-1 has cores"),
])
def test_multi_process_flags_refused_by_name(flags: list[str], reason: str) -> None:
    args = build_parser().parse_args(["serve", "--model", "tiny", *flags])
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        config_from_args(args)


def test_multi_process_flags_reach_the_config() -> None:
    c = config_from_args(build_parser().parse_args([
        "serve", "--model", "tiny", "--tp", "4", "--nnodes", "2", "--node-rank", "1",
        "--dist-init-addr", "10.0.0.1:7000"]))
    assert (c.tp_size, c.nnodes, c.node_rank, c.dist_init_addr) == (4, 2, 1, "10.0.0.1:7000")
    assert c.spmd_addr() == "10.0.0.1:7001"


def test_cpu_pools_of_n_threads_reach_the_config() -> None:
    c = config_from_args(build_parser().parse_args([
        "serve", "--model", "tiny", "--cpus", "0", "--cpu-pools", "1"]))
    assert (c.cpus, c.cpu_pools, c.cores_at_start) == ("0", "1", frozenset(os.sched_getaffinity(0)))


def test_warmup_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_FSM_WARMUP", "full")
    assert config_from_args(build_parser().parse_args(["serve"])).warmup == "full"
    monkeypatch.delenv("PD_FSM_WARMUP")
    assert config_from_args(build_parser().parse_args(["serve"])).warmup == "full"
    monkeypatch.setenv("PD_FSM_WARMUP", "some")  # argparse does not check defaults: we do
    with pytest.raises(ValueError, match="--warmup must be one of full, minimal"):
        config_from_args(build_parser().parse_args(["serve"]))
    monkeypatch.delenv("PD_FSM_WARMUP")
    cfg_off = config_from_args(build_parser().parse_args(["serve", "--no-compilation-cache"]))
    assert not cfg_off.compilation_cache


@pytest.mark.parametrize("flags", [["--model", "gpt-5"], ["--disaggregation-mode", "both"],
                                   ["--disaggregation-failure-policy", "retry"]])
def test_argparse_refuses(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_modes_build_pd_backends(mode: str) -> None:
    from pd_fsm.io_trio.worker.pd_backends import DecodeBackend, PrefillBackend

    backend = make_backend(ServeConfig(model="tiny", disaggregation_mode=mode, port=31234))
    assert isinstance(backend, PrefillBackend if mode == "prefill" else DecodeBackend)
    assert backend.mode == mode and not backend.ready()  # nothing starts before serve()
    assert backend.pd_args.instance_id == f"{mode}-127.0.0.1-31234"


def test_proxy_prefill_args() -> None:
    p = parse_prefill([["http://127.0.0.1:31001", "8998"], ["http://h2:5"], ["http://h3:6",
                                                                              "none"]])
    assert [(t.url, t.bootstrap_host, t.bootstrap_port) for t in p] == [
        ("http://127.0.0.1:31001", "127.0.0.1", 8998), ("http://h2:5", "h2", None),
        ("http://h3:6", "h3", None)]
    for bad in ([["127.0.0.1:1"]], [["http://h:1", "x"]], [["http://h:1", "1", "2"]]):
        with pytest.raises(ValueError):
            parse_prefill(bad)


def test_d2h_transfer_switch_is_read_not_ignored() -> None:
    from pd_fsm.io_trio.worker.config import check_environment

    check_environment({})
    check_environment({"TPU_ENABLE_D2H_TRANSFER": "0"})
    with pytest.raises(ValueError, match="not implemented"):
        check_environment({"TPU_ENABLE_D2H_TRANSFER": "1"})
    with pytest.raises(ValueError, match="must be 0 or 1"):
        check_environment({"TPU_ENABLE_D2H_TRANSFER": "yes"})


def test_bootstrap_takes_the_rfc_ttl_name() -> None:
    args = build_parser().parse_args(["bootstrap", "--disaggregation-bootstrap-heartbeat-ttl", "9"])
    assert args.ttl == 9.0
