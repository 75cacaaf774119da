"""The one-chip check of docs/tpu_hosts.md, for the project's TPU machine (one v5e chip, unix
sockets only, one program at a time on the chip): a worker told ``--tpu-chips 0`` runs on the
chip while a second process told ``--tpu-chips none`` runs on the CPU beside it, both serving at
once; a third process told nothing, started while the chip is held, fails on libtpu's lockfile
(what the two would do to each other without the flags).

Two ways, by what the checkout has:

- serving (``pd-fsm serve --uds``, issue 61): two real workers on unix sockets, each's
  ``/server_info`` (its chips, libtpu's variables as it has them, the devices JAX sees) and
  ``/generate`` requests to both at the same time;
- engine (without ``--uds``: no HTTP server can listen on that machine): two processes that set
  their chips exactly as ``serve`` does (``tpu_placement.placement(...).apply``) and run pd_fsm's
  scheduler on the tiny model, requests in a loop, at the same time.

Prints one JSON line per event and the verdict (``ONE-CHIP CHECK: PASS`` / ``FAIL: ...``), writes
the whole record to ``--json``; exit status 0 on a pass. bench/tpu_one_chip_check.sh runs it
there. Every wait has a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

START_S = 240.0  # a program opens the chip in ~15 s there; the tiny model compiles after
PLAIN_S = 120.0
# On a TPU the step's attention kernel takes head_dim 64 or multiples of 128 (the tiny model's is
# 8): there SmolLM2 (its GGUF joined by tpu_env.sh), the smallest model the kernel takes.
MODEL_FLAGS = (["--model", "smollm2", "--num-pages", "64",
                "--page-size", "16", "--context-length", "256", "--max-running", "2"]
               if os.environ.get("ONE_CHIP_MODEL") == "smollm2" else
               ["--model", "tiny", "--num-pages", "64", "--page-size", "4",
                "--context-length", "256", "--max-running", "2"])


def emit(record: dict[str, Any], what: str, seen: dict[str, Any] | None = None,
         **fields: Any) -> None:
    """One line of the record: ``what`` happened, and what a process said (``seen``)."""
    line = {"check": what, "t": round(time.time(), 3), **fields, "seen": seen}
    record.setdefault("events", []).append(line)
    print(json.dumps(line), flush=True)


# ------------------------------------------------------------------- the engine's children


def child(kind: str, host: str, stop: Path, until: float) -> None:
    """One process of the engine way: its chips as ``serve`` sets them, then the scheduler on
    the tiny model, one request after another until the file ``stop`` exists (or, at the
    latest, ``until``: wall clock)."""
    from pd_fsm.io_trio.cluster.tpu_placement import host_named, placement

    if kind != "plain":
        tpu = placement("0" if kind == "chip" else "none", host_named(host))
        tpu.apply(os.environ)
        print(json.dumps({"event": "placed", "how": tpu.describe(), "env": tpu.env()}),
              flush=True)
    import jax

    try:
        devices = [f"{d.platform}:{d.device_kind}" for d in jax.local_devices()]
    except RuntimeError as exc:  # the plain process, while the chip is held
        print(json.dumps({"event": "refused", "error": str(exc)[:500]}), flush=True)
        return
    print(json.dumps({"event": "devices", "devices": devices}), flush=True)
    if kind == "plain":
        return
    from pd_fsm.jax_engine.sampling.params import SamplingParams
    from pd_fsm.schedulers.args import SchedulerArgs
    from pd_fsm.schedulers.scheduler import Scheduler

    sched = Scheduler(SchedulerArgs(model="tiny", num_pages=64, page_size=4, max_running=2,
                                    context_length=256))
    first, n, tokens = time.time(), 0, 0
    while n == 0 or (not stop.exists() and time.time() < until):
        sched.add_request(sched.make_request(f"r{n}", "one chip, two processes", SamplingParams(
            max_new_tokens=16, temperature=0.0, ignore_eos=True)))
        while sched.has_work():
            tokens += sum(len(o.new_token_ids) for o in sched.step())
        n += 1
    print(json.dumps({"event": "served", "requests": n, "tokens": tokens, "first": first,
                      "last": time.time()}), flush=True)


class Proc:
    """A child whose JSON lines are read by a thread (the other lines kept for the record)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name, self.events, self.other = name, [], []
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env={**os.environ, **(env or {})}, cwd=ROOT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    events: list[dict[str, Any]]
    other: list[str]

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                self.other.append(line.rstrip())
                continue
            if isinstance(event, dict) and "event" in event:
                self.events.append(event)
            else:
                self.other.append(line.rstrip())

    def wait_event(self, names: tuple[str, ...], timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((e for e in self.events if e["event"] in names), None)
            if found is not None or self.popen.poll() is not None:
                time.sleep(0.2)  # the reader takes its last lines
                return next((e for e in self.events if e["event"] in names), None)
            time.sleep(0.2)
        return None

    def stop(self, grace: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._reader.join(5)
        return self.popen.returncode


def engine_way(record: dict[str, Any], host: str, hold: float) -> dict[str, Any]:
    stop = Path(tempfile.mkdtemp(prefix="pdfsm-chip-")) / "stop"
    me = [sys.executable, str(Path(__file__).resolve()), "--host", host, "--stop", str(stop),
          "--until", str(time.time() + 2 * START_S + hold)]
    chip, cpu = (Proc(kind, [*me, "--child", kind]) for kind in ("chip", "cpu"))
    out: dict[str, Any] = {}
    try:
        for proc in (chip, cpu):
            out[f"{proc.name}_devices"] = proc.wait_event(("devices", "refused"), START_S)
            emit(record, f"{proc.name} process", out[f"{proc.name}_devices"])
        out["plain"] = _plain(record, me)
        time.sleep(hold)  # both serving meanwhile (each once its model is built)
        stop.touch()
        for proc in (chip, cpu):
            out[f"{proc.name}_served"] = proc.wait_event(("served",), START_S + hold + 60)
            emit(record, f"{proc.name} served", out[f"{proc.name}_served"])
    finally:
        for proc in (chip, cpu):
            out[f"{proc.name}_exit"] = proc.stop()
            out[f"{proc.name}_events"] = proc.events  # its placement's variables among them
            out[f"{proc.name}_log"] = proc.other[-15:]
    return out


def _plain(record: dict[str, Any], me: list[str]) -> dict[str, Any] | None:
    """A process told nothing, started while the chip is held: what JAX tells it."""
    plain = Proc("plain", [*me, "--child", "plain"])
    found = plain.wait_event(("devices", "refused"), PLAIN_S)
    code = plain.stop()
    if found is None and code not in (0, None, -15):
        # libtpu may end the process itself rather than raise: refused all the same.
        found = {"event": "refused", "exit": code, "error": " | ".join(plain.other[-5:])}
    emit(record, "plain process (told nothing) while the chip is held", found,
         log=plain.other[-5:])
    return found


# ------------------------------------------------------------------- the serving way


def serve_supports_uds() -> bool:
    done = subprocess.run([sys.executable, "-m", "pd_fsm.cli", "serve", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    return done.returncode == 0 and "--uds" in done.stdout


def serving_way(record: dict[str, Any], host: str, hold: float) -> dict[str, Any]:
    import httpx

    folder = Path(tempfile.mkdtemp(prefix="pdfsm-chip-"))
    serve = [sys.executable, "-m", "pd_fsm.cli", "serve", *MODEL_FLAGS, "--warmup", "minimal",
             "--host-heap", "default", "--log-level", "INFO"]
    workers = {"chip": Proc("chip", [*serve, "--uds", str(folder / "chip.sock"),
                                     "--tpu-chips", "0", "--tpu-host", host]),
               "cpu": Proc("cpu", [*serve, "--uds", str(folder / "cpu.sock"),
                                   "--tpu-chips", "none"])}
    clients = {name: httpx.Client(base_url="http://localhost", timeout=60,
                                  transport=httpx.HTTPTransport(uds=str(folder / f"{name}.sock")))
               for name in workers}
    out: dict[str, Any] = {}
    try:
        for name in workers:
            out[f"{name}_info"] = _healthy_info(clients[name], workers[name], START_S)
            emit(record, f"{name} worker", out[f"{name}_info"])
        out["plain"] = _plain(record, [sys.executable, str(Path(__file__).resolve())])
        results: dict[str, Any] = {}
        threads = [threading.Thread(target=_loop, args=(clients[n], hold, results, n))
                   for n in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(hold + 120)
        for name in workers:
            out[f"{name}_served"] = results.get(name)
            emit(record, f"{name} served", results.get(name))
    finally:
        for name, proc in workers.items():
            clients[name].close()
            out[f"{name}_exit"] = proc.stop()
            out[f"{name}_log"] = proc.other[-15:]
    return out


def _healthy_info(client: Any, proc: Proc, timeout: float) -> dict[str, Any] | None:
    """Its /server_info's tpu and devices once /health answers 200 (None past ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.popen.poll() is None:
        try:
            if client.get("/health").status_code == 200:
                info = client.get("/server_info").json()
                devices = [f"{d['platform']}:{d['kind']}" for d in info["devices"] or []]
                return {"tpu": info["tpu"], "devices": devices}
        except Exception:  # not listening yet
            pass
        time.sleep(1)
    return None


def _loop(client: Any, hold: float, results: dict[str, Any], name: str) -> None:
    first, n, tokens, errors = time.time(), 0, 0, []
    while n == 0 or time.time() < first + hold:
        r = client.post("/generate", json={"text": "one chip, two processes", "sampling_params": {
            "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
        if r.status_code != 200:
            errors.append(f"{r.status_code} {r.text[:200]}")
            break
        tokens += r.json()["meta_info"]["completion_tokens"]
        n += 1
    results[name] = {"requests": n, "tokens": tokens, "first": first, "last": time.time(),
                     "errors": errors}


# ------------------------------------------------------------------- the verdict


def verdict(out: dict[str, Any]) -> list[str]:
    """What failed (empty: the check passed)."""
    problems = []
    chip, cpu = (out.get(f"{n}_devices") or out.get(f"{n}_info") or {} for n in ("chip", "cpu"))
    if not any(d.startswith("tpu:") for d in chip.get("devices", [])):
        problems.append(f"the chip process saw no TPU: {chip}")
    if not cpu.get("devices") or any(not d.startswith("cpu:") for d in cpu["devices"]):
        problems.append(f"the no-chip process did not run on the CPU alone: {cpu}")
    served = [out.get(f"{n}_served") or {} for n in ("chip", "cpu")]
    if not all(s.get("tokens") and not s.get("errors") for s in served):
        problems.append(f"not both served: {served}")
    elif min(s["last"] for s in served) <= max(s["first"] for s in served):
        problems.append(f"they did not run at the same time: {served}")
    if (out.get("plain") or {}).get("event") != "refused":
        problems.append(f"a process told nothing was not refused the held chip: {out.get('plain')}")
    return problems


def pins() -> list[str]:
    """``name==version`` of every package pd_fsm needs at run time, as this environment has them
    (the closure of its requirements), JAX's own left out: what travels to that machine."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    todo = ["pd_fsm"]
    while todo:
        dist = metadata.distribution(todo.pop())
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = req.name.lower().replace("_", "-")
            if name not in seen:
                seen[name] = metadata.version(req.name)
                todo.append(req.name)
    skip = {"jax", "jaxlib", "numpy", "scipy", "ml-dtypes", "opt-einsum"}  # there already
    return [f"{name}=={version}" for name, version in sorted(seen.items()) if name not in skip]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="v5e-1", help="the TPU host's type (--tpu-host)")
    parser.add_argument("--hold", type=float, default=20.0,
                        help="seconds both serve requests at the same time")
    parser.add_argument("--json", type=Path, default=None, help="the whole record, as JSON")
    parser.add_argument("--way", choices=("auto", "serving", "engine"), default="auto")
    parser.add_argument("--child", choices=("chip", "cpu", "plain"), help=argparse.SUPPRESS)
    parser.add_argument("--stop", type=Path, default=Path("/nonexistent"), help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--pins", action="store_true",
                        help="print the packages to carry there (name==version), and stop")
    args = parser.parse_args()
    if args.pins:
        print("\n".join(pins()))
        return 0
    if args.child:
        child(args.child, args.host, args.stop, args.until)
        return 0
    from pd_fsm.io_trio.cluster.tpu_placement import detect_host

    record: dict[str, Any] = {}
    try:
        found = detect_host(os.environ)
    except ValueError as exc:
        found = None
        emit(record, "host not found", error=str(exc))
    way = args.way if args.way != "auto" else ("serving" if serve_supports_uds() else "engine")
    emit(record, "start", way=way, host=args.host, detected=found and found.name,
         inherited={k: v for k, v in os.environ.items() if k.startswith(("TPU_", "JAX_"))})
    out = (serving_way if way == "serving" else engine_way)(record, args.host, args.hold)
    problems = verdict(out)
    record.update(out=out, problems=problems)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1, default=str))
    print("ONE-CHIP CHECK: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)),
          flush=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
