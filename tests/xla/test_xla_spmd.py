"""SPMD over 4 CPU devices: placed values sharded along the placement axis, the unsharded results.

SPMD mode is per process and must be set before any XLA tensor exists, so each scenario runs in
a child interpreter that prints its results as JSON; this process computes the unsharded
reference on its own (non-SPMD) XLA device.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import jax
import pytest
import torch
from helpers import assert_trees_all_close
from jax.sharding import AxisType

import bridge_mr

pytestmark = pytest.mark.xla

SHARDED = ("{devices=[4,1,1]<=[4]}", "{devices=[4,1,1]0,1,2,3}")

# Shared by the children and the reference: inputs and the client function.
_COMMON = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import torch

    def inputs():
        gen = torch.Generator().manual_seed(0)
        server = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
        clients = {"x": torch.randn(8, 5, 4, generator=gen),
                   "y": torch.randn(8, 5, 3, generator=gen)}
        return server, clients

    def client_outputs(server, client):
        hidden = jnp.tanh(client["x"] @ server["w"] + server["b"])
        return {"hidden": hidden, "loss": jnp.mean((hidden - client["y"]) ** 2)}
    """
)

_SPMD_SCRIPT = (
    textwrap.dedent(
        """
        import json
        import numpy as np
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()  # Before any XLA tensor exists.
        """
    )
    + _COMMON
    + textwrap.dedent(
        """
        import warnings
        from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P
        import bridge_mr
        from bridge_mr.runners import torch_xla_global_mesh

        warnings.simplefilter("error")
        spec = torch_xla._XLAC._get_xla_sharding_spec
        device = torch_xla.device()
        mesh = AbstractMesh((4,), ("clients",), axis_types=(AxisType.Auto,))

        def on_device(tree, grad=False):
            return jax.tree.map(lambda t: t.to(device).requires_grad_(grad), tree)

        def round_and_placed(mesh):
            server, clients = inputs()
            server, clients = on_device(server, grad=True), on_device(clients)
            out = bridge_mr.map_reduce(client_outputs, server, clients, mesh=mesh)
            (out["loss"] + out["hidden"].sum()).backward()
            with bridge_mr.program(placements={"clients": 8}):
                placed = bridge_mr.broadcast(server, mesh=mesh)
                per_client = bridge_mr.map_fn(client_outputs, (placed, clients), mesh=mesh)
            torch_xla.sync()
            return {
                "specs": [spec(placed["w"]), spec(per_client["hidden"]), spec(out["hidden"])],
                "out": jax.tree.map(lambda t: t.cpu().tolist(), out),
                "grads": {name: p.grad.cpu().tolist() for name, p in server.items()},
                "per_client": per_client["loss"].detach().cpu().tolist(),
            }

        result = {"devices": xr.global_runtime_device_count()}
        result["mesh_argument"] = round_and_placed(mesh)
        result["mesh_before_set"] = repr(torch_xla_global_mesh())

        xs.set_global_mesh(xs.Mesh(np.arange(4), (4,), ("clients",)))
        result["global_mesh"] = round_and_placed(None)
        derived = torch_xla_global_mesh()
        result["derived"] = [derived.axis_names, derived.axis_sizes, str(derived.axis_types)]

        @bridge_mr.torch_function
        def own_constraint(x):
            # A bare PartitionSpec: the mesh comes from torch-xla's, or the caller's context.
            return jax.lax.with_sharding_constraint(jnp.sin(x), P("clients", None))

        x = inputs()[1]["x"][:, 0].to(device).requires_grad_(True)
        own = own_constraint(x)
        with jax.sharding.use_abstract_mesh(mesh):
            own_in_context = own_constraint(x * 1)
        (own.sum() + own_in_context.sum()).backward()
        torch_xla.sync()
        result["own_constraint"] = [spec(own), spec(own_in_context), own.cpu().tolist()]
        result["own_constraint_grad"] = x.grad.cpu().tolist()

        too_small = AbstractMesh((2,), ("clients",), axis_types=(AxisType.Auto,))
        try:
            round_and_placed(too_small)
        except ValueError as error:
            result["too_small"] = str(error)
        print(json.dumps(result))
        """
    )
)

