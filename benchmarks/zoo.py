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
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]
State = dict[str, torch.Tensor]
#: A client loss in torch: `loss(model, state, batch)`.
Loss = Callable[[nn.Module, State, Batch], torch.Tensor]

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
    loss: Loss
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


_GPT2 = ("GPT2Config", "GPT2LMHeadModel", dict(
    vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # fmt: skip

#: The transformers models: zoo name -> (config class, model class, the config's arguments).
TRANSFORMERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": _GPT2,
    "gpt2_eager": _GPT2,
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=2 * SEQ, bos_token_id=0, eos_token_id=0)),
    "bert": ("BertConfig", "BertForSequenceClassification", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=2 * SEQ, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)),
    "vit": ("ViTConfig", "ViTForImageClassification", dict(
        image_size=IMAGE, patch_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", dict(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
        num_labels=CLASSES)),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", dict(
        num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=CLASSES,
        drop_path_rate=0.0)),
    "mobilenet_v2": ("MobileNetV2Config", "MobileNetV2ForImageClassification", dict(
        image_size=IMAGE, depth_multiplier=0.35, num_labels=CLASSES,
        classifier_dropout_prob=0.0)),
    "efficientnet": ("EfficientNetConfig", "EfficientNetForImageClassification", dict(
        image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.25,
        hidden_dim=320,  # the top convolution's width: round_filters(1280) at width 0.25
        dropout_rate=0.0, drop_connect_rate=0.0, num_labels=CLASSES)),
}  # fmt: skip

#: The attention implementation of the zoo's GPT-2 variants, set on the config once it is made.
ATTENTION = {"gpt2": "sdpa", "gpt2_eager": "eager"}


def _transformers_model(name: str) -> nn.Module:
    """A new `TRANSFORMERS` model `name`, random init."""
    import transformers

    config_class, model_class, fields = TRANSFORMERS[name]
    config = getattr(transformers, config_class)(**fields)
    if name in ATTENTION:
        config._attn_implementation = ATTENTION[name]
    return getattr(transformers, model_class)(config)


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


#: The zoo: name -> (batch maker, loss, whether training updates buffers, what it exercises).
_TABLE: dict[str, tuple[Callable[[torch.Generator, int], Batch], Loss, bool, str]] = {
    "gpt2": (_lm_batch, _lm_loss, False,
             "GPT2LMHeadModel, sdpa attention, labels= loss"),
    "gpt2_eager": (_lm_batch, _lm_loss, False,
                   "GPT2LMHeadModel, eager attention"),
    "llama": (_lm_batch, _lm_loss, False,
              "LlamaForCausalLM, sdpa, grouped-query attention, rotary embeddings"),
    "bert": (_classify_batch, _hf_loss, False,
             "BertForSequenceClassification with a padding attention_mask"),
    "t5": (_seq2seq_batch, _hf_loss, False,
           "T5ForConditionalGeneration (encoder-decoder, relative position buckets), "
           "padding mask, labels="),
    "vit": (_image_batch, _hf_loss, False,
            "ViTForImageClassification"),
    "resnet": (_image_batch, _hf_loss, True,
               "ResNetForImageClassification (BatchNorm, running statistics via mutable=)"),
    "convnext": (_image_batch, _hf_loss, False,
                 "ConvNextForImageClassification (depthwise 7x7, LayerNorm, layer scale)"),
    "mobilenet_v2": (_image_batch, _hf_loss, True,
                     "MobileNetV2ForImageClassification (depthwise, BatchNorm, ReLU6)"),
    "efficientnet": (_image_batch, _hf_loss, True,
                     "EfficientNetForImageClassification (squeeze-excite, BatchNorm, SiLU)"),
    "lstm_text": (_text_batch, _nn_loss, False,
                  "nn.Embedding -> 2-layer nn.LSTM (batch_first) -> nn.Linear"),
    "gru_text": (_text_batch, _nn_loss, False,
                 "nn.Embedding -> 2-layer nn.GRU (batch_first) -> nn.Linear"),
    "transformer_encoder": (_padded_text_batch, _nn_loss, False,
                            "nn.TransformerEncoder with src_key_padding_mask"),
    "cnn_groupnorm": (_image_batch, _nn_loss, False,
                      "Conv2d, GroupNorm, SiLU, max-pool, adaptive avg-pool"),
}  # fmt: skip

#: The torch.nn models' constructors (the others are `TRANSFORMERS`').
_TORCH_NN: dict[str, Callable[[], nn.Module]] = {
    "lstm_text": lambda: RecurrentClassifier(nn.LSTM),
    "gru_text": lambda: RecurrentClassifier(nn.GRU),
    "transformer_encoder": EncoderClassifier,
    "cnn_groupnorm": GroupNormCNN,
}


def _zoo_model(name: str) -> ZooModel:
    batch, loss, batch_norm, what = _TABLE[name]
    if name in TRANSFORMERS:
        build = functools.partial(_transformers_model, name)
        return ZooModel(name, "transformers", build, batch, loss, batch_norm, what)
    return ZooModel(name, "torch.nn", _TORCH_NN[name], batch, loss, batch_norm, what)


#: The zoo by name.
ZOO: dict[str, ZooModel] = {name: _zoo_model(name) for name in _TABLE}


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

    # The closure holds the loss and the model only (not `entry`, whose builders read the zoo's
    # tables): bridge_mr keys it by the model it reads, as a user's closure would be keyed.
    torch_loss = entry.loss

    def loss(params: State, buffers: State, batch: Batch) -> torch.Tensor:
        return torch_loss(model, {**params, **buffers}, batch)

    return loss


def timings(names: list[str], rounds: int = 5) -> list[dict[str, Any]]:
    """Per model: the first call of `jax.jit(jax.value_and_grad(from_torch(loss)))` (trace and
    compile), then `rounds` interleaved later calls of it and of a torch eager step (forward and
    backward of the same loss), each round with the 1-minute load average beside it.

    Run as `python -m benchmarks.zoo [NAME ...]`, which prints a markdown table.
    """
    return [_timing(name, rounds) for name in names]


def _timing(name: str, rounds: int) -> dict[str, Any]:
    """`timings`' row of one model."""
    import statistics

    import jax
    import jax.numpy as jnp

    import bridge_mr

    from . import harness

    entry = ZOO[name]
    model = build(name)
    params, buffers = split_state(model)
    batch = entry.batch(torch.Generator().manual_seed(1), 4)
    loss = client_loss(entry, model)
    converted = bridge_mr.from_torch(loss, mutable=1 if entry.batch_norm else ())
    step = jax.jit(jax.value_and_grad(converted, has_aux=entry.batch_norm))
    args = jax.tree.map(lambda t: jnp.asarray(t.numpy()), (params, buffers, batch))
    first, _ = harness.time_once(lambda: step(*args))

    def torch_step() -> Callable[[], Any]:
        # Fresh leaves and buffers, untimed: backward and BatchNorm write into them.
        trainable = {k: v.clone().requires_grad_() for k, v in params.items()}
        fresh = {k: v.clone() for k, v in buffers.items()}
        return lambda: loss(trainable, fresh, batch).backward()

    later = harness.rounds({"step": lambda: lambda: step(*args), "torch": torch_step}, rounds)
    return {
        "name": name,
        "first_call_s": first,
        "step_ms": 1e3 * statistics.median(later.seconds["step"]),
        "torch_eager_ms": 1e3 * statistics.median(later.seconds["torch"]),
        "load_1min": max(later.load_1min),
    }


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
