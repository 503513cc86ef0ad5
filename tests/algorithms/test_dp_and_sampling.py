"""DP-FedAvg (clipping, noise added once, accounting by dp-accounting) and client sampling."""

from __future__ import annotations

import copy
from typing import Any

import pytest

# .venv-xla (the torch_xla leg, which selects none of these tests) has no optax.
optax = pytest.importorskip("optax", reason="needs the algorithms extra: pip install .[algorithms]")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from algorithms.torch_reference import client_batches, local_deltas, mlp, mse_loss  # noqa: E402

import bridge_mr  # noqa: E402
from bridge_mr import algorithms as alg  # noqa: E402

STEPS = 2


def _linear_local() -> alg.LocalTraining:
    """One SGD step of lr 1 on loss -<w, x>: the delta is exactly the client's x."""

    def loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
        return -jnp.sum(params["w"] * batch["x"])

    return alg.local_training(loss, optax.sgd(1.0), steps=1)


def _deltas_as_data(deltas: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x": deltas[:, None]}  # [clients, steps=1, dim]


@pytest.mark.parametrize(
    ("strategy", "chunk_size"), [("vmap", None), ("per_client", None), ("chunks", 2)]
)
def test_zero_noise_gives_the_clipped_sum_over_the_expected_cohort(
    strategy: Any, chunk_size: int | None
) -> None:
    deltas = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, -2.0], [6.0, 8.0]])  # norms 5, .5, 2, 10
    w = torch.zeros(2, requires_grad=True)
    metrics = alg.dp_outer_step(
        _linear_local(),
        {"w": w},
        _deltas_as_data(deltas),
        clip_norm=1.0,
        noise_multiplier=0.0,
        expected_clients=8.0,
        generator=torch.Generator().manual_seed(0),
        mask=torch.tensor([1.0, 1.0, 1.0, 0.0]),  # The last row is padding.
        strategy=strategy,
        chunk_size=chunk_size,
    )
    clipped = torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, -1.0]])
    assert w.grad is not None
    torch.testing.assert_close(w.grad, -clipped.sum(0) / 8.0)
    torch.testing.assert_close(metrics["clipped_fraction"], torch.tensor(2 / 3))
    torch.testing.assert_close(metrics["clients"], torch.tensor(3.0))


@pytest.mark.slow
def test_clipping_is_over_the_whole_delta_pytree() -> None:
    model = mlp()
    params = dict(model.named_parameters())
    batches = client_batches(3, STEPS)
    local = alg.local_training(bridge_mr.from_torch(mse_loss(model)), optax.sgd(0.5), STEPS)
    deltas, _ = local_deltas(mse_loss(copy.deepcopy(model)), params, batches, _sgd(0.5))
    norms = [torch.sqrt(sum((d**2).sum() for d in delta.values())) for delta in deltas]
    clip = float(min(norms)) * 0.9  # Every client is clipped; per-leaf clipping would differ.
    alg.dp_outer_step(
        local,
        params,
        batches,
        clip_norm=clip,
        noise_multiplier=0.0,
        expected_clients=3.0,
        generator=torch.Generator().manual_seed(0),
    )
    for k, p in params.items():
        expected = sum(d[k] * clip / n for d, n in zip(deltas, norms, strict=True)) / 3.0
        assert p.grad is not None
        torch.testing.assert_close(p.grad, -expected, rtol=1e-5, atol=1e-6)


def _sgd(lr: float):
    return lambda ps: torch.optim.SGD(ps, lr=lr)


