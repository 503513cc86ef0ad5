"""FedAvg rounds on a torch-xla device: bridge_mr against pure torch-xla, side by side.

Run from the repository root in the torch-xla environment (torch_xla 2.9 aborts on the YNN
XLA flag the main environment sets, so XLA_FLAGS must not carry it):

    PJRT_DEVICE=CPU .venv-xla/bin/python -m benchmarks.bench_xla [--quick] [--clients N]

A round is the demo's FedAvg round (`bridge_mr.demo`): every client runs `local_steps` SGD
steps on the 64-64-10 MLP from the server parameters, the mean delta is the pseudo-gradient of
a server SGD step, then `torch_xla.sync()`. `bridge_mr` computes the clients with
`bridge_mr.map_reduce` (the demo's `BridgeClients`: one JAX program embedded in the lazy
graph); `torch_xla` with `torch.func.vmap` over `functional_call` (the demo's
`TorchFuncClients`), traced op by op into the lazy graph every round. Both run on one XLA
device from the same parameters and batches. After warm-up rounds (which compile), timed
samples alternate between the two (A B, then B A, ...); a sample is `rounds_per_sample`
rounds and ends after `torch_xla.sync()` and `xm.wait_device_ops()`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch

# torch_xla before bridge_mr (which imports JAX), as on TPU.
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as metrics

from bridge_mr.demo import (
    MLP,
    BridgeClients,
    Clients,
    FederatedDigits,
    TorchFuncClients,
    client_batches,
)

BASELINE = "torch_xla"
IMPLEMENTATIONS = ("bridge_mr", BASELINE)


@dataclasses.dataclass(frozen=True)
class RoundConfig:
    """One FedAvg round: clients, their local SGD steps, batch size, hidden width, client LR."""

    clients: int = 16
    local_steps: int = 10
    batch_size: int = 32
    hidden: int = 64
    local_lr: float = 0.3


@dataclasses.dataclass(frozen=True)
class XlaRoundTimes:
    """Seconds per FedAvg round for each implementation, one entry per timed sample.

    `compiles_while_timing` counts torch-xla compilations during each implementation's timed
    samples (0 means every timed round reused a compiled graph).
    """

    config: RoundConfig
    device: str
    torch_version: str
    torch_xla_version: str
    seconds_per_round: dict[str, list[float]]
    rounds_per_sample: int
    compiles_while_timing: dict[str, int]

    def median(self, implementation: str) -> float:
        """The median seconds per round of `implementation`."""
        return statistics.median(self.seconds_per_round[implementation])

    @property
    def ratio(self) -> float:
        """bridge_mr's median round time over pure torch-xla's (the target is <= 1.0)."""
        return self.median("bridge_mr") / self.median(BASELINE)


def _data(config: RoundConfig, device: torch.device) -> FederatedDigits:
    """Random inputs shaped like the demo's digits split (88 examples per client)."""
    gen = torch.Generator().manual_seed(0)
    per_client = 88
    labels = torch.randint(0, 10, (config.clients, per_client), generator=gen)
    data = FederatedDigits(
        client_x=torch.rand(config.clients, per_client, 64, generator=gen),
        client_y=torch.nn.functional.one_hot(labels, 10).float(),
        test_x=torch.rand(1, 64, generator=gen),
        test_y=torch.zeros(1, dtype=torch.int64),
    )
    return data.to(device)


