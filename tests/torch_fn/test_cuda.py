"""from_torch on CUDA: `map_reduce(from_torch(loss)).backward()` equals a torch loop, and torch's
own autograd still works in the same process afterwards.

With torchax's process-wide registration (its PrivateUse1 backend named "jax"), torch took "jax"
for the process's accelerator and the CUDA autograd engine asked it for streams: this backward,
and every torch backward after it, failed ("PyTorch is not linked with support for jax devices").

float32 on both sides at full precision (no TF32: JAX's `highest` matmul precision, torch's
cuDNN TF32 off), smooth activations (GELU, tanh/sigmoid in the LSTM) so that no ReLU kink
decides the comparison; gradients per leaf as ||got - torch|| / ||torch||.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import pytest
import torch
import torch.nn.functional as F
from helpers.precision import assert_leaves_close
from torch import nn

import bridge_mr

pytestmark = pytest.mark.cuda  # Skipped without a GPU (tests/conftest.py).

CLIENTS = 3
RTOL = 1e-4

State = dict[str, torch.Tensor]
Batch = dict[str, torch.Tensor]


class ConvBatchNorm(nn.Module):
    """Conv2d -> BatchNorm2d -> GELU, twice, average-pooled, then a linear head.

    The convolutions have no bias, as usual before BatchNorm: its gradient is zero in exact
    arithmetic (BatchNorm subtracts the mean), so both sides would hold rounding only."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.GELU(),
            nn.Conv2d(8, 8, 3, stride=2, bias=False),
            nn.BatchNorm2d(8),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class EmbeddingLSTM(nn.Module):
    """Token ids -> nn.Embedding -> 2-layer nn.LSTM (batch_first) -> the last step's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.rnn = nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _classify(model: nn.Module, state: State, batch: Batch) -> torch.Tensor:
    logits = torch.func.functional_call(model, state, (batch["x"],))
    return F.cross_entropy(logits, batch["y"])


def _language_model(model: nn.Module, state: State, batch: Batch) -> torch.Tensor:
    ids = batch["x"]
    return torch.func.functional_call(model, state, (), {"input_ids": ids, "labels": ids}).loss


def _batches(name: str, g: torch.Generator) -> Batch:
    """`[CLIENTS, 4, ...]` client data for model `name`."""
    if name == "conv_batch_norm":
        x = torch.randn(CLIENTS, 4, 3, 12, 12, generator=g)
    else:
        x = torch.randint(0, 40, (CLIENTS, 4, 8), generator=g)
    return {"x": x, "y": torch.randint(0, 5, (CLIENTS, 4), generator=g)}


#: name -> (model builder, torch loss, whether training writes buffers).
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor], bool]] = {
    "conv_batch_norm": (ConvBatchNorm, _classify, True),
    "gpt2": (_gpt2, _language_model, False),
    "embedding_lstm": (EmbeddingLSTM, _classify, False),
}


@pytest.fixture
def full_precision() -> Iterator[None]:
    """float32 without TF32 in both torch (cuDNN convolutions) and JAX (matmuls, convolutions)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with jax.default_matmul_precision("highest"):
            yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.usefixtures("full_precision")
@pytest.mark.parametrize("name", list(MODELS))
def test_map_reduce_of_from_torch_backward_on_cuda_equals_a_torch_loop(name: str) -> None:
    build, torch_loss, writes_buffers = MODELS[name]
    torch.manual_seed(0)
    model = build().to("cuda").train()
    data = {k: v.to("cuda") for k, v in _batches(name, torch.Generator().manual_seed(1)).items()}
    params = dict(model.named_parameters())
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}

    def loss(state: State, batch: Batch) -> torch.Tensor:
        return torch_loss(model, state, batch)

    # mutable=0: BatchNorm's running statistics come back as the state's new value.
    converted = (
        bridge_mr.from_torch(loss, mutable=0) if writes_buffers else bridge_mr.from_torch(loss)
    )

    def client(state: State, batch: Batch) -> Any:
        return converted(state, batch)

    out = bridge_mr.map_reduce(client, {**params, **buffers}, data)
    value, new_state = out if writes_buffers else (out, None)
    value.backward()
    got = {k: p.grad for k, p in params.items()}
    assert all(g is not None and g.device.type == "cuda" for g in got.values())

    reference = {k: p.detach().clone().requires_grad_() for k, p in params.items()}
    values, after = [], []
    for c in range(CLIENTS):
        state = {**reference, **{k: v.clone() for k, v in buffers.items()}}
        values.append(loss(state, {k: v[c] for k, v in data.items()}))
        after.append(state)
    want = torch.stack(values).mean()
    want.backward()  # a plain torch backward on CUDA, after bridge_mr's in the same process
    assert float(value.detach()) == pytest.approx(float(want.detach()), rel=RTOL)
    assert_leaves_close(got, {k: p.grad for k, p in reference.items()}, RTOL, f"{name} gradient")
    if new_state is not None:
        running = [k for k, v in buffers.items() if v.is_floating_point()]
        mean = {k: torch.stack([s[k] for s in after]).mean(0) for k in running}
        assert_leaves_close(
            {k: new_state[k] for k in running}, mean, RTOL, f"{name} running statistics"
        )
    assert torch.accelerator.current_accelerator() == torch.device("cuda")