@pytest.mark.parametrize("clients", [2, 16])
def test_the_noise_is_added_once_to_the_sum(clients: int) -> None:
    """Per coordinate, the noise's std is z*C/m whatever the client count: added once."""
    dim, clip, z, m, keys = 256, 0.5, 2.0, 4.0, 50
    deltas = torch.zeros(clients, dim)  # Zero deltas: the update is the noise alone.
    w = torch.zeros(dim, requires_grad=True)
    local = _linear_local()
    samples = []
    before = bridge_mr.trace_counts()["map_reduce"]
    for seed in range(keys):
        alg.dp_outer_step(
            local,
            {"w": w},
            _deltas_as_data(deltas),
            clip_norm=clip,
            noise_multiplier=z,
            expected_clients=m,
            generator=torch.Generator().manual_seed(seed),
            strategy="vmap",
        )
        assert w.grad is not None
        samples.append(w.grad.clone())
    assert bridge_mr.trace_counts()["map_reduce"] - before == 1  # One program for all rounds.
    noise = torch.stack(samples).flatten()  # 12,800 draws.
    expected_std = z * clip / m
    # The sample std of n normal draws has relative standard error 1/sqrt(2n) (0.6% here):
    # 5% is over 8 standard errors; noise per client would give sqrt(clients) times the std.
    assert abs(noise.std().item() / expected_std - 1) < 0.05
    assert abs(noise.mean().item()) < 5 * expected_std / noise.numel() ** 0.5
    # The same generator seed gives the same noise: the key is the user's.
    alg.dp_outer_step(
        local,
        {"w": w},
        _deltas_as_data(deltas),
        clip_norm=clip,
        noise_multiplier=z,
        expected_clients=m,
        generator=torch.Generator().manual_seed(keys - 1),
        strategy="vmap",
    )
    torch.testing.assert_close(w.grad, samples[-1])


@pytest.mark.slow  # dp-accounting takes seconds to import.
@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_the_accountant_agrees_with_dp_accounting(kind: str) -> None:
    import dp_accounting

    accountant = alg.PrivacyAccountant(1.1, 0.02, accountant=kind)  # pyright: ignore[reportArgumentType]
    assert accountant.epsilon(1e-5) == 0.0
    for _ in range(3):
        accountant.step(10)
    direct = (
        dp_accounting.rdp.RdpAccountant() if kind == "rdp" else dp_accounting.pld.PLDAccountant()
    )
    event = dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1))
    direct.compose(event, 30)
    assert accountant.epsilon(1e-5) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)
    assert accountant.epsilon(1e-5) > 0


def test_dp_bad_arguments_are_named() -> None:
    local = _linear_local()
    args = ({"w": torch.zeros(2)}, _deltas_as_data(torch.zeros(3, 2)))
    kwargs = {"noise_multiplier": 1.0, "expected_clients": 3.0, "generator": torch.Generator()}
    with pytest.raises(
        ValueError, match=r"clip_norm=\.\.\.\): expected a finite number > 0, got 0"
    ):
        alg.dp_outer_step(local, *args, clip_norm=0.0, **kwargs)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"noise_multiplier"):
        alg.dp_outer_step(local, *args, clip_norm=1.0, **{**kwargs, "noise_multiplier": -1.0})  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"generator"):
        alg.dp_outer_step(local, *args, clip_norm=1.0, **{**kwargs, "generator": 0})  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"mask=\.\.\.\): expected a tensor of shape \[3\]"):
        alg.dp_outer_step(local, *args, clip_norm=1.0, mask=torch.ones(4), **kwargs)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"sampling_probability"):
        alg.PrivacyAccountant(1.0, 0.0)
    with pytest.raises(
        ValueError,
        match=r"probability=\.\.\.\): expected a sampling probability in \(0, 1\], got 1.5",
    ):
        alg.ClientSampler(10, probability=1.5, generator=0)
    with pytest.raises(ValueError, match=r"exactly one of"):
        alg.ClientSampler(10, generator=0)
    with pytest.raises(ValueError, match=r"cohort_size"):
        alg.ClientSampler(10, cohort_size=11, generator=0)


def test_uniform_sampling_draws_distinct_clients_from_the_generator() -> None:
    a = alg.ClientSampler(20, cohort_size=5, generator=7)
    b = alg.ClientSampler(20, cohort_size=5, generator=torch.Generator().manual_seed(7))
    cohorts = [a.sample() for _ in range(30)]
    assert all(c.size == c.padded_size == 5 for c in cohorts)
    assert all(len(set(c.indices.tolist())) == 5 for c in cohorts)
    assert [c.indices.tolist() for c in cohorts[:3]] == [
        b.sample().indices.tolist() for _ in range(3)
    ]
    assert len({tuple(c.indices.tolist()) for c in cohorts}) > 1
    assert a.sampling_probability == 0.25
    assert a.expected_cohort_size == 5.0


