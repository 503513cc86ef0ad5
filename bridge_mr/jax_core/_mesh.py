"""Which mesh (if any) places values along the placement axis, and with which axis type."""

from __future__ import annotations

from typing import TypeAlias

import jax
from jax._src import mesh as _mesh_internal  # legacy `with mesh:` without a DeprecationWarning
from jax.sharding import AbstractMesh, AxisType, Mesh

AnyMesh: TypeAlias = Mesh | AbstractMesh


def _ambient_mesh() -> AnyMesh | None:
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        # The concrete mesh also serves eager (un-jitted) sharding constraints.
        concrete = _mesh_internal.get_concrete_mesh()
        if concrete is not None and not concrete.empty and concrete.abstract_mesh == abstract:
            return concrete
        return abstract
    legacy = _mesh_internal.thread_resources.env.physical_mesh
    return None if legacy.empty else legacy


def placement_mesh(mesh: AnyMesh | None, placement: str, *, argument: str) -> AnyMesh | None:
    """Returns the mesh to shard `placement` over, or None for unconstrained execution.

    `mesh` (an explicit argument) wins over `jax.set_mesh` and the legacy `with mesh:`. A mesh
    without a `placement` axis gives None when its axes are Auto, and an error when they are
    Explicit (an Explicit mesh must say where every placed value lives). A Manual placement
    axis (inside `shard_map`) also gives None: values are already local to one shard.
    """
    if mesh is None:
        mesh = _ambient_mesh()
    elif not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(
            f"{argument} expects a jax.sharding.Mesh or AbstractMesh (or None for the mesh set "
            f"with jax.set_mesh); got {type(mesh).__name__}: {mesh!r}."
        )
    if mesh is None or mesh.empty:
        return None
    if placement not in mesh.axis_names:
        if any(t == AxisType.Explicit for t in mesh.axis_types):
            raise ValueError(
                f"{argument}: the mesh has Explicit axes {mesh.axis_names} but no axis named "
                f"{placement!r}, so bridge_mr cannot say how placed values are sharded. Add a "
                f"{placement!r} axis to the mesh (e.g. jax.make_mesh((n, ...), "
                f"({placement!r}, ...))), or make its axes Auto "
                "(axis_types=(jax.sharding.AxisType.Auto, ...))."
            )
        return None
    if axis_type(mesh, placement) == AxisType.Manual:
        return None
    return mesh


def axis_type(mesh: AnyMesh, name: str) -> AxisType:
    """The type (Auto, Explicit or Manual) of the mesh axis `name`."""
    return mesh.axis_types[mesh.axis_names.index(name)]


def abstract(mesh: AnyMesh) -> AbstractMesh:
    """The abstract mesh of `mesh` (itself if already abstract)."""
    return mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh
