"""Federated data for torch users: client datasets, partitions and per-round batches, on device.

A `FederatedDataset` keeps every example on the device the rounds run on (CPU, CUDA, a
torch-xla device), sorted by client. A partitioner says which client holds each example; a
`ClientSampler` draws each round's cohort; `round()` gathers the cohort's
`[clients, steps, batch_size, ...]` batches with one index computation and one gather per
field, plus a `"mask"` for short clients and per-client `weights` for the mean; `rounds()`
is the loop of both::

    import torch, bridge_mr
    from bridge_mr import algorithms as alg, data as fd

    train = fd.FederatedDataset.from_tensors(
        {"x": images, "y": labels}, fd.Dirichlet(num_clients=500, alpha=0.3, seed=0),
        device="cuda")
    sampler = train.sampler(cohort_size=50, generator=1)  # or probability=q for DP
    # generator: the batches' order, from your seed (or torch.Generator), never global
    for rnd in fd.rounds(train, 100, sampler=sampler, batch_size=10, epochs=1, generator=2):
        alg.outer_step(local, params, rnd.batches, weights=rnd.weights)  # loss honours "mask"

| partitioner | clients get |
|---|---|
| `IID(n)` | a shuffled, near-equal share (`drop_remainder=True`: equal) |
| `IID(examples_per_client=k)` | `k` shuffled examples each, as many clients as fill |
| `Dirichlet(n, alpha, label="y")` | each label split by a Dirichlet(alpha) draw |
| `Shards(n, shards_per_client=2)` | label-sorted shards, McMahan et al. (`drop_remainder`: equal) |
| `NaturalKey("user")` | one client per distinct value of a field |

`FederatedDataset.from_dataset` reads a map-style `torch.utils.data.Dataset` (a torchvision
one, a Hugging Face `datasets` one with `.with_format("torch")`) once; `from_clients` takes a
dict of per-client tensors; `digits` is scikit-learn's digits, federated. See docs/data.md.
"""

from ._dataset import FederatedDataset as FederatedDataset
from ._digits import digits as digits
from ._loop import rounds as rounds
from ._partition import IID as IID
from ._partition import Dirichlet as Dirichlet
from ._partition import NaturalKey as NaturalKey
from ._partition import Shards as Shards
from ._rounds import Round as Round

__all__ = [
    "IID",
    "Dirichlet",
    "FederatedDataset",
    "NaturalKey",
    "Round",
    "Shards",
    "digits",
    "rounds",
]
