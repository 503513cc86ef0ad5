"""`python -m bridge_mr.demo`: federated learning on digits, bridge_mr beside pure torch.

python -m bridge_mr.demo                # 16 clients, 60 rounds of FedSGD and of FedAvg
python -m bridge_mr.demo --quick        # smoke run: 15 rounds of each
python -m bridge_mr.demo --clients 32 --rounds 100 --no-baseline
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from importlib import metadata

from ._run import DemoConfig, DemoResult, run_demo

# jaxlib 0.10 on CPU: YNNPACK's reduce fusion slows scan/vmap gradients down (jax#37465).
_XLA_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
_XLA_FLAG_VALUE = "-reduce"
QUICK_ROUNDS = 15


def configure_xla_flags() -> str:
    """Appends the YNNPACK workaround to XLA_FLAGS on jaxlib >= 0.10; returns the flags.

    Older jaxlibs do not know the flag and abort on it; a flag already in XLA_FLAGS is kept as
    it is. XLA reads XLA_FLAGS when JAX starts its first backend, so this works as long as no
    JAX computation has run yet, even after `import jax`.
    """
    flags = os.environ.get("XLA_FLAGS", "").split()
    present = any(flag.split("=", 1)[0] == _XLA_FLAG for flag in flags)
    if not present and _jaxlib_version() >= (0, 10):
        flags.append(f"{_XLA_FLAG}={_XLA_FLAG_VALUE}")
        os.environ["XLA_FLAGS"] = " ".join(flags)
    return os.environ.get("XLA_FLAGS", "")


def _jaxlib_version() -> tuple[int, ...]:
    return tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2])


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line: --quick, --rounds, --clients, --seed, --no-baseline."""
    parser = argparse.ArgumentParser(
        prog="python -m bridge_mr.demo",
        description=(
            "Federated training of a torch MLP on scikit-learn's digits, split non-IID across "
            "clients: FedSGD and FedAvg through bridge_mr.map_reduce (JAX/XLA), and the same "
            "training in pure torch (torch.func.vmap) for comparison."
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
    """Runs the demo from the command line; returns its `DemoResult`."""
    xla_flags = configure_xla_flags()
    args = parse_args(argv)

    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DemoConfig.rounds)
    config = DemoConfig(
        clients=args.clients, rounds=rounds, seed=args.seed, baseline=not args.no_baseline
    )
    print(f"bridge_mr demo: federated learning on digits (XLA_FLAGS={xla_flags})", flush=True)
    result = run_demo(config)
    print(f"\nwall time (after Python imports): {result.seconds:.1f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
