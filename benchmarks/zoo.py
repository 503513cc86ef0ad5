"""The model zoo: small random-init configs of the torch models users train, with a client loss.

Each `ZooModel` builds a model (seeded, training mode, dropout off so that torch and JAX can be
compared value for value), a batch maker (int64 labels and token ids, as a torch user has them),
and the client loss written the usual torch way: `torch.func.functional_call(model, state,
...)` and the model's own `labels=` loss or `F.cross_entropy`. Models with BatchNorm train their
running statistics, which `from_torch(..., mutable=1)` hands back.

Used by the tests (`tests/torch_fn/test_model_zoo.py`: loss and gradients against torch
autograd, `map_reduce` against a torch loop) and by the "zoo" benchmark case (compile time of
`jax.jit(jax.value_and_grad(...))`, step time against torch eager). Needs `transformers` (no
downloaded weights, no torchvision).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]
State = dict[str, torch.Tensor]

VOCAB = 64
SEQ = 16
IMAGE = 32
CLASSES = 5


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One zoo model.

    Attributes:
      name: the zoo's key.
      source: where the model code comes from ("transformers" or "torch.nn").
      build: a new model in training mode (random init, seeded by the caller).
      batch: `batch(generator, size)`, a batch of `size` examples as torch tensors.
      loss: the client loss in torch, `loss(model, state, batch)`; `state` is every parameter
        and buffer by name, as `functional_call` takes it.
      batch_norm: whether training updates buffers (BatchNorm's running statistics).
      what: the layers and options the model exercises, for the docs' table.
    """

    name: str
    source: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], Batch]
    loss: Callable[[nn.Module, State, Batch], torch.Tensor]
    batch_norm: bool
    what: str


def _ids(g: torch.Generator, size: int) -> torch.Tensor:
    return torch.randint(VOCAB, (size, SEQ), generator=g)


