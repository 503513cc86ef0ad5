"""torch_function: values, gradients (first and second order), caching, safety, threads."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_trees_all_close, child
from helpers.precision import precisions

from bridge_mr.torch_api import torch_function

F64 = torch.float64


def _compile_warnings(test):
    """torch.compile's own warnings: its first use imports torch.utils.mkldnn, which uses a
    deprecated API, and dynamo reads `.grad` of the non-leaf tensors it resumes with."""
    test = pytest.mark.filterwarnings(
        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
    )(test)
    return pytest.mark.filterwarnings(
        "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
    )(test)


def _mlp(params, x):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"]


def _torch_mlp(params, x):
    hidden = torch.tanh(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"]


def _params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1": (3, 4), "b1": (4,), "w2": (4, 2)}
    return {
        k: torch.randn(s, dtype=dtype, generator=gen).requires_grad_() for k, s in shapes.items()
    }


@pytest.mark.parametrize(("dtype", "tol"), precisions(float64=1e-12, float32=1e-5))
def test_pytree_values_and_gradients_match_torch(dtype, tol):
    f = torch_function(_mlp)
    params, x = _params(dtype=dtype), torch.randn(5, 3, dtype=dtype)
    out = f(params, x)
    cotangent = torch.randn(5, 2, dtype=dtype)
    got = torch.autograd.grad(out, list(params.values()), cotangent)
    ref_out = _torch_mlp(params, x)
    want = torch.autograd.grad(ref_out, list(params.values()), cotangent)
    assert_trees_all_close(out, ref_out, rtol=tol, atol=tol)
    assert_trees_all_close(list(got), list(want), rtol=tol, atol=tol)


@pytest.mark.x64
def test_gradcheck_and_gradgradcheck_with_residuals():
    f = torch_function(lambda a, b: (jnp.sin(a) * b, jnp.exp(a).sum() * b))
    a = torch.randn(3, dtype=F64, requires_grad=True)
    b = torch.randn(3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (a, b))
    assert torch.autograd.gradgradcheck(f, (a, b))


@pytest.mark.x64
def test_gradcheck_and_gradgradcheck_of_a_scalar_loss():
    f = torch_function(lambda p, x: jnp.sum(_mlp(p, x) ** 2))
    x = torch.randn(2, 3, dtype=F64)
    params = _params(dtype=F64)
    names = sorted(params)

    def loss(*leaves):
        return f(dict(zip(names, leaves, strict=True)), x)

    leaves = tuple(params[k] for k in names)
    assert torch.autograd.gradcheck(loss, leaves)
    assert torch.autograd.gradgradcheck(loss, leaves)


def test_scaled_scalar_loss_and_hessian_vector_product():
    f = torch_function(lambda w: jnp.sum(jnp.sin(w) ** 3))
    w = torch.randn(4, requires_grad=True)
    (grad,) = torch.autograd.grad(2.5 * f(w), w, create_graph=True)
    v = torch.randn(4)
    (hvp,) = torch.autograd.grad(grad, w, v)

    w_ref = w.detach().clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad(2.5 * (torch.sin(w_ref) ** 3).sum(), w_ref, create_graph=True)
    (hvp_ref,) = torch.autograd.grad(grad_ref, w_ref, v)
    assert_trees_all_close(grad, grad_ref, rtol=1e-5)
    assert_trees_all_close(hvp, hvp_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_non_float_inputs_get_no_gradient_and_int_outputs_are_not_differentiable(index_dtype):
    f = torch_function(lambda x, idx: (x[idx] * 2.0, jnp.argmax(x)))
    x = torch.randn(5, requires_grad=True)
    idx = torch.tensor([0, 3], dtype=index_dtype)  # int64 crosses as int32 while x64 is off.
    values, argmax = f(x, idx)
    assert argmax.dtype == (torch.int64 if jax.config.jax_enable_x64 else torch.int32)
    assert not argmax.requires_grad
    assert int(argmax) == int(torch.argmax(x))
    values.sum().backward()
    assert_trees_all_close(x.grad, torch.tensor([2.0, 0, 0, 2.0, 0]))
    assert idx.grad is None


@pytest.mark.parametrize("scalar", [True, False], ids=["fused", "residuals"])
def test_retain_graph_and_backward_three_times(scalar):
    f = torch_function(lambda w: jnp.sum(w**2) if scalar else w**2)
    w = torch.randn(3, requires_grad=True)
    out = f(w)
    loss = out if scalar else out.sum()
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward(retain_graph=True)
    loss.backward()
    assert_trees_all_close(first, 2 * w.detach())
    assert_trees_all_close(w.grad, 3 * first)


def test_unused_outputs_get_zero_cotangents():
    f = torch_function(lambda a: (a * 2, a * 3))
    a = torch.randn(3, requires_grad=True)
    first, _ = f(a)
    first.sum().backward()
    assert_trees_all_close(a.grad, torch.full((3,), 2.0))


def test_no_grad_runs_forward_only():
    @jax.custom_vjp
    def no_vjp(x):
        return x * 2

    def fwd(x):
        raise AssertionError("the forward-only path must not trace a VJP")

    no_vjp.defvjp(fwd, lambda res, g: (g,))
    f = torch_function(no_vjp)
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = f(x)
    assert not out.requires_grad
    assert_trees_all_close(out, 2 * x.detach())
    out = f(x.detach())  # Grad mode on, but nothing requires grad.
    assert out.grad_fn is None
    with torch.inference_mode():
        out = f(torch.ones(3))
    assert out.is_inference()
    assert_trees_all_close(out, torch.full((3,), 2.0))
    with pytest.raises(AssertionError, match="must not trace a VJP"):
        f(x)


def test_one_trace_per_signature():
    f = torch_function(lambda p, x, scale: scale * jnp.sum(_mlp(p, x)))
    params, x = _params(), torch.randn(5, 3)
    for _ in range(5):
        f(params, x, 2.0).backward()
    assert f.trace_count == 1  # A scalar loss: one fused program, no separate VJP.
    f(params, torch.randn(7, 3), 2.0)
    assert f.trace_count == 2  # New shape.
    f(params, x, 3.0)
    assert f.trace_count == 3  # New static value.
    with torch.no_grad():
        f(params, x, 2.0)
        f(params, x, 2.0)
    assert f.trace_count == 4  # Forward-only program.

    g = torch_function(_mlp)
    for _ in range(5):
        g(params, x).sum().backward()
    assert g.trace_count == 2  # Forward with residuals, and its VJP.


@pytest.mark.parametrize("size", [8, 256], ids=["quick (polled)", "slow (waited on)"])
def test_inplace_mutation_right_after_the_call_is_safe(size):
    def chain(x):
        for _ in range(8):
            x = jnp.tanh(x @ x)
        return x

    f = torch_function(chain)
    x = torch.randn(size, size) / size**0.5
    want = chain(jnp.asarray(x.numpy()))
    for _ in range(20):
        source = x.clone()
        out = f(source)
        source.mul_(0)
        # Zeroed inputs would give zeros; float32 compiled vs eager JAX differ by a few ulps.
        np.testing.assert_allclose(out.numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_inplace_mutation_after_forward_keeps_first_order_gradients():
    f = torch_function(lambda w, x: jnp.tanh(w * x))
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4)
    x_before, w_before = x.clone(), w.detach().clone()
    out = f(w, x)
    x.mul_(0)
    with torch.no_grad():
        w.mul_(0)
    out.sum().backward()
    assert_trees_all_close(w.grad, x_before / torch.cosh(w_before * x_before) ** 2, rtol=1e-5)


def test_double_backward_refuses_inputs_changed_in_place():
    f = torch_function(lambda w: jnp.sum(w**3))
    w = torch.randn(3, requires_grad=True)
    loss = f(w)
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified in place after the call"):
        torch.autograd.grad(loss, w, create_graph=True)


def test_outputs_never_alias_inputs():
    f = torch_function(lambda a, b: (a, b.reshape(-1), a + 0))
    a = torch.randn(4)
    b = torch.randn(2, 2)
    outs = f(a, b)
    pointers = {a.data_ptr(), b.data_ptr()}
    assert not pointers & {o.data_ptr() for o in outs}
    outs[0].add_(1)
    outs[1].add_(1)
    assert_trees_all_close(outs[0], a + 1)
    assert_trees_all_close(outs[1], b.reshape(-1) + 1)


def test_static_arguments_and_keyword_arguments():
    f = torch_function(lambda x, *, power, name: {name: x**power})
    x = torch.randn(3)
    assert_trees_all_close(f(x, power=2, name="sq"), {"sq": x**2})
    assert_trees_all_close(f(x, power=3, name="cube"), {"cube": x**3})


def test_float32_and_float16_tensors():
    f = torch_function(lambda a, b: a * b.astype(a.dtype))
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, dtype=torch.float16)
    out = f(a, b)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert_trees_all_close(a.grad, b.float(), rtol=1e-6)


@_compile_warnings
def test_default_path_runs_under_torch_compile():
    f = torch_function(_mlp)
    params, x = _params(), torch.randn(5, 3)

    @torch.compile
    def loss(params, x):
        return (f(params, x) ** 2).sum() * 0.5

    got = torch.autograd.grad(loss(params, x), list(params.values()))
    want = torch.autograd.grad((_torch_mlp(params, x) ** 2).sum() * 0.5, list(params.values()))
    assert_trees_all_close(list(got), list(want), rtol=1e-5, atol=1e-5)


@_compile_warnings
@pytest.mark.parametrize("scalar", [True, False], ids=["fused", "residuals"])
def test_compilable_path_under_fullgraph_compile(scalar):
    def jax_fn(x, w, idx):
        y = jnp.tanh(x @ w)[idx]
        return jnp.sum(y**2) if scalar else (y, jnp.argmax(y, axis=1))

    f = torch_function(jax_fn, compilable=True)
    x = torch.randn(5, 3)
    w = torch.randn(3, 2, requires_grad=True)
    idx = torch.tensor([0, 2, 4])  # int64, torch's default: crosses as int32 while x64 is off.

    def step(x, w, idx):
        out = f(x, w, idx)
        return out * 3 if scalar else (out[0] * 3).sum() + out[1].sum()

    compiled = torch.compile(step, fullgraph=True)
    got_loss = compiled(x, w, idx)
    (got,) = torch.autograd.grad(got_loss, w)
    y = torch.tanh(x @ w)[idx]
    want_loss = (y**2).sum() * 3 if scalar else (y * 3).sum() + y.argmax(1).sum()
    (want,) = torch.autograd.grad(want_loss, w)
    assert_trees_all_close(got_loss, want_loss, rtol=1e-5)
    assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_int64_argument_crosses_as_int32_and_one_out_of_range_is_named():
    f = torch_function(lambda table, ids: (jnp.take(table, ids, axis=0), ids))
    table = torch.randn(6, 2, requires_grad=True)
    with jax.enable_x64(False):
        rows, ids = f(table, torch.tensor([[5, 0], [2, 2]]))
        assert ids.dtype == torch.int32  # What JAX computed with: outputs keep JAX's dtypes.
        assert_trees_all_close(rows, table[torch.tensor([[5, 0], [2, 2]])])
        rows.sum().backward()
        assert_trees_all_close(table.grad[:, 0], torch.tensor([1.0, 0, 2, 0, 0, 1]))
        with pytest.raises(ValueError, match=r"^torch_function\(") as info:
            f(table, torch.tensor([0, -(2**33)]))
    message = str(info.value)
    assert ": argument args[1]: a torch.int64 tensor crosses to JAX as int32 while" in message
    assert "it holds -8589934592. Fix: enable x64" in message


@pytest.mark.parametrize("compilable", [False, True], ids=["eager", "custom_op"])
def test_an_int64_argument_gives_the_int32_result_on_either_path(compilable):
    f = torch_function(lambda x, idx: jnp.sum(x[idx] ** 2), compilable=compilable)
    x = torch.randn(5, requires_grad=True)
    with jax.enable_x64(False):
        want = torch.autograd.grad(f(x, torch.tensor([0, 3, 3], dtype=torch.int32)), x)
        got = torch.autograd.grad(f(x, torch.tensor([0, 3, 3])), x)
        assert_trees_all_close(got, want, rtol=0, atol=0)
        named = "tensor 1" if compilable else r"argument args\[1\]"
        with pytest.raises(ValueError, match=f"{named}: a torch.int64 tensor .* holds 2147483648"):
            f(x, torch.tensor([2**31]))


@pytest.mark.x64
def test_with_x64_on_an_int64_argument_crosses_as_int64():
    f = torch_function(lambda ids: ids + 1)
    ids = torch.tensor([2**40, -(2**50)])
    plus_one = f(ids)
    assert plus_one.dtype == torch.int64
    assert torch.equal(plus_one, ids + 1)


def _sin_times_and_sum(a, b):
    return jnp.sin(a) * b, a + b


@pytest.mark.x64
def test_compilable_path_gradcheck():
    f = torch_function(_sin_times_and_sum, compilable=True)
    a = torch.randn(3, dtype=F64, requires_grad=True)
    b = torch.randn(3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (a, b))


def test_compilable_path_errors():
    f = torch_function(_sin_times_and_sum, compilable=True)
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True is not supported"):
        torch.autograd.grad(f(a, b)[0].sum(), a, create_graph=True)
    with pytest.raises(TypeError, match="positional arguments only"):
        f(a, b=b)
    with pytest.raises(TypeError, match="argument 1 is a float"):
        f(a, 2.0)
    nested = torch_function(lambda a: {"a": a}, compilable=True)
    with pytest.raises(TypeError, match="flat tuple or list of arrays"):
        nested(a)


def test_two_threads_train_two_models_at_once():
    def train(seed, steps, results):
        f = torch_function(functools.partial(_loss_with_seed, seed))
        params = _params(seed)
        opt = torch.optim.SGD(params.values(), lr=0.1)
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(seed))
        for _ in range(steps):
            opt.zero_grad()
            f(params, x).backward()
            opt.step()
        results[seed] = {k: v.detach().clone() for k, v in params.items()}

    sequential, threaded = {}, {}
    for seed in (1, 2):
        train(seed, 30, sequential)
    threads = [threading.Thread(target=train, args=(seed, 30, threaded)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_trees_all_close(threaded, sequential, rtol=0, atol=0)


def _loss_with_seed(seed, params, x):
    return jnp.mean((_mlp(params, x) - seed) ** 2)


def test_re_created_static_functions_reuse_the_trace():
    f = torch_function(lambda fn, x: fn(x))
    x = torch.randn(3)
    for scale in (2.0, 2.0, 3.0):
        out = f(lambda v, s=scale: v * s, x)  # A new lambda each time.
        assert_trees_all_close(out, scale * x)
    assert f.trace_count == 2
    for offset in (1.0, 1.0):
        f(functools.partial(jnp.add, offset), x)
    assert f.trace_count == 3
    captured = torch.ones(3)
    for value in (1.0, 2.0):
        captured.fill_(value)  # A mutable capture: a new lambda over it must trace again.
        assert_trees_all_close(f(lambda v: v + captured.numpy(), x), x + value)
    assert f.trace_count == 5


def test_torch_func_grad_works_and_vmap_explains():
    f = torch_function(lambda w: jnp.sum(jnp.sin(w) ** 2))
    w = torch.randn(3)
    assert_trees_all_close(torch.func.grad(f)(w), torch.sin(2 * w), rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match="Batch inside JAX instead"):
        torch.func.vmap(torch_function(jnp.sin))(torch.randn(2, 3))


_AFTER_A_FAILED_COMPILE = """
import warnings
warnings.simplefilter("error")
warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
import jax.numpy as jnp
import torch
import bridge_mr

x, w = torch.randn(3), torch.randn(3, requires_grad=True)
strict = bridge_mr.torch_function(lambda w, a: jnp.sum(w * a["a"]), compilable=True)
try:
    torch.compile(lambda w: strict(w, {"a": x}), backend="eager")(w)
except TypeError as error:
    assert "positional arguments only" in str(error), error
else:
    raise AssertionError("a compilable function took a dict")
f = bridge_mr.torch_function(lambda w, a: jnp.sum(w * a))
got = torch.compile(lambda w: f(w, x) * 2, backend="eager")(w)
torch.testing.assert_close(got, (w * x).sum() * 2)
print("ok")
"""


def test_a_failed_compile_leaves_later_compiles_working():
    """After torch.compile failed inside a torch_function's call, Dynamo skips that call's code
    but would still compile the frames it calls, JAX's too, in any later compiled function:
    bridge_mr then runs the call without Dynamo (a fresh process: Dynamo's skips are
    per process)."""
    assert child.run_python(["-c", _AFTER_A_FAILED_COMPILE], timeout=300).strip() == "ok"
