"""The small-model zoo: the torch models the from_torch tests and the benchmarks build.

Three tiers, each seeded, in training mode, dropout off (so torch and JAX compare value for
value), losses written the usual torch way (`torch.func.functional_call`, the model's own
`labels=` loss or `F.cross_entropy`):

* `TINY`: one tiny net per layer family (MLP + LayerNorm, Conv + BatchNorm, Conv + GroupNorm,
  LSTM, GRU, a transformer encoder layer) over `x`/`y` batches: `tests/torch_fn/test_zoo_rounds.py`
  (and the other from_torch tests) and docs/from_torch.md's coverage table.
* `ZOO`: small random-init configs of the models users train (transformers and torch.nn), each a
  `ZooModel` with a batch maker and a client loss; BatchNorm models train their running
  statistics, which `from_torch(..., mutable=1)` hands back: `tests/torch_fn/test_model_zoo.py`,
  docs/from_torch.md's "Models users train", the "users_path" benchmark's GPT-2
  (`TRANSFORMERS["gpt2"]`) and `python -m benchmarks.studies.bench_zoo`.
* The recurrent models at real sizes (`shakespeare_model`, `gru_classifier`, `sequence_loss`):
  `tests/torch_fn/test_recurrent.py` and the "recurrent" benchmark case.

Imports torch only (transformers when a transformers model is built): the benchmarks import it
too, also in the pfl venv, which has no JAX (`benchmarks/__init__.py` says how they find it).
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


# ---------------------------------------------------------------------------------------------
# TINY: one tiny net per layer family, over {"x": inputs, "y": 5 classes}.


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


class TinyBatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(h.flatten(1))


class TinyGroupNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.silu(self.norm(self.conv(x))), 2)
        return self.fc(h.flatten(1))


class TinyRecurrent(nn.Module):
    def __init__(self, kind: type[nn.LSTM] | type[nn.GRU]) -> None:
        super().__init__()
        self.rnn, self.fc = kind(6, 8, batch_first=True), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.fc = nn.Linear(16, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer(self.embed(tokens)).mean(1))


def _tiny_images(g: torch.Generator, *lead: int) -> torch.Tensor:
    return torch.randn(*lead, 1, 8, 8, generator=g)


def _tiny_sequences(g: torch.Generator, *lead: int) -> torch.Tensor:
    return torch.randn(*lead, 7, 6, generator=g)


#: The tiny nets: name -> (constructor, `inputs(generator, *lead)`).
TINY: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor]]] = {
    "mlp": (TinyMLP, lambda g, *lead: torch.randn(*lead, 12, generator=g)),
    "cnn_batchnorm": (TinyBatchNormCNN, _tiny_images),
    "cnn_groupnorm": (TinyGroupNormCNN, _tiny_images),
    "lstm": (lambda: TinyRecurrent(nn.LSTM), _tiny_sequences),
    "gru": (lambda: TinyRecurrent(nn.GRU), _tiny_sequences),
    "transformer": (TinyTransformer, lambda g, *lead: torch.randint(20, (*lead, 7), generator=g)),
}


def tiny(name: str) -> nn.Module:
    """Tiny net `name`, its parameters drawn from seed 0."""
    torch.manual_seed(0)
    return TINY[name][0]()


def tiny_data(name: str, *lead: int) -> Batch:
    """{"x": `name`'s inputs, "y": int64 labels of 5 classes}, shaped [*lead, ...], seed 1."""
    g = torch.Generator().manual_seed(1)
    return {"x": TINY[name][1](g, *lead), "y": torch.randint(5, (*lead,), generator=g)}


def tiny_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    """`loss(state, x, y)`: the cross-entropy of `model` run on `state` (parameters and
    buffers by name)."""

    def loss(state: State, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, state, (x,)), y)

    return loss


# ---------------------------------------------------------------------------------------------
# Recurrent models at real sizes.


class ShakespeareLSTM(nn.Module):
    """The LEAF / FedAvg-paper Shakespeare next-character model: embedding 8, 2-layer LSTM 256
    (batch_first), a linear head over the vocabulary at every position."""

    def __init__(self, vocab: int = 80) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.lstm = nn.LSTM(8, 256, num_layers=2, batch_first=True)
        self.head = nn.Linear(256, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out)


class GRUClassifier(nn.Module):
    """A 2-layer bidirectional GRU 16 -> 32 (batch_first), a linear head on the last step's 64
    features, 10 classes (issue 35's)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(16, 32, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def shakespeare_model(vocab: int = 80, seed: int = 0) -> ShakespeareLSTM:
    """A `ShakespeareLSTM`, its parameters drawn from `seed`."""
    torch.manual_seed(seed)
    return ShakespeareLSTM(vocab)


def gru_classifier(seed: int = 0) -> GRUClassifier:
    """A `GRUClassifier`, its parameters drawn from `seed`."""
    torch.manual_seed(seed)
    return GRUClassifier()


def sequence_loss(model: nn.Module) -> Callable[[State, torch.Tensor, torch.Tensor], torch.Tensor]:
    """(params, inputs, int labels) -> mean cross-entropy of `model`'s logits (any leading
    axes: [batch, classes] or [batch, time, classes])."""

    def loss(params: State, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(model, params, (x,))
        return F.cross_entropy(logits.flatten(0, -2), y.flatten().long())

    return loss
