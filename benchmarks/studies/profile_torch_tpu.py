"""Where a FedAvg round's time goes on TorchTPU tensors, beside the same programs run by JAX.

    python -m benchmarks.studies.profile_torch_tpu --save DIR [--model cnn] [--clients 50]
        [--precision medium] [--rounds 5]          (TorchTPU's process: JAX_PLATFORMS=cpu)
    python -m benchmarks.studies.profile_torch_tpu --replay DIR [--rounds 5]
                                                   (a process where JAX holds the chip)

The round is the "accelerator" case's `bridge_mr_torchtpu` row (`workloads.accelerator`):
`outer_step` of the documented client, then the server's `torch.optim.SGD(lr=1)` step, on the
tensors of `--device` ("tpu": TorchTPU's; "cpu" stands in where there is none). After two
warm rounds, each of `--rounds` rounds is timed whole and in parts, every part ending in a
device sync: `mean_delta` (the clients' program and the eager ops around it), the program
alone (each TorchTPU kernel call), the 64-bit label check and cast (bridge_mr's
`narrow`), and the server step (`.grad` set as `outer_step` sets it, `step`, `zero_grad`),
and of that step the deltas' negation alone, one op per parameter or one `_foreach_neg`.
One JSON line per measurement, medians last.

`--save DIR` also writes every program bridge_mr exports for TorchTPU (`jax.export`'s
serialized form, `program_N.bin`); `--replay DIR`, run where JAX holds the chip, times each
of them as JAX runs it (`jax.jit` of the deserialized call, random inputs on the default
device): the same StableHLO, compiled by JAX's libtpu instead of TorchTPU's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.workloads import accelerator as acc


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _sync(device: str) -> None:
    if device == "tpu":
        import torch

        torch.accelerator.synchronize()


@contextmanager
def _capturing_exports(directory: pathlib.Path | None) -> Iterator[None]:
    """While open, every `jax.export.export(...)(...)` result is serialized into `directory`."""
    import jax.export

    if directory is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    original = jax.export.export

    def export(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        inner = original(*args, **kwargs)

        def call(*avals: Any) -> Any:
            exported = inner(*avals)
            index = len(list(directory.glob("program_*.bin")))
            (directory / f"program_{index}.bin").write_bytes(exported.serialize())
            return exported

        return call

    jax.export.export = export  # type: ignore[assignment]
    try:
        yield
    finally:
        jax.export.export = original  # type: ignore[assignment]


#: While a list is last here, TorchTPU's kernel calls append their (synced) seconds to it.
_KERNEL_SECONDS: list[list[float]] = []


@contextmanager
def _timing_kernels(device: str) -> Iterator[None]:
    """While open, TorchTPU's kernel call (torch_tpu's `call_custom_kernel`, through which
    bridge_mr runs its programs on "tpu" tensors) is synced before and after and timed into
    `_KERNEL_SECONDS`. Open it before bridge_mr's first call, which looks the function up."""
    if device != "tpu":
        yield
        return
    from torch_tpu._internal.pallas import tpu_torch_pallas as pallas  # pyright: ignore[reportMissingImports]

    original = pallas.call_custom_kernel

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not _KERNEL_SECONDS:
            return original(*args, **kwargs)
        _sync(device)
        start = time.perf_counter()
        result = original(*args, **kwargs)
        _sync(device)
        _KERNEL_SECONDS[-1].append(time.perf_counter() - start)
        return result

    pallas.call_custom_kernel = timed
    try:
        yield
    finally:
        pallas.call_custom_kernel = original


def _timed(device: str, fn: Callable[[], Any]) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def profile_round(cfg: acc.AcceleratorConfig, device: str, rounds: int) -> dict[str, float]:
    """The round's parts on `device`'s tensors: median seconds of each over `rounds`."""
    with _timing_kernels(device):
        return _profile_round(cfg, device, rounds)


