"""The torch functions probed under `from_torch` against torch, each with what it does there.

Issue 40 asked which torch functions give silently wrong results under `from_torch` (most of all
those that fill a new tensor slice by slice). `PROBED` is that probe: each entry runs a torch
function (or a pattern of torch code) and says what `from_torch` does with it:

* `TORCH`: its value eager and under `jax.jit`, and its gradient under `jax.jit(jax.grad(...))`,
  equal torch's (float32, `helpers.against_torch`);
* `VALUES`: its values equal torch's (integer results, or torch's autograd refuses the code);
* `EAGER`: its value equals torch's in an eager call; under `jax.jit` it needs a value known
  only when the program runs (a shape from data), refused with `UnsupportedTorchOperation`;
* `Refused(match)`: refused with `UnsupportedTorchOperation` (an op with no JAX lowering);
* `Fails(error, match)`: fails with another error: a known gap, not a wrong result.

The probe found wrong results (fixed since, each with its own tests in `test_writes.py` and
`test_op_lowerings.py`): circular padding, writes through views of tensors made inside,
`instance_norm`'s running statistics, `type_as`, `vector_to_parameters`, `embedding_bag`,
`multilabel_margin_loss`, NaN gradients of norms at zero. docs/from_torch.md lists the probed set
(`test_the_docs_list_the_probed_functions`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from helpers.against_torch import check
from torch import nn

import bridge_mr
from bridge_mr.torch_fn import UnsupportedTorchOperation

pytestmark = [
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64 requested in:UserWarning"),
    pytest.mark.filterwarnings("ignore::bridge_mr.RetraceWarning"),
    # torch.func.jacfwd's own use of torch.jit.script (torch 2.13).
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
]

TORCH, VALUES, EAGER = "torch", "values", "eager"


@dataclasses.dataclass(frozen=True)
class Refused:
    match: str


@dataclasses.dataclass(frozen=True)
class Fails:
    error: type[Exception]
    match: str


Expect = str | Refused | Fails


@dataclasses.dataclass(frozen=True)
class Probe:
    fn: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    expect: Expect  # on torch 2.13, the main environment's (the docs list this one)
    before_2_13: Expect | None = None  # where torch 2.9 (the torch-xla environment) differs

    def expected(self) -> Expect:
        """What this torch does with it."""
        older = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)
        return self.before_2_13 if older and self.before_2_13 is not None else self.expect


PROBED: dict[str, Probe] = {}
_SEED = [0]


def r(*shape: int) -> torch.Tensor:
    """A fresh normal tensor (each call its own seed, so the table is the same in any order)."""
    _SEED[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(_SEED[0]))


def u(*shape: int) -> torch.Tensor:
    """A fresh uniform [0, 1) tensor (seeded as `r`)."""
    _SEED[0] += 1
    return torch.rand(*shape, generator=torch.Generator().manual_seed(_SEED[0]))


def probe(
    name: str, *inputs: torch.Tensor, expect: Expect = TORCH, before_2_13: Expect | None = None
) -> Callable[..., Any]:
    def add(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        assert name not in PROBED, name
        PROBED[name] = Probe(fn, inputs, expect, before_2_13)
        return fn

    return add


def module(name: str, layer: nn.Module, *inputs: torch.Tensor, **options: Any) -> None:
    """Probes `layer` called on `inputs` through `functional_call`, its state the last inputs."""
    kwargs = options.pop("kwargs", dict)
    pick = options.pop("pick", lambda out: out)
    named = [*layer.named_parameters(), *layer.named_buffers()]
    names = [n for n, _ in named]

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        state = dict(zip(names, tensors[len(inputs) :], strict=True))
        return pick(torch.func.functional_call(layer, state, tensors[: len(inputs)], kwargs()))

    probe(name, *inputs, *(t.detach().clone() for _, t in named), **options)(call)


def idx(*values: Any) -> torch.Tensor:
    return torch.tensor(values)


NO_LOWERING = Refused("is unsupported in the JAX lowering")

# --- nn.utils.rnn, stacking and joining -------------------------------------------------------
probe("pad_sequence", r(3, 2), r(5, 2), r(1, 2))(
    lambda a, b, c: nn.utils.rnn.pad_sequence([a, b, c])
)
probe("pad_sequence_batch_first_left", r(3, 2), r(5, 2))(
    lambda a, b: nn.utils.rnn.pad_sequence(
        [a, b], batch_first=True, padding_value=-1.0, padding_side="left"
    )
)
probe(
    "unpad_sequence",
    r(2, 5, 3),
    expect=Fails(jax.errors.NonConcreteBooleanIndexError, "must be concrete"),
)(lambda x: torch.cat(nn.utils.rnn.unpad_sequence(x, idx(5, 2), batch_first=True)))
probe("stack", r(3, 4), r(3, 4))(lambda a, b: torch.stack([a, b], 1))
probe("cat", r(3, 4), r(2, 4))(lambda a, b: torch.cat([a, b]))
probe("hstack", r(3, 4), r(3, 2))(lambda a, b: torch.hstack([a, b]))
probe("vstack", r(3), r(3))(lambda a, b: torch.vstack([a, b]))
probe("dstack", r(3, 2), r(3, 2))(lambda a, b: torch.dstack([a, b]))
probe("column_stack", r(3), r(3, 2))(lambda a, b: torch.column_stack([a, b]))
probe("block_diag", r(2, 3), r(1, 2), r(3))(lambda a, b, c: torch.block_diag(a, b, c))
probe("cartesian_prod", r(3), r(2))(lambda a, b: torch.cartesian_prod(a, b))
probe("combinations", r(4), expect=EAGER)(lambda a: torch.combinations(a, 2))
probe("meshgrid", r(3), r(2))(lambda a, b: torch.stack(torch.meshgrid(a, b, indexing="xy")))
probe("kron", r(2, 3), r(2, 2))(lambda a, b: torch.kron(a, b))
probe("tensordot", r(2, 3, 4), r(4, 3))(lambda a, b: torch.tensordot(a, b, ([1, 2], [1, 0])))
probe("repeat_interleave", r(3, 2))(lambda a: torch.repeat_interleave(a, 2, 0))
probe("repeat_interleave_tensor", r(3, 2), expect=EAGER)(
    lambda a: torch.repeat_interleave(a, idx(1, 0, 2), 0)
)
probe("tile", r(2, 3))(lambda a: a.tile(2, 1, 2))
probe("roll", r(3, 4))(lambda a: torch.roll(a, (1, -2), (0, 1)))
probe("rot90", r(3, 4))(lambda a: torch.rot90(a, 1, (0, 1)))
probe("unfold_method", r(7))(lambda a: a.unfold(0, 3, 2))
probe("tensor_split", r(7))(lambda a: torch.cat([p * i for i, p in enumerate(a.tensor_split(3))]))

# --- diagonals, triangles, scatter-into-new ---------------------------------------------------
probe("tril_indices", r(4, 4))(lambda a: a[tuple(torch.tril_indices(4, 4, -1))])
probe("triu_indices", r(3, 5))(lambda a: a[tuple(torch.triu_indices(3, 5, 1))])
probe("tril", r(4, 4))(lambda a: torch.tril(a, -1))
probe("one_hot", r(5, 3))(lambda a: F.one_hot(idx(0, 2, 1, 1, 0), 3) * a)
probe("diag_embed", r(2, 3))(lambda a: torch.diag_embed(a, offset=1))
probe("diag", r(3))(lambda a: torch.diag(a, -1))
probe("diagflat", r(2, 2))(lambda a: torch.diagflat(a))
probe("diagonal_scatter", r(3, 3), r(3))(lambda a, b: torch.diagonal_scatter(a, b))
probe("select_scatter", r(3, 4), r(4))(lambda a, b: torch.select_scatter(a, b, 0, 1))
probe("slice_scatter", r(4, 4), r(2, 4))(lambda a, b: torch.slice_scatter(a, b, 0, 1, 3))
probe("fill_diagonal_", r(3, 3))(lambda a: (a * 1).fill_diagonal_(5.0))
probe("fill_diagonal_wrap", r(7, 3))(lambda a: (a * 1).fill_diagonal_(5.0, wrap=True))
# torch 2.13's vander promotes with aten.promote_types, which torchax does not lower; torch
# 2.9's computes in place (torch's autograd refuses its gradient).
probe("vander", r(4), expect=NO_LOWERING, before_2_13=VALUES)(lambda a: torch.vander(a, 3))
probe("linalg_vander", r(4))(lambda a: torch.linalg.vander(a))
probe("cross", r(4, 3), r(4, 3))(lambda a, b: torch.linalg.cross(a, b))

# --- padding, folding, sampling ---------------------------------------------------------------
for _mode in ("constant", "reflect", "replicate", "circular"):
    probe(f"pad_{_mode}_1d", r(2, 3, 5))(lambda a, m=_mode: F.pad(a, (2, 1), mode=m))
    probe(f"pad_{_mode}_2d", r(1, 2, 4, 5))(lambda a, m=_mode: F.pad(a, (1, 2, 2, 1), mode=m))
    probe(f"pad_{_mode}_3d", r(1, 1, 3, 4, 4))(
        lambda a, m=_mode: F.pad(a, (1, 1, 1, 0, 2, 1), mode=m)
    )
probe("pad_negative", r(2, 6))(lambda a: F.pad(a, (-1, 2)))
probe("pad_circular_negative", r(1, 2, 6))(lambda a: F.pad(a, (-1, 2), mode="circular"))
probe("unfold", r(1, 2, 5, 5))(lambda a: F.unfold(a, 3, padding=1, stride=2))
probe("fold", r(1, 8, 9))(lambda a: F.fold(a, (4, 4), 2))
probe("fold_stride", r(1, 8, 4))(lambda a: F.fold(a, (4, 4), 2, stride=2))
probe("affine_grid", r(2, 2, 3), expect=NO_LOWERING)(
    lambda t: F.affine_grid(t, [2, 1, 4, 5], align_corners=False)
)
probe("grid_sample", r(1, 2, 4, 5), u(1, 3, 3, 2) * 1.6 - 0.8)(
    lambda a, grid: F.grid_sample(a, grid, align_corners=False)
)
probe("interpolate_bilinear", r(1, 2, 3, 4))(
    lambda a: F.interpolate(a, scale_factor=2, mode="bilinear")
)
probe("interpolate_bicubic", r(1, 2, 3, 4))(
    lambda a: F.interpolate(a, size=(5, 7), mode="bicubic", align_corners=True)
)
probe("interpolate_nearest", r(1, 2, 3, 4))(lambda a: F.interpolate(a, size=(5, 7)))
probe("interpolate_area", r(1, 2, 6, 4))(lambda a: F.interpolate(a, size=(4, 3), mode="area"))
probe("interpolate_trilinear", r(1, 1, 2, 3, 4))(
    lambda a: F.interpolate(a, scale_factor=2, mode="trilinear")
)
probe("interpolate_antialias", r(1, 2, 8, 8), expect=Fails(TypeError, "not callable"))(
    lambda a: F.interpolate(a, size=(3, 5), mode="bilinear", antialias=True)
)
probe("pixel_shuffle", r(1, 8, 2, 3))(lambda a: F.pixel_shuffle(a, 2))
probe("pixel_unshuffle", r(1, 2, 4, 6))(lambda a: F.pixel_unshuffle(a, 2))
probe("channel_shuffle", r(1, 6, 2, 2))(lambda a: F.channel_shuffle(a, 3))

# --- index ops --------------------------------------------------------------------------------
MASK = [[True, False, True], [False, True, False]]
probe("index_copy", r(5, 3), r(2, 3))(lambda a, b: a.index_copy(0, idx(4, 1), b))
probe("index_copy_", r(5, 3), r(2, 3))(lambda a, b: (a * 1).index_copy_(0, idx(4, 1), b))
probe("index_fill", r(5, 3))(lambda a: a.index_fill(1, idx(0, 2), -1.0))
probe("index_add", r(5, 3), r(3, 3))(lambda a, b: a.index_add(0, idx(0, 2, 0), b, alpha=2))
probe("index_reduce", r(5, 3), r(3, 3), expect=NO_LOWERING)(
    lambda a, b: a.index_reduce(0, idx(0, 2, 0), b, "prod")
)
probe("masked_scatter", r(2, 3), r(6))(lambda a, s: a.masked_scatter(torch.tensor(MASK), s))
probe("masked_fill", r(2, 3))(lambda a: a.masked_fill(torch.tensor(MASK), 0.5))
probe("scatter", r(3, 4), r(2, 4))(lambda a, s: a.scatter(0, idx([0, 2, 1, 0], [2, 0, 0, 1]), s))
probe("scatter_add", r(3, 4), r(2, 4))(
    lambda a, s: a.scatter_add(0, idx([0, 2, 1, 0], [2, 0, 0, 1]), s)
)
probe("scatter_reduce_amax", r(3, 4), r(2, 4))(
    lambda a, s: a.scatter_reduce(0, idx([0, 2, 1, 0], [2, 0, 0, 1]), s, "amax")
)
probe("index_put_accumulate", r(5), r(3))(
    lambda a, v: a.index_put((idx(0, 3, 0),), v, accumulate=True)
)
probe("put", r(2, 3), r(2))(lambda a, v: a.put(idx(5, 1), v))
probe("take", r(2, 3))(lambda a: a.take(idx(5, 1, 0)))
probe("take_along_dim", r(3, 4), expect=Fails(RuntimeError, "should be Long"))(
    lambda a: torch.take_along_dim(a, idx([0], [3], [1]), 1)
)
probe("zeros_scatter_", r(2, 3))(
    lambda a: torch.zeros(3, 3).scatter_(0, idx([0, 1, 2], [2, 0, 1]), a)
)
probe("searchsorted", r(5), expect=VALUES)(
    lambda a: torch.searchsorted(torch.tensor([-1.0, 0.0, 1.0]), a)
)
probe("histc", r(20), expect=VALUES)(lambda a: torch.histc(a, 5, -2, 2))


# --- writes into a tensor made inside (the pattern of torch's own slice-by-slice fills) -------
def _select_copy(a: torch.Tensor) -> torch.Tensor:
    out = a.new_zeros(3, 4)
    out.select(0, 1).copy_(a[0])
    out.narrow(1, 0, 2).add_(1.0)
    return out


def _loop_setitem(a: torch.Tensor) -> torch.Tensor:
    out = torch.empty(4, 3)
    for i in range(4):
        out[i] = a[i % 2] * i
    return out


def _diagonal_copy(a: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(3, 3)
    out.diagonal().copy_(a)
    out.t()[0].fill_(2.0)
    return out


def _view_setitem(a: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(6)
    out.view(2, 3)[1] = a
    return out


def _index_put(a: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(4, 3)
    out.index_put_((idx(1, 3),), a)
    out[torch.tensor([True, False, False, False])] = 1.0
    return out


def _as_strided_copy(a: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(9)
    out.as_strided((3,), (4,)).copy_(a)
    return out


def _out_arguments(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(4, 3)
    torch.cat([a, b], out=out)
    return out


def _vector_to_parameters(vector: torch.Tensor) -> torch.Tensor:
    parameters = [torch.zeros(2, 3), torch.zeros(4)]
    nn.utils.vector_to_parameters(vector, parameters)
    return torch.cat([p.flatten() for p in parameters])


def _type_as(a: torch.Tensor) -> torch.Tensor:
    out = torch.full((3,), 1.7)
    return out + out.type_as(idx(1, 2, 3)) + a


probe("new_zeros_select_copy_", r(2, 4))(_select_copy)
probe("empty_setitem_in_a_loop", r(2, 3))(_loop_setitem)
probe("zeros_diagonal_copy_", r(3))(_diagonal_copy)
probe("zeros_view_setitem", r(3))(_view_setitem)
probe("zeros_index_put_", r(2, 3))(_index_put)
probe("zeros_as_strided_copy_", r(3))(_as_strided_copy)
probe("cat_out", r(2, 3), r(2, 3), expect=VALUES)(_out_arguments)
probe("vector_to_parameters", r(10), expect=VALUES)(_vector_to_parameters)
probe("type_as", r(3))(_type_as)
probe("parameters_to_vector", r(2, 3), r(4))(lambda a, b: nn.utils.parameters_to_vector([a, b]))

# --- reductions, scans, statistics, linear algebra ---------------------------------------------
probe("diff_prepend", r(5))(lambda a: torch.diff(a, 2, prepend=a[:1] * 0))
probe("gradient", r(5, 4))(lambda a: torch.stack(torch.gradient(a, spacing=2.0)))
probe("gradient_edge_order_2", r(5, 4))(lambda a: torch.gradient(a, dim=0, edge_order=2)[0])
probe("cumulative_trapezoid", r(5, 4))(lambda a: torch.cumulative_trapezoid(a, dim=0))
probe("cov", r(3, 6), expect=EAGER)(lambda a: torch.cov(a))
probe("cummax", r(6))(lambda a: torch.cummax(a, 0)[0])
probe("logcumsumexp", r(6))(lambda a: torch.logcumsumexp(a, 0))
probe("cumprod", r(6))(lambda a: torch.cumprod(a, 0))
probe("renorm", r(3, 4))(lambda a: torch.renorm(a, 2, 0, 1.0))
probe("normalize", r(3, 4))(lambda a: F.normalize(a, dim=1))
probe("normalize_zero_row", r(3, 4))(lambda a: F.normalize(a * idx([1.0], [0.0], [1.0]), dim=1))
probe("vector_norm_zero", r(2, 3))(lambda a: torch.linalg.vector_norm(a * 0, dim=1) + a.sum())
probe("cdist", r(4, 3), r(5, 3))(lambda a, b: torch.cdist(a, b))
probe("cdist_self", r(4, 3))(lambda a: torch.cdist(a, a))
probe("cdist_p1", r(4, 3), r(5, 3))(lambda a, b: torch.cdist(a, b, p=1.0))
probe("pdist", r(4, 3))(lambda a: F.pdist(a))
probe("dist", r(3), r(3))(lambda a, b: torch.dist(a, b))
probe("multi_dot", r(2, 3), r(3, 4), r(4, 2))(lambda a, b, c: torch.linalg.multi_dot([a, b, c]))
probe("matrix_power", r(3, 3))(lambda a: torch.linalg.matrix_power(a, 3))
probe("matrix_exp", r(3, 3))(lambda a: torch.linalg.matrix_exp(a * 0.3))
probe("det", r(3, 3), expect=NO_LOWERING)(lambda a: torch.linalg.det(a))
probe("qr", r(4, 3))(lambda a: torch.linalg.qr(a)[1])
probe("cholesky", r(3, 3))(lambda a: torch.linalg.cholesky(a @ a.T + 3 * torch.eye(3)))
probe("solve_triangular", r(3, 3), r(3, 2))(
    lambda a, b: torch.linalg.solve_triangular(a.triu() + 3 * torch.eye(3), b, upper=True)
)
probe("stft", r(32), expect=NO_LOWERING)(
    lambda a: torch.stft(a, 8, window=torch.hann_window(8), return_complex=True).abs()
)

# --- losses -----------------------------------------------------------------------------------
probe("ctc_loss", r(6, 2, 4).log_softmax(2), expect=NO_LOWERING)(
    lambda lp: F.ctc_loss(lp, idx([1, 2, 1], [3, 3, 0]), idx(6, 5), idx(3, 2))
)
probe("multilabel_margin_loss", r(2, 4))(
    lambda a: F.multilabel_margin_loss(a, idx([3, 0, -1, 1], [1, 2, 3, -1]))
)
probe("multi_margin_loss", r(3, 4))(lambda a: F.multi_margin_loss(a, idx(1, 0, 3)))
probe("cross_entropy_label_smoothing", r(4, 5))(
    lambda a: F.cross_entropy(a, idx(1, 0, 4, 2), label_smoothing=0.1, ignore_index=4)
)
probe("cross_entropy_probabilities", r(4, 5), r(4, 5).softmax(1))(F.cross_entropy)
probe("nll_loss_weighted", r(4, 5))(
    lambda a: F.nll_loss(a.log_softmax(1), idx(1, 0, 4, 2), weight=torch.arange(5.0))
)
probe("triplet_margin_loss_swap", r(3, 4), r(3, 4), r(3, 4))(
    lambda a, b, c: F.triplet_margin_loss(a, b, c, swap=True)
)
probe("cosine_embedding_loss", r(3, 4), r(3, 4))(
    lambda a, b: F.cosine_embedding_loss(a, b, idx(1, -1, 1))
)
probe("gaussian_nll_loss", r(3, 4), r(3, 4), r(3, 4).exp(), expect=EAGER)(F.gaussian_nll_loss)
probe("kl_div", r(3, 4), r(3, 4).softmax(1))(
    lambda a, b: F.kl_div(a.log_softmax(1), b, reduction="batchmean")
)
probe("bce_with_logits_pos_weight", r(3, 4), u(3, 4))(
    lambda a, t: F.binary_cross_entropy_with_logits(a, t, pos_weight=torch.arange(1.0, 5.0))
)

# --- embeddings, pooling ----------------------------------------------------------------------
probe("embedding_bag_mean", r(6, 3))(
    lambda w: F.embedding_bag(idx(0, 2, 1, 5, 4), w, idx(0, 2), mode="mean")
)
probe("embedding_bag_per_sample_weights", r(6, 3), r(5))(
    lambda w, p: F.embedding_bag(idx(0, 2, 1, 5, 4), w, idx(0, 2), per_sample_weights=p, mode="sum")
)
probe("embedding_bag_max", r(6, 3))(lambda w: F.embedding_bag(idx([0, 2], [1, 5]), w, mode="max"))
probe("embedding_bag_padding_idx", r(6, 3))(
    lambda w: F.embedding_bag(idx([0, 2, 1], [1, 5, 1]), w, mode="mean", padding_idx=1)
)
probe("embedding_padding_idx", r(6, 3))(lambda w: F.embedding(idx([0, 2], [1, 5]), w, 2))
probe("embedding_max_norm", r(6, 3), expect=NO_LOWERING)(
    lambda w: F.embedding(idx(0, 2, 2), w.clone(), max_norm=1.0)
)
probe(
    "max_unpool2d", r(1, 2, 4, 4), expect=Fails(jax.errors.TracerArrayConversionError, "__array__")
)(lambda a: F.max_unpool2d(*F.max_pool2d(a, 2, return_indices=True), 2))
probe("adaptive_avg_pool2d", r(1, 2, 5, 7))(lambda a: F.adaptive_avg_pool2d(a, (3, 4)))
probe("adaptive_max_pool2d", r(1, 2, 5, 7), expect=NO_LOWERING)(
    lambda a: F.adaptive_max_pool2d(a, (3, 4))
)
probe("avg_pool2d_ceil_mode", r(1, 2, 5, 5))(
    lambda a: F.avg_pool2d(a, 2, ceil_mode=True, count_include_pad=False, padding=1)
)
probe("lp_pool2d", r(1, 2, 4, 4))(lambda a: F.lp_pool2d(a, 2, 2))
probe("local_response_norm", r(1, 4, 3, 3))(lambda a: F.local_response_norm(a, 3))
probe("max_pool3d", r(1, 1, 4, 4, 4))(lambda a: F.max_pool3d(a, 2, padding=1))
probe("instance_norm", r(2, 3, 5))(lambda a: F.instance_norm(a))
probe("group_norm", r(2, 4, 5))(lambda a: F.group_norm(a, 2))

# --- modules: attention, padded convolutions, parametrizations ----------------------------------
torch.manual_seed(0)
module(
    "multihead_attention_kdim_vdim_key_padding",
    nn.MultiheadAttention(4, 2, batch_first=True, kdim=3, vdim=5),
    r(2, 4, 4),
    r(2, 3, 3),
    r(2, 3, 5),
    kwargs=lambda: {"key_padding_mask": torch.tensor([[False, False, True], [False] * 3])},
    pick=lambda out: torch.cat([out[0].flatten(), out[1].flatten()]),
)
module(
    "multihead_attention_bias_kv_zero_attn",
    nn.MultiheadAttention(4, 2, add_bias_kv=True, add_zero_attn=True),
    r(3, 2, 4),
    r(3, 2, 4),
    r(3, 2, 4),
    kwargs=lambda: {"attn_mask": torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)},
    pick=lambda out: torch.cat([out[0].flatten(), out[1].flatten()]),
)
module(
    "transformer_decoder_layer",
    nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
    r(2, 3, 4),
    r(2, 5, 4),
    kwargs=lambda: {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(3)},
)
probe("scaled_dot_product_attention_causal", r(1, 2, 3, 4), r(1, 2, 3, 4), r(1, 2, 3, 4))(
    lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
)
module(
    "conv2d_padding_circular", nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"), r(1, 2, 5, 5)
)
module("conv1d_padding_reflect", nn.Conv1d(2, 3, 3, padding=2, padding_mode="reflect"), r(1, 2, 6))
module(
    "embedding_bag_module",
    nn.EmbeddingBag(7, 3, mode="mean", padding_idx=0),
    idx([1, 0, 3], [6, 6, 0]),
)
module("weight_norm", nn.utils.parametrizations.weight_norm(nn.Linear(3, 3)), r(2, 3))
module("orthogonal_matrix_exp", nn.utils.parametrizations.orthogonal(nn.Linear(3, 3)), r(2, 3))
module(
    "orthogonal_cayley",
    nn.utils.parametrizations.orthogonal(nn.Linear(3, 3), orthogonal_map="cayley"),
    r(2, 3),
    expect=Fails(RuntimeError, "Expected Tensor but got None"),
)

# --- torch.func inside ------------------------------------------------------------------------
probe("func_vmap", r(3, 4))(lambda a: torch.func.vmap(lambda v: v.softmax(0) * v)(a))
probe("func_jacrev", r(3))(lambda a: torch.func.jacrev(lambda v: v.sin() * v.sum())(a))
probe("func_grad", r(3))(lambda a: torch.func.grad(lambda v: (v.sin() ** 2).sum())(a))
probe("func_jacfwd", r(3), expect=Refused("torch._make_dual"))(
    lambda a: torch.func.jacfwd(lambda v: v.sin() * v.sum())(a)
)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PROBED))
def test_a_probed_function_does_under_from_torch_what_the_table_says(name: str) -> None:
    entry = PROBED[name]
    expect = entry.expected()
    arrays = [jnp.asarray(x.numpy()) for x in entry.inputs]
    if expect in (TORCH, VALUES):
        check(entry.fn, list(entry.inputs), grad=expect == TORCH)
    elif expect == EAGER:
        check(entry.fn, list(entry.inputs), grad=False, jit=False)
        with pytest.raises(UnsupportedTorchOperation, match="reads a traced value"):
            jax.jit(bridge_mr.from_torch(entry.fn))(*arrays)
    elif isinstance(expect, Refused):
        with pytest.raises(UnsupportedTorchOperation, match=expect.match):
            bridge_mr.from_torch(entry.fn)(*arrays)
    else:
        assert isinstance(expect, Fails)
        with pytest.raises(expect.error, match=expect.match):
            jax.jit(bridge_mr.from_torch(entry.fn))(*arrays)


def _listed(section: str) -> set[str]:
    return set(re.findall(r"`(\w+)`", section))


def test_the_docs_list_the_probed_functions() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "from_torch.md").read_text()
    section = doc.split("\n### Probed against torch", 1)[1].split("\n#", 1)[0]
    kinds = {
        "equal": {n for n, e in PROBED.items() if e.expect in (TORCH, VALUES)},
        "eager only": {n for n, e in PROBED.items() if e.expect == EAGER},
        "refused": {n for n, e in PROBED.items() if isinstance(e.expect, Refused)},
        "failing": {n for n, e in PROBED.items() if isinstance(e.expect, Fails)},
    }
    bullets = dict(re.findall(r"^\* ([a-z ]+): (.*?)(?=^\* |\Z)", section, re.M | re.S))
    assert set(bullets) == set(kinds), f"docs/from_torch.md's probe lists: {sorted(bullets)}"
    for kind, names in kinds.items():
        assert _listed(bullets[kind]) == names, (
            f"docs/from_torch.md's '{kind}' list and PROBED differ"
        )