def _round(
    model: torch.nn.Module, clients: Clients
) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """One FedAvg round on `model` (the demo's `train_fedavg` body, synced); returns the loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def run(batches: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            update = clients.mean_local_update(dict(model.named_parameters()), batches)
        for name, p in model.named_parameters():
            p.grad = -update["delta"][name]
        optimizer.step()
        torch_xla.sync()
        return update["loss"]

    return run


def measure_fedavg_round(
    config: RoundConfig | None = None,
    *,
    warmup: int = 8,
    samples: int = 10,
    rounds_per_sample: int = 3,
) -> XlaRoundTimes:
    """Times the FedAvg round of both implementations on the XLA device, interleaved.

    Args:
      config: the round (default: the demo's, `RoundConfig()`).
      warmup: untimed rounds per implementation first. The first two compile; pure torch-xla
        may compile once more for one of the 4 batches the rounds cycle through.
      samples: timed samples per implementation.
      rounds_per_sample: rounds in one timed sample.

    Returns:
      Seconds per round of every sample, per implementation.
    """
    config = config or RoundConfig()
    device = torch_xla.device()
    data = _data(config, device)
    batches = list(
        client_batches(
            data, rounds=4, batch_size=config.batch_size, local_steps=config.local_steps, seed=0
        )
    )
    torch_xla.sync()
    torch.manual_seed(0)
    initial = MLP(hidden=config.hidden).to(device)
    rounds = {}
    for name in IMPLEMENTATIONS:
        model = copy.deepcopy(initial)
        clients: Clients = (
            BridgeClients(local_lr=config.local_lr)
            if name == "bridge_mr"
            else TorchFuncClients(model, local_lr=config.local_lr)
        )
        rounds[name] = _round(model, clients)
    for run in rounds.values():
        for index in range(warmup):
            run(batches[index % len(batches)]).item()
    xm.wait_device_ops()
    done = dict.fromkeys(IMPLEMENTATIONS, warmup)  # rounds so far: the next batch to use
    compiles = dict.fromkeys(IMPLEMENTATIONS, 0)
    seconds: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for sample in range(samples):
        order = IMPLEMENTATIONS if sample % 2 == 0 else IMPLEMENTATIONS[::-1]
        for name in order:
            compiled = _compile_count()
            start = time.perf_counter()
            for index in range(done[name], done[name] + rounds_per_sample):
                rounds[name](batches[index % len(batches)])
            xm.wait_device_ops()
            seconds[name].append((time.perf_counter() - start) / rounds_per_sample)
            compiles[name] += _compile_count() - compiled
            done[name] += rounds_per_sample
    return XlaRoundTimes(
        config=config,
        device=str(device),
        torch_version=torch.__version__,
        torch_xla_version=torch_xla.__version__,
        seconds_per_round=seconds,
        rounds_per_sample=rounds_per_sample,
        compiles_while_timing=compiles,
    )


def _compile_count() -> int:
    return metrics.metric_data("CompileTime")[0]


def format_table(result: XlaRoundTimes) -> str:
    """The two implementations side by side: median and minimum per round, ratio."""
    config = result.config
    lines = [
        f"FedAvg round on {result.device} (torch {result.torch_version}, torch_xla "
        f"{result.torch_xla_version}): {config.clients} clients x {config.local_steps} local "
        f"SGD steps, batch {config.batch_size}, MLP 64-{config.hidden}-10",
        f"{'implementation':<14}  {'median':>10}  {'min':>10}  {'vs torch_xla':>12}  "
        "compiles while timing",
    ]
    for name in IMPLEMENTATIONS:
        times = result.seconds_per_round[name]
        lines.append(
            f"{name:<14}  {result.median(name) * 1e3:>7.2f} ms  {min(times) * 1e3:>7.2f} ms  "
            f"{result.median(name) / result.median(BASELINE):>11.2f}x  "
            f"{result.compiles_while_timing[name]}"
        )
    lines.append(
        f"bridge_mr / pure torch-xla = {result.ratio:.2f}x (target <= 1.0x); "
        f"{len(result.seconds_per_round[BASELINE])} interleaved samples of "
        f"{result.rounds_per_sample} rounds each"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> XlaRoundTimes:
    """Runs the benchmark from the command line; prints and returns the timings."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (smoke run)")
    parser.add_argument("--clients", type=int, default=RoundConfig.clients)
    parser.add_argument("--local-steps", type=int, default=RoundConfig.local_steps)
    parser.add_argument("--hidden", type=int, default=RoundConfig.hidden)
    args = parser.parse_args(argv)
    config = RoundConfig(clients=args.clients, local_steps=args.local_steps, hidden=args.hidden)
    result = measure_fedavg_round(config, samples=3 if args.quick else 10)
    print(format_table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
