"""FedAvg, FedAvgM, FedAdam, FedYogi, FedProx and DiLoCo rounds against pure-torch loops."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# .venv-xla (the torch_xla leg, which selects none of these tests) has no optax.
optax = pytest.importorskip(
    "optax", reason="needs the algorithms extra: pip install '.[algorithms]'"
)

import torch  # noqa: E402
from algorithms.torch_reference import (  # noqa: E402
    client_batches,
    local_deltas,
    mlp,
    mse_loss,
    weighted_mean,
)

import bridge_mr  # noqa: E402
from bridge_mr import algorithms as alg  # noqa: E402

ROUNDS = 3
STEPS = 3
CLIENTS = 5


def _sgd(lr: float) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    return lambda ps: torch.optim.SGD(ps, lr=lr)


def _adamw(lr: float) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    # optax.adamw's defaults differ from torch's: weight_decay 1e-4 (torch: 1e-2); eps 1e-8 in
    # both. Both decay decoupled (p -= lr * wd * p, from the pre-step p) and bias-correct.
    return lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)


ServerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
CASES: dict[str, tuple[optax.GradientTransformation, Any, ServerFactory]] = {
    "fedavg": (optax.sgd(0.1), _sgd(0.1), lambda ps: torch.optim.SGD(ps, lr=1.0)),
    "fedavgm": (optax.sgd(0.1), _sgd(0.1), lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9)),
    "fedadam": (optax.sgd(0.1), _sgd(0.1), lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-3)),
    "fedyogi": (optax.sgd(0.1), _sgd(0.1), lambda ps: alg.Yogi(ps, lr=0.01)),
    "diloco": (
        optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4),
        _adamw(1e-2),
        lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
    ),
}


def _assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for k in actual:
        torch.testing.assert_close(actual[k], expected[k], rtol=1e-5, atol=1e-5, msg=k)


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state_dict()["state"].values() for v in s.values() if v.dim() > 0]


def _run(
    case: str,
    *,
    weights: torch.Tensor | None = None,
    prox_mu: float = 0.0,
    strategy: Any = "vmap",
    chunk_size: int | None = None,
    unroll: int | bool = 1,
) -> None:
    inner, torch_inner, server_factory = CASES[case]
    model = mlp()
    reference = copy.deepcopy(model)
    torch_loss = mse_loss(model)
    local = alg.local_training(
        bridge_mr.from_torch(torch_loss), inner, STEPS, prox_mu=prox_mu, unroll=unroll
    )
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    server_opt = server_factory(list(params.values()))
    ref_opt = server_factory(list(ref_params.values()))
    for r in range(ROUNDS):
        batches = client_batches(CLIENTS, STEPS, seed=r)
        metrics = alg.outer_step(
            local, params, batches, weights=weights, strategy=strategy, chunk_size=chunk_size
        )
        server_opt.step()
        server_opt.zero_grad()

        deltas, losses = local_deltas(
            mse_loss(reference), ref_params, batches, torch_inner, prox_mu=prox_mu
        )
        mean = weighted_mean(deltas, weights)
        for k, p in ref_params.items():
            p.grad = -mean[k]
        ref_opt.step()
        ref_opt.zero_grad()
        expected_loss = weighted_mean([{"l": v} for v in losses], weights)["l"]
        torch.testing.assert_close(metrics["loss"], expected_loss, rtol=1e-5, atol=1e-6)
    _assert_close(
        {k: v.detach() for k, v in params.items()}, {k: v.detach() for k, v in ref_params.items()}
    )
    for a, b in zip(_state_tensors(server_opt), _state_tensors(ref_opt), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_rounds_equal_the_torch_loop(case: str) -> None:
    _run(case)


@pytest.mark.slow
def test_weighting_by_example_count_equals_the_torch_loop() -> None:
    _run("fedavgm", weights=torch.tensor([10.0, 1.0, 3.0, 0.0, 6.0]))


@pytest.mark.slow
def test_fedprox_equals_the_torch_loop() -> None:
    _run("fedavg", prox_mu=0.5)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "chunk_size"), [("per_client", None), ("chunks", 2)])
def test_strategies_equal_the_torch_loop(strategy: str, chunk_size: int | None) -> None:
    _run("diloco", strategy=strategy, chunk_size=chunk_size)


@pytest.mark.parametrize("unroll", [2, True])
def test_unrolled_steps_equal_the_torch_loop(unroll: int | bool) -> None:
    _run("diloco", unroll=unroll)  # 3 steps: with 2 a step, a remainder of 1


def test_unroll_reaches_the_steps_loop() -> None:
    def loss(params: jax.Array, batch: jax.Array) -> jax.Array:
        return jnp.sum((batch - params) ** 2)

    for unroll, want in ((1, 1), (2, 2), (True, 4)):  # True: all 4 steps
        local = alg.local_training(loss, optax.sgd(0.1), steps=4, unroll=unroll)
        jaxpr = jax.make_jaxpr(local)(jnp.zeros(3), jnp.ones((4, 3)))
        (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert scan.params["unroll"] == want


def test_a_jax_loss_and_the_first_loss() -> None:
    def loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    w = torch.zeros(3, 1, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 5, 3, generator=g)
    batches = {"x": x, "y": x @ torch.ones(3, 1)}
    local = alg.local_training(loss, optax.sgd(0.1), steps=2)
    metrics = alg.outer_step(local, {"w": w}, batches, strategy="vmap")
    # The first step's loss is the server model's: mean(y**2) at w = 0.
    torch.testing.assert_close(metrics["first_loss"], (batches["y"][:, 0] ** 2).mean())
    deltas, _ = local_deltas(
        lambda p, b: ((b["x"] @ p["w"] - b["y"]) ** 2).mean(), {"w": w}, batches, _sgd(0.1)
    )
    assert w.grad is not None
    torch.testing.assert_close(w.grad, -weighted_mean(deltas, None)["w"], rtol=1e-5, atol=1e-6)


def test_outer_step_sets_minus_mean_delta_with_one_program_for_its_rounds() -> None:
    """outer_step negates inside its round's program, reused across rounds and by an equal
    LocalTraining made anew."""

    def loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(3, 1, generator=g), "b": torch.zeros(1)}
    params = {k: v.requires_grad_() for k, v in params.items()}
    x = torch.randn(4, 2, 5, 3, generator=g)
    batches = {"x": x, "y": x @ torch.ones(3, 1)}
    sgd = optax.sgd(0.1)
    before = bridge_mr.trace_counts()["map_reduce"]
    for scale in (1.0, 2.0):
        local = alg.local_training(loss, sgd, steps=2)  # equal, not the same
        with torch.no_grad():
            params["w"].mul_(scale)
        metrics = alg.outer_step(local, params, batches, strategy="vmap")
        delta, want = alg.mean_delta(local, params, batches, strategy="vmap")
        for k, p in params.items():
            assert p.grad is not None
            torch.testing.assert_close(p.grad, -delta[k], rtol=0, atol=0)
        assert metrics.keys() == want.keys() == {"loss", "first_loss"}
        torch.testing.assert_close(metrics["loss"], want["loss"], rtol=0, atol=0)
    # One program for outer_step's rounds, one for mean_delta's.
    assert bridge_mr.trace_counts()["map_reduce"] - before == 2


def test_yogi_follows_the_papers_update() -> None:
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(6, 5)).astype(np.float32)
    p = torch.tensor(rng.normal(size=5).astype(np.float32), requires_grad=True)
    x = p.detach().numpy().astype(np.float64)
    opt = alg.Yogi([p], lr=0.05, betas=(0.9, 0.99), eps=1e-3, initial_accumulator_value=1e-6)
    m, v = np.zeros(5), np.full(5, 1e-6)
    for g in grads:  # Reddi et al. 2021, Algorithm 2 (FedYogi), with g = -Delta.
        p.grad = torch.tensor(g)
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = v - 0.01 * g**2 * np.sign(v - g**2)
        x = x - 0.05 * m / (np.sqrt(v) + 1e-3)
    np.testing.assert_allclose(p.detach().numpy(), x, rtol=1e-5, atol=1e-6)


def test_the_client_function_composes_with_map_reduce() -> None:
    model = mlp()
    local = alg.local_training(bridge_mr.from_torch(mse_loss(model)), optax.sgd(0.1), STEPS)
    batches = client_batches(CLIENTS, STEPS)
    params = dict(model.named_parameters())
    with torch.no_grad():
        out = bridge_mr.map_reduce(local, params, batches, strategy="vmap")
        delta, metrics = alg.mean_delta(local, params, batches, strategy="vmap")
    _assert_close(out["delta"], delta)
    torch.testing.assert_close(out["loss"], metrics["loss"])


def test_bad_arguments_are_named() -> None:
    loss = bridge_mr.from_torch(mse_loss(mlp()))
    with pytest.raises(ValueError, match=r"steps=\.\.\.\): expected an int >= 1.*got 0"):
        alg.local_training(loss, optax.sgd(0.1), steps=0)
    with pytest.raises(ValueError, match=r"prox_mu"):
        alg.local_training(loss, optax.sgd(0.1), steps=1, prox_mu=-1.0)
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match=r"unroll=\.\.\.\): expected an int >= 1.*got"):
            alg.local_training(loss, optax.sgd(0.1), steps=1, unroll=bad)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"optimizer"):
        alg.local_training(loss, 0.1, steps=1)  # pyright: ignore[reportArgumentType]
    local = alg.local_training(loss, optax.sgd(0.1), steps=4)
    params = dict(mlp().named_parameters())
    with pytest.raises(
        ValueError, match=r"client_batches=\.\.\.\)\['x'\].*steps=4.*\[5, 3, 6, 4\]"
    ):
        alg.outer_step(local, params, client_batches(CLIENTS, 3))
    with pytest.raises(ValueError, match=r"hparams"):
        alg.outer_step(local, params, client_batches(CLIENTS, 4), hparams=torch.tensor(0.1))
    with pytest.raises(TypeError, match=r"params=\.\.\.\): expected a mapping"):
        alg.outer_step(local, list(params.values()), client_batches(CLIENTS, 4))  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"Yogi\(lr"):
        alg.Yogi(params.values(), lr=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_clients_sharded_over_a_mesh_equal_unsharded(axis_type: str) -> None:
    from jax.sharding import AxisType

    mesh = jax.make_mesh((8,), ("clients",), axis_types=(getattr(AxisType, axis_type),))
    model = mlp()
    local = alg.local_training(bridge_mr.from_torch(mse_loss(model)), CASES["diloco"][0], STEPS)
    params = dict(model.named_parameters())
    batches = client_batches(8, STEPS)
    weights = torch.arange(1.0, 9.0)
    with torch.no_grad():
        sharded, _ = alg.mean_delta(local, params, batches, weights=weights, mesh=mesh)
        plain, _ = alg.mean_delta(local, params, batches, weights=weights, strategy="vmap")
    for k in plain:
        torch.testing.assert_close(sharded[k], plain[k], rtol=1e-5, atol=1e-6)


def test_one_sgd_step_of_lr_one_gives_the_mean_gradient() -> None:
    """FedSGD / data-parallel training: the pseudo-gradient is the clients' mean gradient."""
    model = mlp()
    loss = bridge_mr.from_torch(mse_loss(model))
    params = dict(model.named_parameters())
    batches = client_batches(CLIENTS, 1)
    alg.outer_step(alg.local_training(loss, optax.sgd(1.0), steps=1), params, batches)
    pseudo = {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
    for p in params.values():
        p.grad = None
    bridge_mr.map_reduce(loss, params, {k: v[:, 0] for k, v in batches.items()}).backward()
    _assert_close(pseudo, {k: p.grad for k, p in params.items() if p.grad is not None})
