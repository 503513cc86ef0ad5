"""The compile cache is never staler than `jax.jit`: what a fresh jit would retrace, retraces.

Each shape below reused a trace whose captured state had changed (silently wrong results)
when functions were keyed by their code plus the identity of what they closed over.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_trees_all_close

import bridge_mr

W = torch.tensor([1.0, 2.0])
CLIENTS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])


def _grad_step(lr, p, x):
    return -lr * jax.grad(lambda q: jnp.sum((x @ q) ** 2))(p)


def _expected(lr):
    grads = [-lr * 2 * (x @ W) * x for x in CLIENTS]
    return sum(grads) / len(grads)


class Trainer:
    lr = 0.1

    def update(self, p, x):
        return _grad_step(self.lr, p, x)


def test_lambda_over_an_object_whose_attribute_changed():
    t = Trainer()
    for lr in (0.1, 0.01):  # A learning-rate schedule; one lambda (code object) re-created.
        t.lr = lr
        out = bridge_mr.map_reduce(lambda p, x: t.update(p, x), W, CLIENTS)
        assert_trees_all_close(out, _expected(lr))


def test_bound_method_whose_object_changed():
    t = Trainer()
    assert_trees_all_close(bridge_mr.map_reduce(t.update, W, CLIENTS), _expected(0.1))
    t.lr = 0.01
    assert_trees_all_close(bridge_mr.map_reduce(t.update, W, CLIENTS), _expected(0.01))


def test_closure_over_a_dict_whose_entry_changed():
    config = {"lr": 0.1}
    for lr in (0.1, 0.01):
        config["lr"] = lr
        out = bridge_mr.map_reduce(lambda p, x: _grad_step(config["lr"], p, x), W, CLIENTS)
        assert_trees_all_close(out, _expected(lr))


LEARNING_RATE = 0.1


def _global_lr_step(p, x):
    return _grad_step(LEARNING_RATE, p, x)


def test_module_global_reassigned():
    global LEARNING_RATE
    try:
        assert_trees_all_close(bridge_mr.map_reduce(_global_lr_step, W, CLIENTS), _expected(0.1))
        LEARNING_RATE = 0.01
        # The same function object, a global it reads rebound: a number is compared by value.
        assert_trees_all_close(bridge_mr.map_reduce(_global_lr_step, W, CLIENTS), _expected(0.01))
        for lr in (0.1, 0.01):
            LEARNING_RATE = lr
            out = bridge_mr.map_reduce(lambda p, x: _global_lr_step(p, x), W, CLIENTS)
            assert_trees_all_close(out, _expected(lr))
    finally:
        LEARNING_RATE = 0.1


@dataclasses.dataclass(frozen=True)
class Frozen:
    lr: float
    shape: tuple[int, ...]


def test_re_created_functions_over_values_reuse_their_trace():
    f = bridge_mr.torch_function(lambda fn, x: fn(x))
    x = torch.ones(2)
    frozen = np.arange(2.0, dtype=np.float32)
    frozen.flags.writeable = False
    keys = [
        lambda: lambda v: v * 0.5,
        lambda: functools.partial(jnp.multiply, 0.5),
        lambda: lambda v, c=Frozen(0.5, (2,)): v * c.lr,
        lambda: lambda v: v * jnp.asarray(frozen)[0] + 0.5 * v,
    ]
    for make in keys:
        before = f.trace_count
        for _ in range(3):
            assert_trees_all_close(f(make(), x), 0.5 * x)
        assert f.trace_count == before + 1, make


def test_values_that_compare_equal_but_trace_differently_are_told_apart():
    f = bridge_mr.torch_function(lambda fn, x: fn(x))
    x = torch.ones(1)
    for zero, expected in ((0.0, np.inf), (-0.0, -np.inf), (0.0, np.inf)):
        out = f(lambda v, z=zero: 1 / (v * z), x)
        assert out.item() == expected


def test_same_function_object_reads_state_like_jax_jit():
    """The documented gotcha: the same object reuses its trace, as jax.jit's does."""
    config = {"scale": 2.0}

    def scaled(x):
        return x * config["scale"]

    jitted = jax.jit(scaled)
    f = bridge_mr.torch_function(lambda fn, x: fn(x))
    x = torch.ones(2)
    assert_trees_all_close(f(scaled, x), 2 * x)
    jitted(jnp.ones(2))
    config["scale"] = 3.0
    assert_trees_all_close(f(scaled, x), 2 * x)
    assert_trees_all_close(jitted(jnp.ones(2)), 2 * jnp.ones(2))


def test_re_created_mutable_closures_warn_after_a_few_traces():
    f = bridge_mr.torch_function(lambda fn, x: fn(x))
    state = {"scale": 1.0}
    x = torch.ones(2)

    def calls(n):
        for i in range(n):
            state["scale"] = float(i)
            assert_trees_all_close(f(lambda v: v * state["scale"], x), i * x)

    with pytest.warns(bridge_mr.RetraceWarning, match=r"reads 'state' captured by .*builtins.dict"):
        calls(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calls(2)  # Warned once per function.
    assert f.trace_count == 5


def test_functions_keyed_by_identity_are_not_kept_forever():
    f = bridge_mr.torch_function(lambda fn, x: fn(x))
    x = torch.ones(2)
    holder = [1.0]
    first = [lambda v: v * holder[0]]
    dead = weakref.ref(first[0])

    def calls():
        f(first[0], x)
        for _ in range(40):
            f(lambda v: v * holder[0], x)

    with pytest.warns(bridge_mr.RetraceWarning):
        calls()
    first.clear()
    gc.collect()
    assert f.trace_count == 41
    assert dead() is None


CONFIG = {"scale": 2.0}


def _scaled_by_config(server, client):
    return jnp.sum(server * client) * CONFIG["scale"]


def test_new_shapes_of_the_same_function_object_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in (2, 3, 4, 5):
            s = torch.ones(k, requires_grad=True)
            bridge_mr.map_reduce(_scaled_by_config, s, torch.ones(5, k)).backward()


def test_the_same_function_object_sees_a_global_rebound_in_a_function_it_calls():
    global LEARNING_RATE
    outer = lambda p, x: _global_lr_step(p, x)  # One object, called on every step.
    try:
        for lr in (0.1, 0.01, 0.1):
            LEARNING_RATE = lr  # Read by _global_lr_step, which `outer` reads as a global.
            assert_trees_all_close(bridge_mr.map_reduce(outer, W, CLIENTS), _expected(lr))
    finally:
        LEARNING_RATE = 0.1
