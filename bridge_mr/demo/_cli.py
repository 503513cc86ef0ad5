"""The demo's command line.

python -m bridge_mr.demo                # 64 clients, 60 rounds of FedSGD and of FedAvg
python -m bridge_mr.demo --quick        # smoke run: 15 rounds of each
python -m bridge_mr.demo --clients 32 --rounds 100 --no-baseline
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

from ._run import DemoConfig, DemoResult, run_demo

QUICK_ROUNDS = 15


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `least`."""

    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer of at least {least}; got {text}")
        return value

    return parse


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bridge_mr.demo",
        description=(
            "Federated training of a torch MLP on scikit-learn's digits, split non-IID across "
            "clients: FedSGD and FedAvg through bridge_mr.map_reduce, the torch client loss "
            "run as JAX/XLA operations by bridge_mr.from_torch, and the same training in pure "
            "torch for comparison (torch.func.vmap over all clients, and the loop over clients a "
            "torch user writes). Reports each implementation's first round (bridge_mr's "
            "includes tracing and XLA compilation) apart from its later rounds, and where "
            "bridge_mr is slower."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_ROUNDS} rounds per algorithm (unless --rounds is given)",
    )
    parser.add_argument(
        "--rounds",
        type=_at_least(2),
        help=f"rounds per algorithm (default: {DemoConfig.rounds}, quick: {QUICK_ROUNDS})",
    )
    parser.add_argument(
        "--clients",
        type=_at_least(1),
        default=DemoConfig.clients,
        help=f"number of clients (default: {DemoConfig.clients})",
    )
    parser.add_argument("--seed", type=int, default=0, help="data split, init and batches")
    parser.add_argument(
        "--torch-threads",
        type=_at_least(1),
        default=DemoConfig.torch_threads,
        help=f"torch's intra-op threads during the runs (default: {DemoConfig.torch_threads})",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the pure-torch baselines (torch.func and the torch loop)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> DemoResult:
    """Runs the demo as `python -m bridge_mr.demo [argv]` does; prints and returns the result.

    Args:
      argv: the command-line arguments (default: `sys.argv[1:]`): --quick, --rounds N,
        --clients N, --seed S, --torch-threads N, --no-baseline.

    Returns:
      Every training run, as `run_demo` returns them.
    """
    args = _parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DemoConfig.rounds)
    config = DemoConfig(
        clients=args.clients,
        rounds=rounds,
        seed=args.seed,
        baseline=not args.no_baseline,
        torch_threads=args.torch_threads,
    )
    flags = os.environ.get("XLA_FLAGS", "")  # Reported as the user set them: bridge_mr sets none.
    print(f"bridge_mr demo: federated learning on digits (XLA_FLAGS={flags})", flush=True)
    result = run_demo(config)
    print(f"\nwall time (after Python imports): {result.seconds:.1f} s", flush=True)
    return result
