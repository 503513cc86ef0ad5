"""`from_torch` of torch code that writes into a new tensor slice by slice, or through a view.

Such writes were lost (silently wrong results, issue 40) where they reach torchax as in-place
ops on a view's copy: inside torch's C++ composites that functionalization runs whole
(`F.pad(..., mode="circular")` fills a new tensor slice by slice; `F.instance_norm` writes its
running statistics through an alias), and into tensors the function made itself
(`out.diagonal().copy_(x)`, `out.view(2, 3)[1] = x`, `out.t()[0].fill_(2)`). Each is checked
against torch: values eager and jitted, gradients under `jax.jit(jax.grad(...))`, and the
circular padding also under `vmap` and `map_reduce`. Then writes torch refuses or this cannot
carry back, refused with `UnsupportedTorchOperation`; and the code's own in-place ops on
intermediates, through views (functionalized, as they always were).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.against_torch import check
from helpers.from_torch import close
from torch import nn

import bridge_mr
from bridge_mr.torch_fn import UnsupportedTorchOperation


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Circular padding: torch's C++ fills a new tensor slice by slice (it came out as empty memory).

CIRCULAR = {
    "1d": ((2, 3, 5), (2, 1)),
    "2d": ((1, 2, 4, 5), (1, 2, 2, 1)),
    "3d": ((1, 1, 3, 4, 4), (1, 1, 1, 0, 2, 1)),
    "negative": ((1, 2, 6), (-1, 2)),
}


@pytest.mark.parametrize("name", list(CIRCULAR))
def test_circular_padding_matches_torch(name: str) -> None:
    shape, pad = CIRCULAR[name]

    def circular(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, pad, mode="circular")

    check(circular, [_randn(*shape)])


def _circular_conv() -> tuple[nn.Conv2d, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular")

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (torch.func.functional_call(conv, params, (x,)) ** 2).mean()

    return conv, loss


def test_a_circular_convolution_under_vmap_matches_torch() -> None:
    conv, loss = _circular_conv()
    params = {k: v.detach() for k, v in conv.named_parameters()}
    xs = _randn(4, 1, 2, 5, 5)
    got = jax.vmap(bridge_mr.from_torch(loss), in_axes=(None, 0))(
        {k: jnp.asarray(v.numpy()) for k, v in params.items()}, jnp.asarray(xs.numpy())
    )
    want = torch.stack([loss(params, x) for x in xs])
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5)


@pytest.mark.parametrize("strategy", ["vmap", "per_client"])
def test_a_circular_convolution_through_map_reduce_matches_a_torch_loop(strategy: str) -> None:
    conv, loss = _circular_conv()
    reference = copy.deepcopy(conv)
    xs = _randn(3, 1, 2, 5, 5, seed=1)
    mean = bridge_mr.map_reduce(
        bridge_mr.from_torch(loss), dict(conv.named_parameters()), xs, strategy=strategy
    )
    mean.backward()
    params = dict(reference.named_parameters())
    expected = torch.stack([loss(params, x) for x in xs]).mean()
    expected.backward()
    torch.testing.assert_close(mean.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    for name, p in conv.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Instance norm's running statistics: torch's C++ writes them through `alias(running_mean)`.


def _instance_norm(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    return F.instance_norm(x, mean, var, use_input_stats=True, momentum=0.3)


def test_instance_norm_running_statistics_come_back_through_mutable() -> None:
    x, mean, var = _randn(2, 3, 5), _randn(3, seed=1), _randn(3, seed=2).exp()
    want_mean, want_var = mean.clone(), var.clone()
    want = _instance_norm(x, want_mean, want_var)
    out, (got_mean, got_var) = bridge_mr.from_torch(_instance_norm, mutable=(1, 2))(
        *(jnp.asarray(t.numpy()) for t in (x, mean, var))
    )
    assert not np.allclose(want_mean.numpy(), mean.numpy())  # torch did update them
    np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_mean), want_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_var), want_var.numpy(), rtol=1e-5, atol=1e-6)


def test_instance_norm_module_statistics_match_torch_and_need_mutable() -> None:
    norm = nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
    state = {k: v.detach().clone() for k, v in norm.state_dict().items()}

    def forward(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(norm, state, (x,))

    x = _randn(2, 3, 5)
    want_state = {k: v.clone() for k, v in state.items()}
    want = forward(want_state, x)
    jstate = {k: jnp.asarray(v.numpy()) for k, v in state.items()}
    got, new_state = bridge_mr.from_torch(forward, mutable=0)(jstate, jnp.asarray(x.numpy()))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-6)
    for key in ("running_mean", "running_var"):
        np.testing.assert_allclose(
            np.asarray(new_state[key]), want_state[key].numpy(), rtol=1e-5, atol=1e-6
        )
    with pytest.raises(UnsupportedTorchOperation, match=r"wrote in place to its argument.*mutable"):
        bridge_mr.from_torch(forward)(jstate, jnp.asarray(x.numpy()))


# ---------------------------------------------------------------------------------------------
# Writes into a tensor the function made, through views (torchax copies each view).


def diagonal_copy(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(3, 3)
    out.diagonal().copy_(x)
    out.t()[0].fill_(2.0)  # a lazy torchax View of a view's copy
    return out


def view_setitem(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(6)
    out.view(2, 3)[1] = x
    return out


def slice_multiply(x: torch.Tensor) -> torch.Tensor:
    out = torch.full((3, 3), 1.0)
    out[:, 1:].mul_(x[:, None])
    out.T[2] -= 1
    return out


def as_strided_copy(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(9)
    out.as_strided((3,), (4,)).copy_(x)
    return out


def flatten_writes(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(2, 3)
    out.flatten()[1] = 5.0
    out.flatten()[3:].copy_(x)
    return out


def split_writes(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(4, 3)
    top, bottom = out.split(2)
    top.copy_(x[:2])
    bottom.add_(x[2:] * 3)
    return out * 1


def unbind_writes(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(2, 3)
    for row, value in zip(out.unbind(0), x.unbind(0), strict=True):
        row.copy_(value * 2)
    return out


def nested_views(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(4, 4)
    out.t().narrow(0, 1, 2).select(1, 3).mul_(0).add_(x)
    out.view(2, 8)[:, ::3] = 7.0
    return out


def a_view_read_after_its_base_is_written(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(2, 3)
    row = out.select(0, 1)  # taken before the writes below: torch's view sees them
    out.fill_(1.0)
    out[1] = x
    return row * 2


def one_row_of_an_expanded_view(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(3)
    out.unsqueeze(0).expand(2, 3)[0].copy_(x)  # one row: no element written twice
    return out


WRITES = [
    diagonal_copy,
    view_setitem,
    slice_multiply,
    as_strided_copy,
    flatten_writes,
    nested_views,
    a_view_read_after_its_base_is_written,
    one_row_of_an_expanded_view,
]


@pytest.mark.parametrize("fn", WRITES, ids=lambda fn: fn.__name__)
def test_writes_through_views_of_a_tensor_made_inside_match_torch(
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    shape = {"slice_multiply": (3,), "nested_views": (2,)}.get(fn.__name__, (3,))
    check(fn, [_randn(*shape)])


@pytest.mark.parametrize("fn", [split_writes, unbind_writes], ids=lambda fn: fn.__name__)
def test_writes_into_views_split_off_a_tensor_match_torch(
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    # torch's autograd refuses these in-place writes into outputs of split / unbind (values only).
    check(fn, [_randn(4, 3) if fn is split_writes else _randn(2, 3)], grad=False)


def outputs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    buffer = torch.empty(4, 3)
    torch.cat([x, y], out=buffer)
    stacked = torch.empty(2, 2, 3)
    torch.stack([x, y], out=stacked)
    summed = torch.empty(2, 3)
    torch.add(x, y, alpha=2, out=summed)
    return torch.cat([buffer.flatten(), stacked.flatten(), summed.flatten()])


def test_out_arguments_of_tensors_made_inside_are_written_like_torch() -> None:
    # torch's autograd refuses out= of tensors that require grad (values only); these raised
    # "INTERNAL ASSERT FAILED" in torch's functionalization.
    check(outputs, [_randn(2, 3), _randn(2, 3, seed=1)], grad=False)


def resized(x: torch.Tensor) -> torch.Tensor:
    buffer = torch.empty(5)
    torch.cat([x, x], out=buffer)  # torch resizes an out= of another shape
    return buffer


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_an_out_argument_of_another_shape_is_resized_like_torch() -> None:
    check(resized, [_randn(3)], grad=False)


def type_as(x: torch.Tensor) -> torch.Tensor:
    out = torch.full((3,), 1.7)
    integers = out.type_as(torch.tensor([1, 2, 3]))  # torchax converted `out` itself
    return out + integers + x


def vector_to_parameters(vector: torch.Tensor) -> torch.Tensor:
    parameters = [torch.zeros(2, 3), torch.zeros(4)]
    nn.utils.vector_to_parameters(vector, parameters)  # `param.data = ...`: torchax dropped it
    return torch.cat([p.flatten() for p in parameters]) * 2


def test_type_as_returns_a_converted_copy_like_torch() -> None:
    check(type_as, [_randn(3)])


def test_vector_to_parameters_sets_the_parameters_like_torch() -> None:
    check(vector_to_parameters, [_randn(10)], grad=False)  # `.data =` cuts torch's graph


# ---------------------------------------------------------------------------------------------
# Refused: writes no view can carry back.


def test_a_write_into_an_expanded_view_is_refused_as_torch_refuses_it() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(3)
        out.expand(2, 3).add_(1.0)
        return out + x

    with pytest.raises(RuntimeError, match="more than one element"):
        fn(torch.ones(3))
    with pytest.raises(
        UnsupportedTorchOperation,
        match=r"test_writes\.py:\d+ .*several elements are one element of its base.*Fix:",
    ):
        bridge_mr.from_torch(fn)(jnp.ones(3))


@pytest.mark.parametrize("how", ["real", "view_as_real"])
def test_a_write_into_a_view_of_another_dtype_is_refused(how: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        z = torch.zeros(3, dtype=torch.complex64)
        if how == "real":
            z.real.add_(x)
        else:
            torch.view_as_real(z)[:, 1].copy_(x)
        return z.abs()

    np.testing.assert_array_equal(fn(torch.ones(3)).numpy(), np.ones(3))  # torch writes z
    with pytest.raises(
        UnsupportedTorchOperation, match=r"reinterprets its base's dtype.*Fix: compute"
    ):
        bridge_mr.from_torch(fn)(jnp.ones(3))


def test_in_place_ops_and_views_on_intermediates_work() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h[0] += 1.0  # in place through a view
        h.relu_()
        h.view(-1)[1:3].mul_(3.0)
        return h.t().contiguous().sum(0)

    x = torch.randn(3, 4)
    close(bridge_mr.from_torch(fn)(jnp.asarray(x.numpy())), fn(x.clone()), "in-place")
