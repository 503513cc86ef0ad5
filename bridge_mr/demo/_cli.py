"""The demo's command line.

python -m bridge_mr.demo                # 16 clients, 60 rounds of FedSGD and of FedAvg
python -m bridge_mr.demo --quick        # smoke run: 15 rounds of each
python -m bridge_mr.demo --clients 32 --rounds 100 --no-baseline
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import bridge_mr

from ._run import DemoConfig, DemoResult, run_demo

QUICK_ROUNDS = 15


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bridge_mr.demo",
        description=(
            "Federated training of a torch MLP on scikit-learn's digits, split non-IID across "
            "clients: FedSGD and FedAvg through bridge_mr.map_reduce, the torch client loss "
            "run as JAX/XLA operations by bridge_mr.from_torch, and the same training in pure "
            "torch (torch.func.vmap) for comparison."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_ROUNDS} rounds per algorithm (unless --rounds is given)",
    )
    parser.add_argument(
        "--rounds", type=_positive_int, help="rounds per algorithm (default: 60, quick: 15)"
    )
    parser.add_argument(
        "--clients", type=_positive_int, default=16, help="number of clients (default: 16)"
    )
    parser.add_argument("--seed", type=int, default=0, help="data split, init and batches")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the pure-torch baseline runs"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> DemoResult:
    """Runs the demo as `python -m bridge_mr.demo [argv]` does; prints and returns the result.

    Sets `os.environ["XLA_FLAGS"]` to `bridge_mr.recommended_xla_flags()` first: it takes
    effect if no JAX computation has run in this process yet.

    Args:
      argv: the command-line arguments (default: `sys.argv[1:]`): --quick, --rounds N,
        --clients N, --seed S, --no-baseline.

    Returns:
      Every training run, as `run_demo` returns them.
    """
    args = _parse_args(argv)
    os.environ["XLA_FLAGS"] = bridge_mr.recommended_xla_flags()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DemoConfig.rounds)
    config = DemoConfig(
        clients=args.clients, rounds=rounds, seed=args.seed, baseline=not args.no_baseline
    )
    print(
        f"bridge_mr demo: federated learning on digits (XLA_FLAGS={os.environ['XLA_FLAGS']})",
        flush=True,
    )
    result = run_demo(config)
    print(f"\nwall time (after Python imports): {result.seconds:.1f} s", flush=True)
    return result
