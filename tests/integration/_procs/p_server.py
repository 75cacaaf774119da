"""A prefill-side process for the transfer tests: a JaxTransferKVEngine serving pools with known
contents. Line protocol: one JSON command per stdin line, one JSON reply per stdout line."""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.kv.room import gather_room
from pd_fsm.jax_engine.transfer import JaxTransferKVEngine, ReleaseResult
from tests.integration._procs import pools


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the protocol stream
    seed = int(sys.argv[1])
    names = sys.argv[2].split(",")
    released: list[dict[str, Any]] = []

    def on_release(r: ReleaseResult) -> None:
        released.append(attrs.asdict(r))

    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=0.1, on_release=on_release)
    holder = KVCacheHolder({n: pools.pool_jax(n, seed) for n in names})
    args = pools.kv_args(names)

    def reply(**kw: Any) -> None:
        out.write(json.dumps(kw) + "\n")
        out.flush()

    reply(address=engine.address, layout_hash=args.layout_hash, pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "register":
            arrays = gather_room(holder, args, cmd["pages"])
            engine.register(cmd["uuid"], arrays, cmd["lease_s"])
            reply(ok=True, nbytes=sum(int(a.nbytes) for a in arrays))
        elif op == "register_big":
            n = cmd["mib"] << 18  # float32 elements
            big = jax.jit(lambda n=n: jnp.full((n,), 3.0, jnp.float32))()
            big.block_until_ready()
            engine.register(cmd["uuid"], [big], cmd["lease_s"])
            del big  # from here only the transfer server's table keeps it alive
            gc.collect()
            reply(ok=True, rss_kib=rss_kib())
        elif op == "release":
            reply(**attrs.asdict(engine.release(cmd["uuid"], "test")))
        elif op == "status":
            gc.collect()
            reply(rss_kib=rss_kib(), registrations=list(engine.registrations()),
                  released=released)
        elif op == "quit":
            engine.close()
            reply(ok=True)
            return


if __name__ == "__main__":
    main()
