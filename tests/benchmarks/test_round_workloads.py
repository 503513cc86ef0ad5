"""The model rounds (CNN, transformer LM): every alternative computes the same FedAvg round."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from helpers import assert_trees_all_close

pytestmark = pytest.mark.filterwarnings(
    "ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning"
)


def test_the_cnn_is_pfls_simple_cnn(workloads: ModuleType) -> None:
    cfg = workloads.round_config("cnn", 50)
    params = cfg.params()
    assert params["n_params"] == 1_626_442  # pfl-research's CIFAR10 simple_cnn: ~1.63M.
    assert params["examples_per_client"] == 50
    assert (cfg.batch, cfg.local_steps) == (10, 5)
    x, y = workloads.round_data(workloads.round_config("cnn", 2))
    assert x.shape == (2, 5, 10, 3, 32, 32)
    assert y.shape == (2, 5, 10, 10)


def test_the_lm_reads_the_standard_library(workloads: ModuleType) -> None:
    cfg = workloads.round_config("lm", 3)
    (tokens,) = workloads.round_data(cfg)
    assert tokens.shape == (3, cfg.local_steps, cfg.batch, cfg.seq + 1)
    assert tokens.dtype == np.int32
    text = bytes(tokens[0, 0, 0].astype(np.uint8))
    assert text.isascii()  # Python source, not random bytes.
    assert workloads.round_data(cfg)[0].tobytes() == tokens.tobytes()  # Deterministic.


@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "lm"])
def test_alternatives_compute_the_same_round(workloads: ModuleType, model: str) -> None:
    cfg = workloads.round_config(model, 3, batch=2, local_steps=2, lr=0.5, seq=16)
    torch_model = workloads.round_torch_model(cfg)
    names = [name for name, _ in torch_model.named_parameters()]
    initial = [p.detach().numpy().copy() for p in torch_model.parameters()]
    rounds = {}
    for alternative in workloads.round_alternatives():
        fn = workloads.build(alternative, cfg)
        assert callable(fn), fn
        result = fn()  # JAX ones: a dict of arrays; the torch ones: the parameters in order.
        params = [result[n] for n in names] if isinstance(result, dict) else result
        rounds[alternative] = list(params)
    reference = rounds.pop("torch_loop")
    moved = max(
        float(np.abs(r.detach().numpy() - i).max()) for r, i in zip(reference, initial, strict=True)
    )
    assert moved > 1e-2  # The round changed the parameters, so agreement means something.
    for params in rounds.values():
        assert_trees_all_close(params, reference, rtol=1e-4, atol=2e-5)