def test_poisson_sampling_frequency() -> None:
    sampler = alg.ClientSampler(50, probability=0.2, generator=3)
    counts = torch.zeros(50)
    sizes = []
    for _ in range(400):
        cohort = sampler.sample()
        counts[cohort.indices] += 1
        sizes.append(cohort.size)
        assert cohort.padded_size >= max(cohort.size, 1)
        assert cohort.padded_size & (cohort.padded_size - 1) == 0  # A power of two.
    # 20,000 Bernoulli(0.2) draws: mean 0.2 +- 0.003 (one standard error).
    assert abs(counts.sum().item() / 20000 - 0.2) < 0.012
    assert len(set(sizes)) > 3  # The cohort size varies.


@pytest.mark.slow
def test_poisson_cohorts_compile_few_programs_and_equal_the_unpadded_round() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    local = alg.local_training(bridge_mr.from_torch(mse_loss(model)), optax.sgd(0.2), STEPS)
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    data = client_batches(24, STEPS, seed=5)
    counts = torch.arange(1, 25, dtype=torch.float32)
    sampler = alg.ClientSampler(24, probability=0.3, generator=11)
    server_opt = torch.optim.SGD(params.values(), lr=1.0, momentum=0.5)
    ref_opt = torch.optim.SGD(ref_params.values(), lr=1.0, momentum=0.5)
    before = bridge_mr.trace_counts()["map_reduce"]
    sizes, padded = set(), set()
    for _ in range(12):
        cohort = sampler.sample()
        if cohort.size == 0:
            continue
        sizes.add(cohort.size)
        padded.add(cohort.padded_size)
        alg.outer_step(
            local, params, cohort.gather(data), weights=cohort.weights(counts), strategy="vmap"
        )
        server_opt.step()
        server_opt.zero_grad()
        # Unpadded: the sampled clients only, by the same map_reduce.
        alg.outer_step(
            local,
            ref_params,
            {k: v[cohort.indices] for k, v in data.items()},
            weights=counts[cohort.indices],
            strategy="vmap",
        )
        ref_opt.step()
        ref_opt.zero_grad()
    traced = bridge_mr.trace_counts()["map_reduce"] - before
    assert len(sizes) > len(padded)  # Several cohort sizes share a padded size.
    assert traced == len(padded) + len(sizes)  # One trace per padded size (the rest: unpadded).
    for k, p in params.items():
        torch.testing.assert_close(p.detach(), ref_params[k].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dp_fedavg_rounds_equal_the_torch_loop() -> None:
    """Poisson cohorts, clipping, noise and a momentum server over 3 rounds, against torch."""
    model = mlp()
    reference = copy.deepcopy(model)
    local = alg.local_training(bridge_mr.from_torch(mse_loss(model)), optax.sgd(0.5), STEPS)
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    data = client_batches(12, STEPS, seed=4)
    clip, z = 0.05, 0.7
    sampler = alg.ClientSampler(12, probability=0.5, generator=21)
    ref_sampler = alg.ClientSampler(12, probability=0.5, generator=21)
    noise, ref_noise = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    server_opt = torch.optim.SGD(params.values(), lr=1.0, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_params.values(), lr=1.0, momentum=0.9)
    clipped_any = False
    for _ in range(3):
        cohort = sampler.sample()
        metrics = alg.dp_outer_step(
            local,
            params,
            cohort.gather(data),
            mask=cohort.weights(),
            clip_norm=clip,
            noise_multiplier=z,
            expected_clients=sampler.expected_cohort_size,
            generator=noise,
        )
        server_opt.step()
        server_opt.zero_grad()
        clipped_any |= metrics["clipped_fraction"].item() > 0

        indices = ref_sampler.sample().indices
        deltas, _ = local_deltas(
            mse_loss(reference),
            ref_params,
            {k: v[indices] for k, v in data.items()},
            _sgd(0.5),
        )
        for k, p in ref_params.items():
            total = torch.zeros_like(p)
            for d in deltas:
                norm = torch.sqrt(sum((v**2).sum() for v in d.values()))
                total = total + d[k] * min(1.0, clip / norm.item())
            total = total + z * clip * torch.randn(p.shape, generator=ref_noise)
            p.grad = -total / ref_sampler.expected_cohort_size
        ref_opt.step()
        ref_opt.zero_grad()
    assert clipped_any
    for k, p in params.items():
        torch.testing.assert_close(p.detach(), ref_params[k].detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(server_opt.state.values(), ref_opt.state.values(), strict=True):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"], rtol=1e-5, atol=1e-6)
