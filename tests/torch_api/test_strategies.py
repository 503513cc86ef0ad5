"""map_reduce(strategy=...): forced strategies agree through torch autograd (auto: test_auto)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import assert_trees_all_close
from helpers.child import run_python
from helpers.rounds import case as _case
from helpers.rounds import delta as _delta
from helpers.rounds import loss as _loss

import bridge_mr
from bridge_mr.torch_api import map_reduce

EXPLICIT = [("vmap", None), ("per_client", None), ("chunks", 2), ("chunks", 8)]
CLOSE = {"rtol": 2e-5, "atol": 2e-6}


def _grads(fn, reduce, strategy, chunk_size):
    params, clients, weights = _case()
    leaves = [*(p.requires_grad_() for p in params.values()), clients["x"].requires_grad_()]
    if reduce == "weighted_mean":
        leaves.append(weights.requires_grad_())
    out = map_reduce(
        fn,
        params,
        clients,
        reduce=reduce,
        weights=weights if reduce == "weighted_mean" else None,
        strategy=strategy,
        chunk_size=chunk_size,
    )
    total = sum(o.sin().sum() for o in (out.values() if isinstance(out, dict) else [out]))
    return out, torch.autograd.grad(total, leaves)


@pytest.mark.parametrize("fn", [_loss, _delta], ids=["scalar", "pytree"])
@pytest.mark.parametrize("reduce", ["mean", "sum", "weighted_mean"])
@pytest.mark.parametrize(("strategy", "chunk_size"), EXPLICIT[1:])
def test_forced_strategies_equal_vmap_through_torch_autograd(fn, reduce, strategy, chunk_size):
    want = _grads(fn, reduce, "vmap", None)
    assert_trees_all_close(_grads(fn, reduce, strategy, chunk_size), want, **CLOSE)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "fast"}, r"map_reduce\(strategy=\.\.\.\): expected one of 'auto', 'vmap'"),
        ({"strategy": "chunks"}, r"map_reduce\(chunk_size=\.\.\.\): .*positive int.*None"),
        ({"strategy": "chunks", "chunk_size": -1}, r"chunk_size=\.\.\.\).*positive int.*-1"),
        ({"strategy": "per_client", "chunk_size": 4}, r"chunk_size=4\) is only for strategy="),
        ({"strategy": "vmap", "chunk_size": 4}, r"chunk_size=4\) is only for strategy='chunks'"),
        (
            {"chunk_size": 4, "memory_budget_bytes": 2**30},
            r"chunk_size=4\) means strategy='chunks'.*"
            r"memory_budget_bytes=\.\.\. is only for strategy='auto'",
        ),
        (
            {"strategy": "vmap", "memory_budget_bytes": 2**30},
            r"memory_budget_bytes=\.\.\.\) is only for strategy='auto'",
        ),
        ({"memory_budget_bytes": 0}, r"memory_budget_bytes=\.\.\.\): expected a positive int"),
    ],
)
def test_bad_strategy_arguments_name_the_argument(kwargs, message):
    params, clients, _ = _case()
    with pytest.raises(ValueError, match=message):
        map_reduce(_loss, params, clients, **kwargs)


def test_chunk_size_alone_means_chunks():
    params, clients, _ = _case()
    bridge_mr.clear_caches()
    alone = map_reduce(_loss, params, clients, chunk_size=2)
    assert bridge_mr.map_reduce_choices() == []  # strategy="chunks": nothing measured.
    chunks = map_reduce(_loss, params, clients, strategy="chunks", chunk_size=2)
    assert_trees_all_close(alone, chunks, rtol=0, atol=0)
    assert_trees_all_close(alone, map_reduce(_loss, params, clients, strategy="vmap"), **CLOSE)


@pytest.mark.x64
@pytest.mark.parametrize(("strategy", "chunk_size"), [("per_client", None), ("chunks", 2)])
def test_gradcheck_and_gradgradcheck_of_looped_strategies(strategy, chunk_size):
    params, clients, weights = _case(n=3)
    params = {k: v.double().requires_grad_() for k, v in params.items()}
    x = clients["x"].double().requires_grad_()
    y, w = clients["y"].double(), weights.double().requires_grad_()

    def f(pw, pb, x, w):
        return map_reduce(
            _loss, {"w": pw, "b": pb}, {"x": x, "y": y}, reduce="weighted_mean", weights=w,
            strategy=strategy, chunk_size=chunk_size,
        )  # fmt: skip

    inputs = (params["w"], params["b"], x, w)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def _cnn_loss(params, batch):
    """A convolution in PyTorch's layouts (NCHW / OIHW), as F.conv2d computes it."""
    x, y = batch["x"], batch["y"]
    h = jax.lax.conv_general_dilated(
        x, params["k"], (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    h = jnp.tanh(h + params["c"][:, None, None])
    return jnp.mean((h.mean(axis=(1, 2, 3)) - y) ** 2)


def _torch_cnn_loss(params, batch):
    h = torch.tanh(torch.nn.functional.conv2d(batch["x"], params["k"], params["c"]))
    return torch.mean((h.mean(dim=(1, 2, 3)) - batch["y"]) ** 2)


@pytest.mark.parametrize(("strategy", "chunk_size"), EXPLICIT)
@pytest.mark.parametrize("output", ["scalar", "pytree"])
def test_a_convolutional_client_matches_torch_through_autograd(strategy, chunk_size, output):
    # On CPU the convolutions (and their gradients) are rewritten into XLA's fast layout.
    gen = torch.Generator().manual_seed(3)
    params = {"k": torch.randn(4, 3, 3, 3, generator=gen), "c": torch.randn(4, generator=gen)}
    clients = {
        "x": torch.randn(5, 2, 3, 8, 8, generator=gen),
        "y": torch.randn(5, 2, generator=gen),
    }
    for p in params.values():
        p.requires_grad_()
    fn = _cnn_loss if output == "scalar" else (lambda p, b: {"loss": _cnn_loss(p, b), "k": p["k"]})
    out = map_reduce(fn, params, clients, strategy=strategy, chunk_size=chunk_size)
    loss = out if output == "scalar" else out["loss"] + out["k"].sin().sum()
    got = torch.autograd.grad(loss, list(params.values()))
    want_loss = torch.stack(
        [_torch_cnn_loss(params, {k: v[i] for k, v in clients.items()}) for i in range(5)]
    ).mean()
    if output == "pytree":
        want_loss = want_loss + params["k"].sin().sum()
    want = torch.autograd.grad(want_loss, list(params.values()))
    assert_trees_all_close((loss, got), (want_loss, want), rtol=1e-4, atol=1e-5)


_DUMPED_ROUNDS = textwrap.dedent(
    """
    import os, sys
    import bridge_mr
    os.environ["XLA_FLAGS"] = f"--xla_dump_to={sys.argv[1]} --xla_dump_hlo_as_text"
    import jax, jax.numpy as jnp, torch

    def conv(p, c):
        dims = ("NCHW", "OIHW", "NCHW")
        h = jax.lax.conv_general_dilated(c, p["k"], (1, 1), "VALID", dimension_numbers=dims)
        return jnp.tanh(h).mean() * p["d"].sum()

    def dense(p, c):
        return jnp.tanh(c.reshape(c.shape[0], -1) @ p["d"]).mean()

    params = {"k": torch.randn(8, 3, 3, 3), "d": torch.randn(192, 64)}
    for p in params.values():
        p.requires_grad_()
    def tree(p, c):  # Not one scalar: forward keeps residuals for a separate VJP program.
        return {"a": conv(p, c), "b": conv(p, c)}

    for fn in (conv, tree, dense):
        for strategy in ("vmap", "per_client"):
            out = bridge_mr.map_reduce(fn, params, torch.randn(6, 4, 3, 8, 8), strategy=strategy)
            sum(out.values() if isinstance(out, dict) else [out]).backward()
    """
)


def test_programs_with_convolutions_compile_without_ynn_fusions_on_cpu(tmp_path):
    # XLA dumps each compiled module; those of the convolutional client have no YNNPACK
    # fusion (jax_core.cpu_compiler_options), the dense client's keep the process's flags.
    script = tmp_path / "rounds.py"
    script.write_text(_DUMPED_ROUNDS)
    run_python([str(script), str(tmp_path / "dump")])
    modules = [p.read_text() for p in Path(tmp_path / "dump").glob("*after_optimizations.txt")]
    convolutional = [m for m in modules if " convolution(" in m]
    dense = [m for m in modules if " dot(" in m and " convolution(" not in m]
    # Per strategy: conv's forward (with its gradients), tree's forward and its VJP.
    assert len(convolutional) >= 6, len(convolutional)
    assert not [m for m in convolutional if "__ynn_fusion" in m]
    assert [m for m in dense if "__ynn_fusion" in m], "the check can see a YNN fusion"
