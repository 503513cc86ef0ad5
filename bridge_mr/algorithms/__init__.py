"""Federated and distributed-training algorithms for torch users, built on `bridge_mr.map_reduce`.

The clients run JAX (an optax inner optimizer over a `bridge_mr.from_torch`-converted torch
loss, or any JAX loss); the server is plain torch: `outer_step` sets each parameter's `.grad`
to the pseudo-gradient (minus the clients' mean delta) and any `torch.optim` optimizer steps
it::

    import optax, torch, bridge_mr
    from bridge_mr import algorithms as alg

    loss = bridge_mr.from_torch(torch_loss)  # or any JAX fn (params, batch) -> scalar loss
    local = alg.local_training(loss, optax.adamw(1e-3), steps=H)  # H inner steps (lax.scan)
    server_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    params = dict(model.named_parameters())
    for round_batches in rounds:  # leaves shaped [clients, H, batch, ...]
        metrics = alg.outer_step(local, params, round_batches, weights=None)
        server_opt.step()
        server_opt.zero_grad()

| algorithm | inner (`local_training`) | outer (`torch.optim` over `outer_step`'s grads) |
|---|---|---|
| FedSGD (data-parallel) | `optax.sgd(1.0)`, `steps=1` (delta = -grad) | `torch.optim.AdamW` |
| FedAvg | `optax.sgd(lr)` | `torch.optim.SGD(lr=1.0)` |
| FedAvgM | `optax.sgd(lr)` | `torch.optim.SGD(lr, momentum=0.9)` |
| FedAdam | `optax.sgd(lr)` | `torch.optim.Adam(lr, eps=1e-3)` |
| FedYogi | `optax.sgd(lr)` | `alg.Yogi(lr)` |
| FedProx | `local_training(..., prox_mu=mu)` | any |
| DiLoCo | `optax.adamw(lr)` | `torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)` |

Each client's inner-optimizer state starts fresh every round (only parameters are sent).
`weights=` weights the mean by example count (and zeroes padding); `strategy=`, `chunk_size=`
and `mesh=` pass through to `bridge_mr.map_reduce`. `mean_delta` is the same round without
the `.grad` write, differentiable with respect to the parameters and to `hparams` (pass an
optimizer factory such as `lambda lr: optax.sgd(lr)` to `local_training`).

Client sampling and DP-FedAvg (user-level differential privacy)::

    sampler = alg.ClientSampler(num_clients, probability=q, generator=0)  # seed or Generator
    noise = torch.Generator().manual_seed(1)  # the DP noise's source: yours, never global
    accountant = alg.PrivacyAccountant(noise_multiplier=z, sampling_probability=q)
    for _ in range(rounds):
        cohort = sampler.sample()  # Poisson: the size varies, padded to a power of two
        metrics = alg.dp_outer_step(local, params, cohort.gather(all_batches),
                                    mask=cohort.weights(), clip_norm=C, noise_multiplier=z,
                                    expected_clients=sampler.expected_cohort_size,
                                    generator=noise)
        server_opt.step()
        server_opt.zero_grad()
        accountant.step()
    print(accountant.epsilon(delta=1e-5))  # by dp-accounting's RDP (or PLD) accountant

`dp_outer_step` clips each client's whole delta to L2 norm C, sums, adds N(0, (zC)^2) noise
once to the sum and divides by the expected cohort size. Without DP, `outer_step(...,
weights=cohort.weights(example_counts))` gives padding rows weight 0.
"""

from ._dp import PrivacyAccountant as PrivacyAccountant
from ._dp import dp_outer_step as dp_outer_step
from ._local import LocalTraining as LocalTraining
from ._local import local_training as local_training
from ._rounds import mean_delta as mean_delta
from ._rounds import outer_step as outer_step
from ._sampling import ClientSampler as ClientSampler
from ._sampling import Cohort as Cohort
from ._yogi import Yogi as Yogi

__all__ = [
    "ClientSampler",
    "Cohort",
    "LocalTraining",
    "PrivacyAccountant",
    "Yogi",
    "dp_outer_step",
    "local_training",
    "mean_delta",
    "outer_step",
]
