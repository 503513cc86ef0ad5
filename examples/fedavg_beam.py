"""FedAvg of a small CNN on scikit-learn's digits, each round an Apache Beam pipeline on Dask.

    python examples/fedavg_beam.py                    # 10 rounds of 20 clients on Dask
    python examples/fedavg_beam.py --quick            # 3 rounds of 6 clients (its test)
    python examples/fedavg_beam.py --runner fnapi     # Beam's in-process FnApiRunner

scikit-learn's 8x8 digits (`bridge_mr.data.digits`): a stratified 20% is held out for the test,
and each of `--clients` clients holds 48 random images of the rest (no image is both): numpy
records, what the workers get (torch, which `bridge_mr.data` needs, stays on the driver). A
round broadcasts the server's CNN (a 3x3 convolution with 8 channels, ReLU, 2x2 max-pooling, a
linear layer), runs `--local-steps` SGD steps per client inside `map_fn` (a `lax.scan` of
`jax.grad` steps) and adds the clients' deltas averaged by their example counts
(`reduce_weighted_mean`). Each round runs through `bridge_mr.beam.run` as a Beam pipeline, by
default on Beam's `DaskRunner` over a `dask.distributed.LocalCluster` of 2 worker processes,
the clients in one bundle per worker. The first round pays for the plan, its self-test and
each worker's compilations, so it is timed apart from the later ones. Uses only public names
of bridge_mr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bridge_mr import jax_core

CHANNELS, CLASSES, SIDE = 8, 10, 8
PER_CLIENT = 48  # images per client
TEST = 360  # held-out images: bridge_mr.data.digits' stratified 20%
DIGITS = 1797  # images in scikit-learn's digits
MAX_CLIENTS = (DIGITS - TEST) // PER_CLIENT  # 29
LOCAL_LR = 0.3
DASK_WORKERS = 2
ROUNDS, CLIENTS = 10, 20
QUICK_ROUNDS, QUICK_CLIENTS = 3, 6
Params = dict[str, Any]
Record = tuple[dict[str, np.ndarray], np.float32]


@dataclasses.dataclass(frozen=True)
class Digits:
    """The clients' records (({"x": [48, 8, 8, 1], "y": [48]}, examples) each) and the test set."""

    records: list[Record]
    test_x: np.ndarray
    test_y: np.ndarray


def load_digits(clients: int, seed: int = 0) -> Digits:
    """Digits as 8x8x1 images in [0, 1]: `TEST` held out, `PER_CLIENT` a client (numpy records).

    Args:
      clients: how many clients (each gets `PER_CLIENT` images none of the others has).
      seed: the split's and the deal's seed.

    Returns:
      The clients' records and the held-out test set.

    Raises:
      ValueError: `clients` is not positive, or the digits have too few images for them.
    """
    from bridge_mr import data as fd  # torch, on the driver only: the workers get numpy

    train, test = fd.digits(
        fd.IID(clients, examples_per_client=PER_CLIENT, seed=seed), shape=(SIDE, SIDE, 1), seed=seed
    )
    records = [
        ({name: value.numpy() for name, value in train.client(c).items()}, np.float32(PER_CLIENT))
        for c in range(train.num_clients)
    ]
    return Digits(records, test["x"].numpy(), test["y"].numpy())


