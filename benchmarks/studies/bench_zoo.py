"""The small-model zoo's compile and step times: `from_torch` against torch eager, per model.

    python -m benchmarks.studies.bench_zoo [--rounds N] [NAME ...]

For each model of `tests/helpers/zoo.py`'s `ZOO` (the models users train; all by default): the
first call of `jax.jit(jax.value_and_grad(from_torch(loss)))` on a batch of 4 (trace and
compile), then `--rounds` interleaved later calls of it and of a torch eager step (forward and
backward of the same loss), each round with the 1-minute load average beside it. Prints a
Markdown table (docs/from_torch.md's "Models users train" times).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

from .. import harness


def timings(names: list[str], rounds: int = 5) -> list[dict[str, Any]]:
    """One row per model: "name", "first_call_s", "step_ms", "torch_eager_ms", "load_1min"."""
    return [_timing(name, rounds) for name in names]


def _timing(name: str, rounds: int) -> dict[str, Any]:
    """`timings`' row of one model."""
    import jax
    import jax.numpy as jnp
    import torch
    from helpers import zoo  # tests/helpers/zoo.py: see benchmarks/__init__.py

    import bridge_mr

    entry = zoo.ZOO[name]
    model = zoo.build(name)
    params, buffers = zoo.split_state(model)
    batch = entry.batch(torch.Generator().manual_seed(1), 4)
    loss = zoo.client_loss(entry, model)
    converted = bridge_mr.from_torch(loss, mutable=1 if entry.batch_norm else ())
    step = jax.jit(jax.value_and_grad(converted, has_aux=entry.batch_norm))
    args = jax.tree.map(lambda t: jnp.asarray(t.numpy()), (params, buffers, batch))
    first, _ = harness.time_once(lambda: step(*args))

    def torch_step() -> Callable[[], Any]:
        # Fresh leaves and buffers, untimed: backward and BatchNorm write into them.
        trainable = {k: v.clone().requires_grad_() for k, v in params.items()}
        fresh = {k: v.clone() for k, v in buffers.items()}
        return lambda: loss(trainable, fresh, batch).backward()

    later = harness.rounds({"step": lambda: lambda: step(*args), "torch": torch_step}, rounds)
    return {
        "name": name,
        "first_call_s": first,
        "step_ms": 1e3 * statistics.median(later.seconds["step"]),
        "torch_eager_ms": 1e3 * statistics.median(later.seconds["torch"]),
        "load_1min": max(later.load_1min),
    }


def main(argv: list[str]) -> int:
    """Times the chosen models and prints the table; returns the exit status."""
    from helpers import zoo

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.bench_zoo", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(zoo.ZOO)}")
    parser.add_argument("--rounds", type=int, default=5, help="later calls per model")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.names if name not in zoo.ZOO]:
        parser.error(f"unknown models {unknown}")
    print("| model | first call (s) | later step (ms) | torch eager (ms) | ratio | load |")
    print("|---|---|---|---|---|---|")
    for row in timings(args.names or list(zoo.ZOO), args.rounds):
        print(
            f"| `{row['name']}` | {row['first_call_s']:.1f} | {row['step_ms']:.1f} | "
            f"{row['torch_eager_ms']:.1f} | {row['step_ms'] / row['torch_eager_ms']:.2f} | "
            f"{row['load_1min']:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
