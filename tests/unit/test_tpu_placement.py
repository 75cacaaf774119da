"""TPU chips per process (``serve --tpu-chips``): the environment computed for every chip set of
every supported host, against a geometric model of the host written here (which sets are
sub-meshes, and their shapes); the values of the RFC-2 §4.5 split spelled out; what is refused,
and how the host is found."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.cluster.tpu_placement import (
    HOSTS,
    TPU_VARIABLES,
    TpuHost,
    check_disjoint,
    default_split,
    detect_host,
    divide,
    host_named,
    placement,
)
from pd_fsm.io_trio.worker.config import config_from_args

# -------------------------------------------------------------------- the model, written again

# Where chip i sits, (x, y), as the documented configurations place them (tpu_placement's
# docstring): on a 4-chip host the pairs {0,1} and {2,3} are columns (1x2 each, side by side
# along x); on an 8-chip host the quads {0-3} and {4-7} are 2x2 squares stacked along y.
def _coords(chips: int, i: int) -> tuple[int, int]:
    if chips == 1:
        return (0, 0)
    quad, j = divmod(i, 4)
    return (j // 2, j % 2 + 2 * quad)


def _sub_mesh(host: TpuHost, chips: frozenset[int]) -> str | None:
    """The shape ("x,y,1") of ``chips`` if it is an aligned box of 1x1, 1x2 or 2x2 chips of the
    host, "whole" for every chip; None: not a process's chip set."""
    if chips == frozenset(range(host.chips)):
        return "whole"
    points = {_coords(host.chips, i) for i in chips}
    xs, ys = {x for x, _ in points}, {y for _, y in points}
    width, height = max(xs) - min(xs) + 1, max(ys) - min(ys) + 1
    if len(points) != width * height or (width, height) not in ((1, 1), (1, 2), (2, 2)):
        return None
    if min(xs) % width or min(ys) % height:
        return None
    return f"{width},{height},1"


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_every_chip_set_of_every_host_is_taken_or_refused_as_the_geometry_says(
        name: str) -> None:
    host = HOSTS[name]
    for size in range(1, host.chips + 1):
        for combo in itertools.combinations(range(host.chips), size):
            chips = frozenset(combo)
            spec = ",".join(map(str, combo))
            shape = _sub_mesh(host, chips)
            if shape is None:
                with pytest.raises(ValueError, match="is not a sub-mesh of a"):
                    placement(spec, host)
                continue
            env = placement(spec, host).env()
            if shape == "whole":
                assert env == {}, (name, spec)  # libtpu's own settings stand
                continue
            port = str(8476 + min(chips))
            assert env == {
                "TPU_VISIBLE_CHIPS": spec, "TPU_CHIPS_PER_PROCESS_BOUNDS": shape,
                "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": port,
                "TPU_PROCESS_ADDRESSES": f"localhost:{port}", "CLOUD_TPU_TASK_ID": "0",
                "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}",
                "TPU_MESH_CONTROLLER_PORT": port, "TPU_VISIBLE_DEVICES": spec,
                "TPU_CHIPS_PER_HOST_BOUNDS": shape, "TPU_HOST_BOUNDS": "1,1,1",
            }, (name, spec)


