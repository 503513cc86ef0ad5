"""Case "recurrent": torch's recurrent layers through `from_torch`, at real sequence lengths.

Two measurements (issue 35):

* `gru/compile`: `jax.jit(jax.value_and_grad(from_torch(loss)))` of a 2-layer bidirectional
  `nn.GRU` (16 -> 32) classifier, batch 8, at several sequence lengths: seconds to trace
  (`jax.make_jaxpr`), seconds to lower and compile, equations of the traced program. Target
  (reported): the longest length compiles within 1.2x of the shortest.
* `shakespeare/c{clients}`: a FedAvg round of the LEAF / FedAvg-paper Shakespeare model
  (embedding 8, 2-layer `nn.LSTM` 256, 80 characters, vocabulary 80, next-character
  cross-entropy at every position): `bridge_mr.map_reduce` of local SGD steps on
  `from_torch` of the torch loss against a torch loop over the clients (`torch.optim.SGD`),
  first call on its own, then later rounds interleaved.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import harness, report, workloads

BRIDGE_MR = "bridge_mr"
TORCH_LOOP = "torch_loop"

#: GRU sequence lengths: the --quick run, the full run (the issue's).
GRU_LENGTHS = ((25, 100), (25, 100, 400))

#: Largest max |difference| between the two rounds' parameters after the first round (float32).
AGREEMENT_ATOL = 1e-4


@dataclasses.dataclass(frozen=True)
class ShakespeareConfig:
    """A Shakespeare FedAvg round: `clients` clients, each `local_steps` SGD steps of `batch`
    sequences of `seq` characters."""

    clients: int
    local_steps: int
    batch: int
    seq: int = 80
    vocab: int = 80
    lr: float = 0.5

    @property
    def row_id(self) -> str:
        return f"shakespeare/c{self.clients}"


#: The --quick round, the full round.
SHAKESPEARE = (ShakespeareConfig(2, 1, 4), ShakespeareConfig(8, 2, 10))


def _torch() -> Any:
    import torch

    return torch


def _zoo() -> Any:
    """`tests/helpers/zoo.py`, the models (`shakespeare_model`, `gru_classifier`,
    `sequence_loss`): see benchmarks/__init__.py."""
    from helpers import zoo

    return zoo


def _gru_lengths(ctx: harness.Context, case: report.CaseResult, lengths: tuple[int, ...]) -> None:
    import jax
    import jax.numpy as jnp
    from helpers.jaxprs import count_equations

    import bridge_mr

    model = _zoo().gru_classifier()
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    step = jax.value_and_grad(bridge_mr.from_torch(_zoo().sequence_loss(model)))
    rng = np.random.default_rng(0)
    # Untimed: imports torchax and warms JAX's caches of library functions. Another shape than
    # those measured: the first trace of a process also holds the creation of torchax's key.
    jax.make_jaxpr(step)(params, jnp.zeros((1, 2, 16)), jnp.zeros((1,), jnp.int32))
    trace_s, compile_s, equations = {}, {}, {}
    for length in lengths:
        x = jnp.asarray(rng.standard_normal((8, length, 16), dtype=np.float32))
        y = jnp.asarray(rng.integers(0, 10, 8, dtype=np.int32))
        name = f"seq{length}"
        trace_s[name], jaxpr = harness.time_once(
            lambda x=x, y=y: jax.make_jaxpr(step)(params, x, y)
        )
        equations[name] = count_equations(jaxpr)
        lowered = jax.jit(step).lower(params, x, y)
        compile_s[name], _ = harness.time_once(lowered.compile)
    base = {"batch": 8, "layers": 2, "bidirectional": True, "input": 16, "hidden": 32}
    first, last = f"seq{lengths[0]}", f"seq{lengths[-1]}"
    for row_id, seconds in (("gru/compile", compile_s), ("gru/trace", trace_s)):
        comparison = harness.Comparison(
            first, {name: harness.Timing([s], 1) for name, s in seconds.items()}
        )
        case.rows.append(
            report.comparison_row(comparison, row_id, {**base, "equations": equations})
        )
    case.notes.append(
        "GRU value_and_grad, equations of the traced program (scan bodies included): "
        + ", ".join(f"{name} {n}" for name, n in equations.items())
        + "."
    )
    case.targets.append(
        report.target(
            case.name,
            "gru/compile",
            f"XLA compile seconds at {last} / at {first}",
            compile_s[last] / compile_s[first],
            1.2,
            "<=",
            f"{last} {report.format_time(compile_s[last])} vs {first} "
            f"{report.format_time(compile_s[first])}",
        )
    )


def shakespeare_data(cfg: ShakespeareConfig) -> tuple[Any, Any]:
    """Random characters: inputs and next-character labels, int32 [clients, local_steps,
    batch, seq] torch tensors."""
    torch = _torch()
    rng = np.random.default_rng(1)
    text = rng.integers(0, cfg.vocab, (cfg.clients, cfg.local_steps, cfg.batch, cfg.seq + 1))
    text = torch.from_numpy(text.astype(np.int32))
    return text[..., :-1].clone(), text[..., 1:].clone()


def build_shakespeare_bridge_mr(cfg: ShakespeareConfig) -> Callable[[], Any]:
    """The round through `bridge_mr.map_reduce` of `workloads.local_sgd` on `from_torch`."""
    import bridge_mr

    model = _zoo().shakespeare_model(cfg.vocab)
    server = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = bridge_mr.from_torch(_zoo().sequence_loss(model))
    update = workloads.local_sgd(lambda p, batch: loss(p, *batch), cfg.lr)
    return workloads.bridge_mr_fedavg(update, server, shakespeare_data(cfg), no_grad=False)


def build_shakespeare_torch_loop(cfg: ShakespeareConfig) -> Callable[[], Any]:
    """The round as a torch loop over clients (`workloads.torch_fedavg_loop`)."""
    model = _zoo().shakespeare_model(cfg.vocab)
    x, y = shakespeare_data(cfg)
    nn_loss = _torch().nn.functional.cross_entropy

    def step_loss(local: Any, client: int, step: int) -> Any:
        logits = local(x[client, step])
        return nn_loss(logits.flatten(0, -2), y[client, step].flatten().long())

    return workloads.torch_fedavg_loop(
        copy.deepcopy(model), cfg.clients, cfg.local_steps, cfg.lr, step_loss
    )


def _shakespeare(ctx: harness.Context, case: report.CaseResult, cfg: ShakespeareConfig) -> None:
    built = {
        BRIDGE_MR: build_shakespeare_bridge_mr(cfg),
        TORCH_LOOP: build_shakespeare_torch_loop(cfg),
    }
    first_s, after_first = {}, {}
    for name, fn in built.items():
        first_s[name], after_first[name] = harness.time_once(fn)
    difference = max(
        float((a - b).detach().abs().max())
        for a, b in zip(after_first[BRIDGE_MR], after_first[TORCH_LOOP], strict=True)
    )
    initial = [p.detach() for p in _zoo().shakespeare_model(cfg.vocab).parameters()]
    moved = max(
        float((a - b).detach().abs().max())
        for a, b in zip(after_first[TORCH_LOOP], initial, strict=True)
    )
    policy = dataclasses.replace(ctx.policy, warmup=max(0, ctx.policy.warmup - 1))
    comparison = harness.compare(built, baseline=TORCH_LOOP, policy=policy)
    params = {
        **dataclasses.asdict(cfg),
        "max_abs_difference_after_first_round": difference,
        "max_abs_change_in_first_round": moved,
    }
    case.rows.append(
        report.comparison_row(
            comparison, cfg.row_id, params, metrics={"client_updates_per_s": cfg.clients}
        )
    )
    first = harness.Comparison(
        TORCH_LOOP, {name: harness.Timing([s], 1) for name, s in first_s.items()}
    )
    case.rows.append(report.comparison_row(first, f"{cfg.row_id} first call", params))
    case.notes.append(
        f"{cfg.row_id}: parameters after the first round, max |bridge_mr - torch loop| = "
        f"{difference:.2g} (the round moved them by up to {moved:.2g})"
        + (f", over {AGREEMENT_ATOL:g}" if difference > AGREEMENT_ATOL else "")
        + "."
    )


def run(
    ctx: harness.Context,
    lengths: tuple[int, ...] | None = None,
    rounds: tuple[ShakespeareConfig, ...] | None = None,
) -> report.CaseResult:
    """The GRU compile times over sequence lengths and the Shakespeare FedAvg round.

    `lengths` and `rounds` replace the --quick / full sizes (tests run tiny ones).
    """
    quick = ctx.quick
    lengths = lengths or GRU_LENGTHS[0 if quick else 1]
    rounds = rounds or (SHAKESPEARE[0 if quick else 1],)
    title = "torch's recurrent layers through from_torch at real sequence lengths"
    unit = (
        "gru rows: seconds of one trace / one XLA compile per sequence length (x = ratio to the "
        "shortest); shakespeare rows: time per FedAvg round (x = paired ratio to the torch loop)"
    )
    note = (
        "gru: jax.jit(jax.value_and_grad(from_torch(loss))), 2-layer bidirectional nn.GRU 16 -> "
        "32, batch 8. shakespeare: embedding 8, 2-layer nn.LSTM 256, vocabulary 80, local SGD "
        "under lax.scan in map_reduce (default strategy) against a torch loop with "
        "torch.optim.SGD; float32."
    )
    with report.case_result("recurrent", title, unit, note) as case:
        _gru_lengths(ctx, case, lengths)
        harness.each(rounds, case.name, lambda cfg: _shakespeare(ctx, case, cfg))
    return case
