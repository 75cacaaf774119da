"""A fused step's inputs onto the device: one packed host array handed to the program's call
(the runner's way) against the way a sampled step went before, in the same run.

- **apart** (the baseline): the step's int32 arrays packed in one, each row's sampling array
  (temperature, top-k, top-p, seed, step) and an all-ones grammar bitmask (``[rows, ceil(vocab
  / 32)]`` int32, 1.2 MB at 64 rows over Qwen3's vocabulary) built and uploaded apart with
  ``device_put``, then a program called on the seven.
- **packed**: ``step/program.pack`` with every row's sampling inside, handed to a program's
  call as a host array (the call transfers it); the bitmask, where no row has a grammar or a
  ban, the one kept on the device.

The programs only read a word of each input: what is timed is building the inputs and getting
them to the device (median of ``--repeats`` runs after 20 warm ones, in microseconds, waiting
for the program). On a CPU a transfer is a copy; on the TPU machine each ``device_put`` was a
host-to-device transfer of ~0.2 ms in run 9.

    python bench/bench_step_inputs.py [--rows 1,8,64] [--vocab 151936] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine.compilation.upload import upload
from pd_fsm.jax_engine.sampling.grammar import allow_every_token
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.jax_engine.sampling.sampler import TOP_LOGPROBS, penalty_arrays, sampling_arrays
from pd_fsm.jax_engine.step.program import pack

CONTEXT = 1024
PAGE = 16


def timed_us(run: Callable[[], object], repeats: int) -> float:
    for _ in range(20):
        jax.block_until_ready(run())
    laps = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        laps.append(time.perf_counter() - start)
    return 1e6 * statistics.median(laps)


def measure(rows: int, vocab: int, repeats: int) -> dict[str, object]:
    width = CONTEXT // PAGE
    tokens = np.ones(rows, np.int32)
    carry = np.arange(rows, dtype=np.int32)
    q_lens = np.ones(rows, np.int32)
    kv_lens = np.full(rows, CONTEXT, np.int32)
    table = np.ones((rows, width), np.int32)
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=7)] * rows
    seeds, steps = [7] * rows, [CONTEXT] * rows

    def taking(*args: object) -> jax.stages.Compiled:
        """A program that takes these arrays (and reads a word of each): what the step's call
        does with its inputs, without the step."""
        fn = jax.jit(lambda *xs: sum(x.reshape(-1)[0].astype(jnp.float32) for x in xs))
        return fn.lower(*args).compile()

    allowed = upload(allow_every_token(rows, vocab))
    ints = np.concatenate([tokens, carry, q_lens, kv_lens, table.reshape(-1)])
    seven = taking(ints, *sampling_arrays(params, seeds, steps, rows).values(), allowed)

    def apart() -> jax.Array:
        arrays = sampling_arrays(params, seeds, steps, rows)
        bitmask = allow_every_token(rows, vocab)
        ints = np.concatenate([tokens, carry, q_lens, kv_lens, table.reshape(-1)])
        out: jax.Array = seven(upload(ints), *(upload(a) for a in arrays.values()),
                               upload(bitmask))
        return out

    def rows_now() -> dict[str, np.ndarray]:
        return {**sampling_arrays(params, seeds, steps, rows),
                **penalty_arrays(params, [-1] * rows, rows),
                TOP_LOGPROBS: np.zeros(rows, np.int32)}

    one = taking(pack(tokens, carry, q_lens, kv_lens, table, rows_now()), allowed)

    def packed() -> jax.Array:
        # The host array to the call as it is: the call transfers it, as the runner's does.
        out: jax.Array = one(pack(tokens, carry, q_lens, kv_lens, table, rows_now()), allowed)
        return out

    # Alternated, so that drift on a shared machine falls on both.
    base, ours = [], []
    for _ in range(3):
        base.append(timed_us(apart, repeats))
        ours.append(timed_us(packed, repeats))
    a, p = statistics.median(base), statistics.median(ours)
    return {"rows": rows, "vocab": vocab, "backend": jax.default_backend(),
            "apart_us": round(a, 1), "packed_us": round(p, 1), "apart_over_packed": round(a / p, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen3's
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        record = measure(rows, args.vocab, args.repeats)
        print(json.dumps(record), flush=True)
        records.append(record)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
