"""Per-tensor cost of moving tensors between torch and JAX on one device (CPU or CUDA).

    python -m benchmarks.studies.bench_dlpack [--quick] [--device cpu|cuda] [--tensors N]

The boundary case's exchange rows (`boundary.exchange_rows`: bridge_mr.dlpack against the
public DLPack functions and a copy through host memory) for one batch of N float32[16, 16]
tensors on the chosen device, timed by the suite's harness and printed as a table.
"""

from __future__ import annotations

import argparse
import sys

from .. import environment, harness, report
from ..cases import boundary


def main(argv: list[str]) -> int:
    """Runs the comparison and prints it; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.bench_dlpack",
        description=(__doc__ or "").splitlines()[0],
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tensors", type=int, default=32, help="tensors per batch")
    args = parser.parse_args(argv)
    import torch

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    tensors = [torch.randn(16, 16, device=device) for _ in range(args.tensors)]
    ctx = harness.Context(
        quick=args.quick, policy=harness.QUICK if args.quick else harness.FULL, alternatives=()
    )
    case = report.CaseResult(
        name="dlpack",
        title=f"torch <-> JAX exchange of {args.tensors} float32[16, 16] tensors on {device}",
        unit="time per call (a call converts every tensor); (x) = ratio to the public DLPack "
        "function; tensors/s",
    )
    case.rows += boundary.exchange_rows(ctx, tensors, f"{args.tensors} x 16x16")
    print(environment.describe(environment.machine()))
    print("\n" + report.case_markdown(case), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
