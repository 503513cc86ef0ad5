"""The model rounds (CNN, transformer LM): every alternative computes the same FedAvg round."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

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
def test_alternatives_compute_the_same_round(
    workloads: ModuleType, assert_same_round: Callable[..., None], model: str
) -> None:
    cfg = workloads.round_config(model, 3, batch=2, local_steps=2, lr=0.5, seq=16)
    torch_model = workloads.round_torch_model(cfg)
    assert_same_round(cfg, torch_model, workloads.round_alternatives(), moved=1e-2, atol=2e-5)