def logits(params: Params, images: jax.Array) -> jax.Array:
    """Class scores [batch, 10] of images [batch, 8, 8, 1]: conv, ReLU, max-pool, linear."""
    h = jax.lax.conv_general_dilated(
        images, params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jax.lax.reduce_window(
        jax.nn.relu(h + params["b"]), -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
    )
    return h.reshape(images.shape[0], -1) @ params["w"]


def loss(params: Params, data: dict[str, jax.Array]) -> jax.Array:
    """The mean cross-entropy of the CNN on a client's {"x": images, "y": labels}."""
    z = jax.nn.log_softmax(logits(params, data["x"]))
    return -jnp.mean(jnp.take_along_axis(z, data["y"][:, None], axis=1))


def make_round(local_steps: int, lr: float = LOCAL_LR) -> Callable[..., Params]:
    """FedAvg's round `fedavg_round(server, data, examples) -> server` for `bridge_mr.beam.run`
    (or `jax_core.program`): `local_steps` SGD steps of rate `lr` per client, inside map_fn."""

    def local_update(params: Params, data: dict[str, jax.Array]) -> Params:
        def step(p: Params, _: None) -> tuple[Params, None]:
            return jax.tree.map(lambda a, g: a - lr * g, p, jax.grad(loss)(p, data)), None

        new, _ = jax.lax.scan(step, params, None, length=local_steps)
        return jax.tree.map(jnp.subtract, new, params)

    def fedavg_round(server: Params, data: dict[str, jax.Array], examples: jax.Array) -> Params:
        deltas = jax_core.map_fn(local_update, (jax_core.broadcast(server), data))
        return jax.tree.map(jnp.add, server, jax_core.reduce_weighted_mean(deltas, examples))

    return fedavg_round


def init(seed: int = 1) -> Params:
    """The server's initial CNN (numpy float32 arrays)."""
    rng = np.random.default_rng(seed)
    features = (SIDE // 2) ** 2 * CHANNELS
    return {
        "k": (rng.normal(size=(3, 3, 1, CHANNELS)) / 3).astype(np.float32),
        "b": np.zeros(CHANNELS, np.float32),
        "w": (rng.normal(size=(features, CLASSES)) / np.sqrt(features)).astype(np.float32),
    }


def accuracy(params: Params, x: np.ndarray, y: np.ndarray) -> float:
    """The fraction of images `x` the CNN classifies as `y`."""
    return float(jnp.mean(jnp.argmax(logits(params, jnp.asarray(x)), axis=1) == y))


@dataclasses.dataclass
class FedAvgRun:
    """One training: test accuracy before the first round and after each, seconds per round.

    Attributes:
      runner: "dask" or "fnapi".
      accuracy: test accuracy of the initial model, then after each round.
      seconds: wall time of each round's `bridge_mr.beam.run`.
      server: the final server model.
    """

    runner: str
    accuracy: list[float]
    seconds: list[float]
    server: Params


@contextlib.contextmanager
def pipeline_options(runner: str) -> Iterator[Any]:
    """Beam's options for `runner`: a DaskRunner on a fresh LocalCluster (closed on exit) for
    "dask", None (the in-process FnApiRunner) for "fnapi"."""
    if runner == "fnapi":
        yield None
        return
    from apache_beam.options.pipeline_options import PipelineOptions
    from dask.distributed import LocalCluster

    # After importing dask.distributed (which sets its loggers' levels): it logs every worker's
    # start and stop at INFO, and the DaskRunner warns about its partition size per pipeline.
    logging.getLogger("distributed").setLevel(logging.WARNING)
    logging.getLogger("apache_beam.runners.dask").setLevel(logging.ERROR)
    start = time.perf_counter()
    # 2 threads per worker: the DaskRunner computes a side input inside a task. (Not `with
    # LocalCluster(...) as cluster`: its __enter__ is typed as sync-or-async.)
    cluster = LocalCluster(
        n_workers=DASK_WORKERS, processes=True, threads_per_worker=2, dashboard_address=":0"
    )
    with cluster:
        print(
            f"  started a dask LocalCluster of {DASK_WORKERS} worker processes in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
        yield PipelineOptions(
            [  # As flags: the keyword for --dask_client_address is `address`.
                "--runner=apache_beam.runners.dask.dask_runner.DaskRunner",
                f"--dask_client_address={cluster.scheduler_address}",
            ]
        )


def train(data: Digits, args: argparse.Namespace) -> FedAvgRun:
    """`args.rounds` FedAvg rounds on Beam from `init(args.seed + 1)`; prints each round."""
    import bridge_mr.beam

    fedavg_round = make_round(args.local_steps)
    server = init(args.seed + 1)
    run = FedAvgRun(args.runner, [accuracy(server, data.test_x, data.test_y)], [], server)
    print(f"  round  0: test accuracy {run.accuracy[0]:6.1%}", flush=True)
    # One bundle per Dask worker: both compile and run client work.
    bundle_size = math.ceil(len(data.records) / DASK_WORKERS)
    with pipeline_options(args.runner) as options:
        for r in range(1, args.rounds + 1):
            start = time.perf_counter()
            server = bridge_mr.beam.run(
                fedavg_round,
                (server,),
                data.records,
                pipeline_options=options,
                bundle_size=bundle_size,
            )
            run.seconds.append(time.perf_counter() - start)
            run.accuracy.append(accuracy(server, data.test_x, data.test_y))
            note = " (first: plan, self-test, compilations)" if r == 1 else ""
            print(
                f"  round {r:>2}: test accuracy {run.accuracy[-1]:6.1%}  "
                f"{run.seconds[-1]:6.2f} s{note}",
                flush=True,
            )
    run.server = server
    return run


def positive_int(text: str) -> int:
    """An argparse type: `text` as an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line: --quick, --rounds, --clients, --local-steps, --runner, --seed."""
    parser = argparse.ArgumentParser(
        prog="examples/fedavg_beam.py",
        description="FedAvg of a small CNN on digits, each round a Beam pipeline (Dask or "
        "the in-process FnApiRunner) through bridge_mr.beam.run.",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds of {QUICK_CLIENTS} clients"
    )
    parser.add_argument("--rounds", type=positive_int, help=f"rounds ({ROUNDS})")
    parser.add_argument("--clients", type=positive_int, help=f"clients ({CLIENTS})")
    parser.add_argument("--local-steps", type=positive_int, default=5, help="per round (5)")
    parser.add_argument(
        "--runner",
        choices=["dask", "fnapi"],
        default="dask",
        help=f"dask: DaskRunner on a LocalCluster of {DASK_WORKERS} worker processes (default); "
        "fnapi: the in-process FnApiRunner",
    )
    parser.add_argument("--seed", type=int, default=0, help="the split's seed; init's is seed+1")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    args.clients = args.clients or (QUICK_CLIENTS if args.quick else CLIENTS)
    if args.clients > MAX_CLIENTS:
        parser.error(
            f"--clients {args.clients} needs {args.clients * PER_CLIENT} training images; the "
            f"digits have {DIGITS - TEST} besides the {TEST} held out: at most {MAX_CLIENTS}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> FedAvgRun:
    """Trains the CNN with FedAvg on Beam; prints and returns the run."""
    args = parse_args(argv)
    data = load_digits(args.clients, args.seed)
    where = {
        "dask": f"Beam's DaskRunner on a LocalCluster of {DASK_WORKERS} worker processes",
        "fnapi": "Beam's in-process FnApiRunner",
    }[args.runner]
    print(
        f"FedAvg of a CNN on digits: {args.clients} clients x {PER_CLIENT} images, "
        f"{len(data.test_y)} held out; {args.rounds} rounds of {args.local_steps} local SGD "
        f"steps (lr {LOCAL_LR}), each round a pipeline on {where}",
        flush=True,
    )
    run = train(data, args)
    first, later = run.seconds[0], run.seconds[1:]
    summary = f"first round {first:.2f} s"
    if later:
        summary += (
            f", later rounds median {statistics.median(later):.2f} s "
            f"({min(later):.2f}-{max(later):.2f} s over {len(later)})"
        )
    print(f"test accuracy {run.accuracy[0]:.1%} -> {run.accuracy[-1]:.1%}; {summary}", flush=True)
    return run


if __name__ == "__main__":
    main()