def _padding_mask(g: torch.Generator, size: int) -> torch.Tensor:
    """1 for tokens, 0 for right padding; every row keeps at least half its tokens."""
    lengths = torch.randint(SEQ // 2, SEQ + 1, (size,), generator=g)
    return (torch.arange(SEQ)[None, :] < lengths[:, None]).long()


def _lm_batch(g: torch.Generator, size: int) -> Batch:
    return {"input_ids": _ids(g, size)}


def _classify_batch(g: torch.Generator, size: int) -> Batch:
    return {
        "input_ids": _ids(g, size),
        "attention_mask": _padding_mask(g, size),
        "labels": torch.randint(CLASSES, (size,), generator=g),
    }


def _seq2seq_batch(g: torch.Generator, size: int) -> Batch:
    return {
        "input_ids": _ids(g, size),
        "attention_mask": _padding_mask(g, size),
        "labels": torch.randint(1, VOCAB, (size, SEQ // 2), generator=g),
    }


def _image_batch(g: torch.Generator, size: int) -> Batch:
    return {
        "pixel_values": torch.randn(size, 3, IMAGE, IMAGE, generator=g),
        "labels": torch.randint(CLASSES, (size,), generator=g),
    }


def _text_batch(g: torch.Generator, size: int) -> Batch:
    return {"ids": _ids(g, size), "labels": torch.randint(CLASSES, (size,), generator=g)}


def _padded_text_batch(g: torch.Generator, size: int) -> Batch:
    return {**_text_batch(g, size), "mask": _padding_mask(g, size)}


def _lm_loss(model: nn.Module, state: State, batch: Batch) -> torch.Tensor:
    """A causal LM's own loss: `labels=` the input ids (transformers shifts them)."""
    ids = batch["input_ids"]
    return torch.func.functional_call(model, state, (), {"input_ids": ids, "labels": ids}).loss


def _hf_loss(model: nn.Module, state: State, batch: Batch) -> torch.Tensor:
    """A transformers model's own loss, its inputs as keyword arguments (`labels=` among them)."""
    return torch.func.functional_call(model, state, (), dict(batch)).loss


def _nn_loss(model: nn.Module, state: State, batch: Batch) -> torch.Tensor:
    inputs = tuple(batch[k] for k in ("ids", "mask", "pixel_values") if k in batch)
    return F.cross_entropy(torch.func.functional_call(model, state, inputs), batch["labels"])


def _gpt2(attention: str) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=2 * SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = attention
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=2 * SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def _bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=2 * SEQ,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    return transformers.BertForSequenceClassification(config)


def _t5() -> nn.Module:
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def _vit() -> nn.Module:
    import transformers

    config = transformers.ViTConfig(
        image_size=IMAGE,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(config)


def _resnet() -> nn.Module:
    import transformers

    config = transformers.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
        num_labels=CLASSES,
    )
    return transformers.ResNetForImageClassification(config)


def _convnext() -> nn.Module:
    import transformers

    config = transformers.ConvNextConfig(
        num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=CLASSES, drop_path_rate=0.0
    )
    return transformers.ConvNextForImageClassification(config)


def _mobilenet_v2() -> nn.Module:
    import transformers

    config = transformers.MobileNetV2Config(
        image_size=IMAGE, depth_multiplier=0.35, num_labels=CLASSES, classifier_dropout_prob=0.0
    )
    return transformers.MobileNetV2ForImageClassification(config)


def _efficientnet() -> nn.Module:
    import transformers

    config = transformers.EfficientNetConfig(
        image_size=IMAGE,
        width_coefficient=0.25,
        depth_coefficient=0.25,
        hidden_dim=320,  # the top convolution's width: round_filters(1280) at width 0.25
        dropout_rate=0.0,
        drop_connect_rate=0.0,
        num_labels=CLASSES,
    )
    return transformers.EfficientNetForImageClassification(config)


class RecurrentClassifier(nn.Module):
    """Token ids -> nn.Embedding -> nn.LSTM / nn.GRU (batch_first) -> the last step's logits."""

    def __init__(self, kind: type[nn.LSTM] | type[nn.GRU]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = kind(16, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


class EncoderClassifier(nn.Module):
    """nn.TransformerEncoder over embedded tokens, `src_key_padding_mask` from the padding mask,
    mean-pooled over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(ids), src_key_padding_mask=mask == 0)
        keep = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * keep).sum(1) / keep.sum(1))


class GroupNormCNN(nn.Module):
    """Conv2d -> GroupNorm -> SiLU -> max-pool, twice, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.SiLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.GroupNorm(8, 32),
            nn.SiLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, CLASSES)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(pixel_values).flatten(1))


def _entries() -> list[ZooModel]:
    hf = "transformers"
    return [
        ZooModel("gpt2", hf, lambda: _gpt2("sdpa"), _lm_batch, _lm_loss, False,
                 "GPT2LMHeadModel, sdpa attention, labels= loss"),
        ZooModel("gpt2_eager", hf, lambda: _gpt2("eager"), _lm_batch, _lm_loss, False,
                 "GPT2LMHeadModel, eager attention"),
        ZooModel("llama", hf, _llama, _lm_batch, _lm_loss, False,
                 "LlamaForCausalLM, sdpa, grouped-query attention, rotary embeddings"),
        ZooModel("bert", hf, _bert, _classify_batch, _hf_loss, False,
                 "BertForSequenceClassification with a padding attention_mask"),
        ZooModel("t5", hf, _t5, _seq2seq_batch, _hf_loss, False,
                 "T5ForConditionalGeneration (encoder-decoder, relative position buckets), "
                 "padding mask, labels="),
        ZooModel("vit", hf, _vit, _image_batch, _hf_loss, False,
                 "ViTForImageClassification"),
        ZooModel("resnet", hf, _resnet, _image_batch, _hf_loss, True,
                 "ResNetForImageClassification (BatchNorm, running statistics via mutable=)"),
        ZooModel("convnext", hf, _convnext, _image_batch, _hf_loss, False,
                 "ConvNextForImageClassification (depthwise 7x7, LayerNorm, layer scale)"),
        ZooModel("mobilenet_v2", hf, _mobilenet_v2, _image_batch, _hf_loss, True,
                 "MobileNetV2ForImageClassification (depthwise, BatchNorm, ReLU6)"),
        ZooModel("efficientnet", hf, _efficientnet, _image_batch, _hf_loss, True,
                 "EfficientNetForImageClassification (squeeze-excite, BatchNorm, SiLU)"),
        ZooModel("lstm_text", "torch.nn", lambda: RecurrentClassifier(nn.LSTM), _text_batch,
                 _nn_loss, False, "nn.Embedding -> 2-layer nn.LSTM (batch_first) -> nn.Linear"),
        ZooModel("gru_text", "torch.nn", lambda: RecurrentClassifier(nn.GRU), _text_batch,
                 _nn_loss, False, "nn.Embedding -> 2-layer nn.GRU (batch_first) -> nn.Linear"),
        ZooModel("transformer_encoder", "torch.nn", EncoderClassifier, _padded_text_batch,
                 _nn_loss, False, "nn.TransformerEncoder with src_key_padding_mask"),
        ZooModel("cnn_groupnorm", "torch.nn", GroupNormCNN, _image_batch, _nn_loss, False,
                 "Conv2d, GroupNorm, SiLU, max-pool, adaptive avg-pool"),
    ]  # fmt: skip


#: The zoo by name.
ZOO: dict[str, ZooModel] = {m.name: m for m in _entries()}


def build(name: str, seed: int = 0) -> nn.Module:
    """Zoo model `name`, its parameters drawn from `seed`, in training mode."""
    torch.manual_seed(seed)
    return ZOO[name].build().train()


def split_state(model: nn.Module) -> tuple[State, State]:
    """The model's parameters and buffers, detached, by name (the converted loss's arguments)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    return params, buffers


def client_loss(entry: ZooModel, model: nn.Module) -> Callable[..., Any]:
    """The torch client loss `(params, buffers, batch) -> loss`, as a user writes it for
    `from_torch` (convert with `mutable=1` when `entry.batch_norm`)."""

    def loss(params: State, buffers: State, batch: Batch) -> torch.Tensor:
        return entry.loss(model, {**params, **buffers}, batch)

    return loss


def timings(names: list[str], rounds: int = 5) -> list[dict[str, Any]]:
    """Per model: the first call of `jax.jit(jax.value_and_grad(from_torch(loss)))` (trace and
    compile), then `rounds` interleaved later calls of it and of a torch eager step (forward and
    backward of the same loss), each round with the 1-minute load average beside it.

    Run as `python -m benchmarks.zoo [NAME ...]`, which prints a markdown table.
    """
    import os
    import statistics
    import time

    import jax
    import jax.numpy as jnp

    import bridge_mr

    rows = []
    for name in names:
        entry = ZOO[name]
        model = build(name)
        params, buffers = split_state(model)
        batch = entry.batch(torch.Generator().manual_seed(1), 4)
        loss = client_loss(entry, model)
        converted = bridge_mr.from_torch(loss, mutable=1 if entry.batch_norm else ())
        step = jax.jit(jax.value_and_grad(converted, has_aux=entry.batch_norm))
        args = jax.tree.map(lambda t: jnp.asarray(t.numpy()), (params, buffers, batch))
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        first = time.perf_counter() - start
        ours, theirs, loads = [], [], []
        for _ in range(rounds):
            loads.append(os.getloadavg()[0])
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            ours.append(time.perf_counter() - start)
            trainable = {k: v.clone().requires_grad_() for k, v in params.items()}
            start = time.perf_counter()
            loss(trainable, {k: v.clone() for k, v in buffers.items()}, batch).backward()
            theirs.append(time.perf_counter() - start)
        rows.append(
            {
                "name": name,
                "first_call_s": first,
                "step_ms": 1e3 * statistics.median(ours),
                "torch_eager_ms": 1e3 * statistics.median(theirs),
                "load_1min": max(loads),
            }
        )
    return rows


if __name__ == "__main__":
    import sys

    print("| model | first call (s) | later step (ms) | torch eager (ms) | ratio | load |")
    print("|---|---|---|---|---|---|")
    for row in timings(sys.argv[1:] or list(ZOO)):
        print(
            f"| `{row['name']}` | {row['first_call_s']:.1f} | {row['step_ms']:.1f} | "
            f"{row['torch_eager_ms']:.1f} | {row['step_ms'] / row['torch_eager_ms']:.2f} | "
            f"{row['load_1min']:.2f} |",
            flush=True,
        )