def test_rfc2_split_of_a_v6e_8_spelled_out() -> None:
    host = host_named("v6e-8")
    p, d = placement("0-3", host).env(), placement("4,5,6,7", host).env()
    assert (p["TPU_VISIBLE_CHIPS"], p["TPU_CHIPS_PER_PROCESS_BOUNDS"], p["TPU_PROCESS_PORT"]) == (
        "0,1,2,3", "2,2,1", "8476")
    assert (d["TPU_VISIBLE_CHIPS"], d["TPU_CHIPS_PER_PROCESS_BOUNDS"], d["TPU_PROCESS_PORT"]) == (
        "4,5,6,7", "2,2,1", "8480")
    assert p["TPU_PROCESS_BOUNDS"] == d["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert set(p) == set(d) == set(TPU_VARIABLES)
    assert placement("6-7", host, port=9000).env()["TPU_PROCESS_ADDRESSES"] == "localhost:9000"


@pytest.mark.parametrize(("host", "chips", "message"), [
    ("v6e-8", "8", "a v6e-8 (8 chips, 2x4) has chips 0-7, not 8"),
    ("v5e-4", "2-5", "has chips 0-3, not 4, 5"),
    ("v6e-8", "1-2", "1-2 is not a sub-mesh of a v6e-8 (8 chips, 2x4): a process takes 1, 2 or "
                     "4 consecutive chips starting at a multiple of that count, or the whole "
                     "host (0 1 2 3 4 5 6 7 0-1 2-3 4-5 6-7 0-3 4-7 0-7)"),
    ("v6e-8", "2-5", "2-5 is not a sub-mesh"),
    ("v4-8", "0,2", "0,2 is not a sub-mesh of a v4-8"),
    ("v5e-4", "0-2", "0-2 is not a sub-mesh"),
    ("v6e-8", "0-5", "0-5 is not a sub-mesh"),
    ("v6e-8", "3-x", "--tpu-chips '3-x': '3-x' is not an id or a range"),
])
def test_chips_that_are_no_sub_mesh_are_refused_by_name(host: str, chips: str,
                                                         message: str) -> None:
    with pytest.raises(ValueError) as err:
        placement(chips, host_named(host))
    assert message in str(err.value)


def test_no_chip_keeps_the_process_off_every_chip() -> None:
    none = placement("none", None)
    assert none.env() == {"JAX_PLATFORMS": "cpu"} and none.chips == frozenset()
    with pytest.raises(ValueError, match="needs the TPU host's type"):
        placement("0", None)


def test_hosts_by_name() -> None:
    assert host_named("v5litepod-8") == host_named("v5e-8") == HOSTS["v5e-8"]
    assert host_named("V6E-4").chips == 4 and host_named("v4-8").chips == 4
    with pytest.raises(ValueError, match="'v5p-8': not a TPU host pd_fsm knows"):
        host_named("v5p-8")
    with pytest.raises(ValueError, match="v6e-16"):
        host_named("v6e-16")  # a host of a multi-host slice


def _pci(root: Path, devices: list[tuple[str, str]]) -> Path:
    for i, (vendor, device) in enumerate(devices):
        folder = root / "bus" / "pci" / "devices" / f"0000:00:{i:02x}.0"
        folder.mkdir(parents=True)
        (folder / "vendor").write_text(vendor + "\n")
        (folder / "device").write_text(device + "\n")
    return root


@pytest.mark.parametrize(("devices", "found"), [
    ([("0x1ae0", "0x006f")] * 8, "v6e-8"),
    ([("0x1ae0", "0x0063")] * 4 + [("0x8086", "0x0063")], "v5e-4"),  # not Google's: not a TPU
    ([("0x1ae0", "0x0063")], "v5e-1"),
    ([("0x1ae0", "0x005e")] * 4, "v4-8"),  # v4's types count TensorCores
    ([("0x1ae0", "0x0001"), ("0x10de", "0x2330")], None),
])
def test_the_host_is_found_on_its_pci_bus(tmp_path: Path, devices: list[tuple[str, str]],
                                          found: str | None) -> None:
    host = detect_host({}, _pci(tmp_path, devices))
    assert (None if host is None else host.name) == found


def test_gke_names_the_host_and_odd_buses_are_refused(tmp_path: Path) -> None:
    root = _pci(tmp_path, [("0x1ae0", "0x006f")] * 2)
    assert detect_host({"TPU_ACCELERATOR_TYPE": "v5litepod-8"}, root) == HOSTS["v5e-8"]
    with pytest.raises(ValueError, match="'v6e-2': not a TPU host"):
        detect_host({}, root)
    mixed = _pci(tmp_path / "mixed", [("0x1ae0", "0x006f"), ("0x1ae0", "0x0063")])
    with pytest.raises(ValueError, match="TPUs of several kinds"):
        detect_host({}, mixed)


def test_p_and_d_split_a_host_as_rfc2_places_them() -> None:
    v6e8, v5e4 = host_named("v6e-8"), host_named("v5e-4")
    assert default_split(v6e8, 1, 1) == {"prefill": [frozenset(range(4))],
                                         "decode": [frozenset(range(4, 8))]}
    assert default_split(v6e8, 2, 4) == {
        "prefill": [frozenset({0, 1}), frozenset({2, 3})],
        "decode": [frozenset({4}), frozenset({5}), frozenset({6}), frozenset({7})]}
    assert default_split(v5e4, 1, 2) == {"prefill": [frozenset({0, 1})],
                                         "decode": [frozenset({2}), frozenset({3})]}
    with pytest.raises(ValueError, match="4 chips do not split evenly into 3 workers"):
        default_split(v6e8, 3, 1)
    with pytest.raises(ValueError, match="cannot hold both P and D"):
        default_split(host_named("v5e-1"), 1, 1)
    with pytest.raises(ValueError, match=r"--decode-chips \(a worker's share\) 1-2 is not a"):
        divide(v6e8, frozenset(range(1, 7)), 3, "--decode-chips")


def test_two_workers_never_share_a_chip() -> None:
    check_disjoint({"prefill-0": frozenset({0, 1}), "decode-0": frozenset({2, 3})})
    with pytest.raises(ValueError, match="chip 3 is given to both prefill-0 and decode-0"):
        check_disjoint({"prefill-0": frozenset(range(4)), "decode-0": frozenset({3})})


# -------------------------------------------------------------------- serve's flags


def _serve(*flags: str) -> object:
    args = build_parser(["serve"]).parse_args(["serve", "--model", "tiny", *flags])
    return config_from_args(args).tpu


def test_serve_takes_chips_that_fit_and_tp_equal_to_them() -> None:
    tpu = _serve("--tpu-chips", "4-7", "--tpu-host", "v6e-8", "--tp", "4", "--tpu-port", "9100")
    assert tpu == placement("4-7", host_named("v6e-8"), 9100)
    assert _serve() is None
    assert _serve("--tpu-chips", "none") == placement("none", None)
    whole = _serve("--tpu-chips", "0", "--tpu-host", "v5litepod-1")
    assert whole == placement("0", host_named("v5e-1")) and whole.env() == {}


@pytest.mark.parametrize(("flags", "message"), [
    (["--tpu-chips", "0-3", "--tpu-host", "v6e-8"],
     "--tp 1 does not match --tpu-chips 0-3: 4 chip(s) of a v6e-8, one device each: give --tp 4"),
    (["--tpu-chips", "0-1", "--tpu-host", "v6e-8", "--tp", "4"], "--tp 4 does not match"),
    (["--tpu-chips", "1-2", "--tpu-host", "v6e-8", "--tp", "2"], "is not a sub-mesh"),
    (["--tpu-chips", "0-3", "--tpu-host", "v5e-4", "--tp", "4", "--tpu-port", "9000"],
     "--tpu-port: --tpu-chips 0-3 is the whole host, which needs no port"),
    (["--tpu-chips", "none", "--tpu-port", "9000"], "is no chip, which needs no port"),
    (["--tpu-host", "v6e-8"], "--tpu-host and --tpu-port go with --tpu-chips"),
    (["--tpu-chips", "0-1", "--tpu-host", "v6e-8", "--tp", "2", "--nnodes", "2",
      "--dist-init-addr", "127.0.0.1:9999"], "--tpu-chips is for a one-process worker"),
    (["--tpu-chips", "0", "--tpu-host", "v7x-8"], "'v7x-8': not a TPU host pd_fsm knows"),
])
def test_serve_refuses_chips_that_do_not_fit(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError) as err:
        _serve(*flags)
    assert message in str(err.value)


def test_serve_on_a_host_with_no_tpu_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    if detect_host({}) is not None:
        pytest.skip("this machine has TPUs")
    with pytest.raises(ValueError, match=r"no TPU found on this host .* --tpu-host"):
        _serve("--tpu-chips", "0")