def _profile_round(cfg: acc.AcceleratorConfig, device: str, rounds: int) -> dict[str, float]:
    import torch

    from bridge_mr import algorithms as alg

    net = acc.build_model(cfg.model).to(device)
    local = acc._local(cfg, net)
    batches = acc._torch_data(cfg, device)
    params = dict(net.named_parameters())
    server_opt = torch.optim.SGD(net.parameters(), lr=1.0)
    narrowed = {k: v.to(torch.int32) if v.dtype == torch.int64 else v for k, v in batches.items()}
    wide = [v for v in batches.values() if v.dtype == torch.int64]
    deltas = [torch.zeros_like(p) for p in params.values()]

    def whole() -> None:
        alg.outer_step(local, params, batches)
        server_opt.step()
        server_opt.zero_grad()

    def server() -> None:
        for p, delta in zip(params.values(), deltas, strict=True):  # as outer_step sets .grad
            p.grad = (-delta).to(dtype=p.dtype, device=p.device)
        server_opt.step()
        server_opt.zero_grad()

    parts: dict[str, Callable[[], Any]] = {
        "round": whole,
        "mean_delta": lambda: alg.mean_delta(local, params, batches),
        "mean_delta_int32_batches": lambda: alg.mean_delta(local, params, narrowed),
        "narrow": lambda: _narrow(wide),
        "server_step": server,
        "negate_each": lambda: [-d for d in deltas],
        "negate_foreach": lambda: torch._foreach_neg(deltas),  # pyright: ignore[reportPrivateImportUsage]
    }
    with torch.no_grad():
        for _ in range(2):
            whole()
            alg.mean_delta(local, params, narrowed)
    found: dict[str, list[float]] = {name: [] for name in [*parts, "program"]}
    with torch.no_grad():  # As in outer_step: forward programs only.
        _profile_rounds(device, parts, rounds, found)
    return {name: statistics.median(v) for name, v in found.items()}


def _profile_rounds(
    device: str, parts: dict[str, Callable[[], Any]], rounds: int, found: dict[str, list[float]]
) -> None:
    for index in range(rounds):
        for name, part in parts.items():
            programs: list[float] = []
            if name == "round":
                _KERNEL_SECONDS.append(programs)
            try:
                seconds = _timed(device, part)
            finally:
                if name == "round":
                    _KERNEL_SECONDS.pop()
            found[name].append(seconds)
            if name == "round":
                found["program"].append(sum(programs))
                _say(event="round", index=index, seconds=seconds, programs=programs)
            else:
                _say(event="part", index=index, name=name, seconds=seconds)


def _narrow(wide: list[Any]) -> list[Any]:
    """What bridge_mr does to int64 tensors for int32 inputs on TorchTPU: their minima and
    maxima read to the host together (the sync), then each cast."""
    import torch

    torch.stack([torch.stack(torch.aminmax(t)) for t in wide]).cpu()
    return [t.to(torch.int32) for t in wide]


def replay(directory: pathlib.Path, rounds: int) -> dict[str, float]:
    """Each saved program run by JAX on its default device: median seconds per call."""
    import jax
    import jax.export

    rng = np.random.default_rng(0)
    medians = {}
    for path in sorted(directory.glob("program_*.bin")):
        exported = jax.export.deserialize(bytearray(path.read_bytes()))
        args = [
            jax.device_put(
                rng.integers(0, 9, a.shape).astype(a.dtype)
                if np.issubdtype(a.dtype, np.integer)
                else rng.standard_normal(a.shape).astype(a.dtype) * 0.01
            )
            for a in exported.in_avals
        ]
        call = jax.jit(exported.call)
        first, _ = harness.time_once(lambda: call(*args))  # noqa: B023
        times = [harness.time_once(lambda: call(*args))[0] for _ in range(rounds)]  # noqa: B023
        medians[path.name] = statistics.median(times)
        _say(event="replay", program=path.name, first_s=first, seconds=medians[path.name])
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="tpu", choices=("tpu", "cpu"))
    parser.add_argument("--model", default="cnn", choices=("cnn", "gpt2_128"))
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--precision", default="medium", choices=("highest", "high", "medium"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--save", type=pathlib.Path, help="write the exported programs here")
    parser.add_argument("--replay", type=pathlib.Path, help="time the programs saved here")
    args = parser.parse_args(argv)
    if args.replay is not None:
        medians = replay(args.replay, args.rounds)
        _say(event="replay_medians", **medians)
        return
    import torch

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(args.precision)
    try:
        cfg = acc.AcceleratorConfig(args.model, args.clients, precision=args.precision)
        with _capturing_exports(args.save):
            medians = profile_round(cfg, args.device, args.rounds)
        _say(event="medians", model=args.model, clients=args.clients, **medians)
    finally:
        torch.set_float32_matmul_precision(previous)


if __name__ == "__main__":
    main()