_LATE_SCRIPT = (
    textwrap.dedent(
        """
        import json
        import warnings
        import torch_xla
        import torch_xla.runtime as xr
        """
    )
    + _COMMON
    + textwrap.dedent(
        """
        from jax.sharding import AbstractMesh, AxisType
        import bridge_mr

        spec = torch_xla._XLAC._get_xla_sharding_spec
        server, clients = inputs()
        server = jax.tree.map(lambda t: t.to(torch_xla.device()), server)
        clients = jax.tree.map(lambda t: t.to(torch_xla.device()), clients)
        mesh = AbstractMesh((4,), ("clients",), axis_types=(AxisType.Auto,))

        def per_client():
            with bridge_mr.program(placements={"clients": 8}):
                placed = bridge_mr.broadcast(server, mesh=mesh)
                out = bridge_mr.map_fn(client_outputs, (placed, clients), mesh=mesh)["hidden"]
            torch_xla.sync()
            return out

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = per_client()
            xr.use_spmd()  # Too late: XLA tensors exist already.
            after = per_client()
        print(json.dumps({
            "warnings": [str(w.message) for w in caught],
            "specs": [spec(before), spec(after)],
            "equal": bool(before.cpu().equal(after.cpu())),
        }))
        """
    )
)


@pytest.fixture(scope="module")
def common() -> dict[str, Any]:
    """The names `_COMMON` defines (inputs, client_outputs), for the reference runs here."""
    namespace: dict[str, Any] = {}
    exec(_COMMON, namespace)
    return namespace


@pytest.fixture(scope="module")
def unsharded(xla: Any, common: dict[str, Any]) -> dict[str, Any]:
    """The children's round computed on this process's XLA device, without SPMD or a mesh."""
    server, clients = common["inputs"]()
    server = {name: t.to(xla.device()).requires_grad_(True) for name, t in server.items()}
    clients = {name: t.to(xla.device()) for name, t in clients.items()}
    out = bridge_mr.map_reduce(common["client_outputs"], server, clients)
    (out["loss"] + out["hidden"].sum()).backward()
    with bridge_mr.program(placements={"clients": 8}):
        per_client = bridge_mr.map_fn(
            common["client_outputs"], (bridge_mr.broadcast(server), clients)
        )
    xla.sync()
    return {
        "out": {name: t.detach().cpu() for name, t in out.items()},
        "grads": {name: p.grad.cpu() for name, p in server.items()},
        "per_client": per_client["loss"].detach().cpu(),
    }


@pytest.fixture(scope="module")
def spmd_run(run_child: Callable[[str], Any]) -> dict[str, Any]:
    """What the SPMD child computed and saw."""
    return run_child(_SPMD_SCRIPT)


def _check_round(result: dict[str, Any], unsharded: dict[str, Any]) -> None:
    placed_spec, per_client_spec, reduced_spec = result["specs"]
    assert placed_spec in SHARDED
    assert per_client_spec in SHARDED
    assert reduced_spec == "{replicated}"
    # float32, summed over the clients in another order when sharded.
    tolerance = {"rtol": 1e-5, "atol": 1e-6}
    for name in ("out", "grads", "per_client"):
        values = jax.tree.map(
            torch.tensor,
            result[name],
            is_leaf=lambda x: isinstance(x, list),
        )
        assert_trees_all_close(values, unsharded[name], **tolerance)


def test_mesh_argument_shards_placed_values_and_matches_unsharded(
    spmd_run: dict[str, Any], unsharded: dict[str, Any]
) -> None:
    assert spmd_run["devices"] == 4
    _check_round(spmd_run["mesh_argument"], unsharded)


def test_torch_xla_global_mesh_is_followed_like_a_context_mesh(
    spmd_run: dict[str, Any], unsharded: dict[str, Any], common: dict[str, Any]
) -> None:
    assert spmd_run["mesh_before_set"] == "None"
    assert spmd_run["derived"] == [["clients"], [4], str((AxisType.Auto,))]
    _check_round(spmd_run["global_mesh"], unsharded)
    *own_specs, own_values = spmd_run["own_constraint"]
    assert all(s in ("{devices=[4,1]<=[4]}", "{devices=[4,1]0,1,2,3}") for s in own_specs)
    x = common["inputs"]()[1]["x"][:, 0]
    torch.testing.assert_close(torch.tensor(own_values), torch.sin(x))
    grad = torch.tensor(spmd_run["own_constraint_grad"])
    torch.testing.assert_close(grad, 2 * torch.cos(x))


def test_a_mesh_that_does_not_cover_the_devices_is_refused(spmd_run: dict[str, Any]) -> None:
    assert "mesh of 2 devices ({'clients': 2})" in spmd_run["too_small"]
    assert "torch-xla's SPMD runtime has 4" in spmd_run["too_small"]


def test_late_use_spmd_warns_then_shards_with_the_same_results(run_child: Any) -> None:
    result = run_child(_LATE_SCRIPT)
    *ours, theirs = result["warnings"]
    assert len(ours) == 2  # one per lowered program: broadcast and map_fn
    assert all("SPMD mode is off" in message for message in ours)
    assert "use_spmd() first thing in the program" in ours[0]
    assert "Replicating tensors already initialized" in theirs  # torch-xla's own warning
    before, after = result["specs"]
    assert before == ""
    assert after in SHARDED
    assert result["equal"]
