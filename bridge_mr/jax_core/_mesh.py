"""Which mesh (if any) places values along the placement axis, and with which axis type."""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

from bridge_mr._compat import jax as _jax_compat
from bridge_mr.typing import AnyMesh

from ._program import Placement


def ambient_mesh() -> AnyMesh | None:
    """The mesh the caller set for this thread, or None.

    The mesh of `jax.set_mesh` (its concrete mesh, which also serves eager sharding
    constraints, where it matches the abstract mesh in effect) or of
    `jax.sharding.use_abstract_mesh`, else that of a legacy `with mesh:` block.

    Returns:
      A `Mesh` or `AbstractMesh`, or None when no mesh is set.

    Example:
      >>> from bridge_mr.jax_core import ambient_mesh
      >>> ambient_mesh() is None  # no mesh set
      True
      >>> mesh = jax.make_mesh((8,), ("clients",))
      >>> with jax.set_mesh(mesh):
      ...     found = ambient_mesh()
      >>> found == mesh
      True
    """
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        concrete = _jax_compat.concrete_mesh()
        if concrete is not None and concrete.abstract_mesh == abstract:
            return concrete
        return abstract
    return _jax_compat.legacy_mesh()


def placement_mesh(mesh: AnyMesh | None, placement: Placement, *, caller: str) -> AnyMesh | None:
    """Returns the mesh to shard `placement` over, or None for unconstrained execution.

    `mesh` (the `mesh=` argument of `caller`) wins over `jax.set_mesh` and the legacy
    `with mesh:`. A mesh without a `placement` axis gives None, as in drjax: placed values keep
    the placement axis unsharded and their other dimensions keep their sharding (with Explicit
    axes too, and under `jit` too). A Manual placement axis (inside `shard_map`) also gives None:
    values are already local to one shard. An Explicit placement axis must divide the placement
    size, since Explicit shardings are even.
    """
    if check_mesh(mesh, caller=caller, placement=placement.name) is None:
        mesh, source = ambient_mesh(), "the mesh set with jax.set_mesh (or `with mesh:`)"
    else:
        source = f"the mesh passed as {caller}(mesh=...)"
    if mesh is None or mesh.empty or placement.name not in mesh.axis_names:
        return None
    kind = axis_type(mesh, placement.name)
    if kind == AxisType.Manual:
        return None
    axis_size = mesh.shape[placement.name]
    remainder = placement.size % axis_size
    if kind == AxisType.Explicit and jax.export.is_symbolic_dim(remainder):
        raise ValueError(
            f"bridge_mr.{caller}: placement {placement.name!r} has the symbolic size "
            f"{placement.size}, which the Explicit axis {placement.name!r} of size {axis_size} of "
            f"{source} may not divide, and Explicit shardings must be even. Write the size as a "
            f'multiple (jax.export.symbolic_shape("{axis_size}*k")) or make that axis Auto '
            "(axis_types=(jax.sharding.AxisType.Auto, ...)), which allows uneven sharding."
        )
    if kind == AxisType.Explicit and remainder:
        raise ValueError(
            f"bridge_mr.{caller}: placement {placement.name!r} has size {placement.size}, which "
            f"the Explicit axis {placement.name!r} of size {axis_size} of {source} does not "
            f"divide (mesh axes {dict(mesh.shape)}), and Explicit shardings must be even. Use a "
            f"{placement.name!r} count divisible by {axis_size} (e.g. pad with zero-weight "
            f"{placement.name} up to {-(-placement.size // axis_size) * axis_size}), a mesh whose "
            f"{placement.name!r} axis size divides {placement.size}, or make that axis Auto "
            "(axis_types=(jax.sharding.AxisType.Auto, ...)), which allows uneven sharding."
        )
    return mesh


def check_mesh(mesh: object, *, caller: str, placement: str) -> AnyMesh | None:
    """Returns `mesh` (the `mesh=` argument of `caller`) if it is a mesh or None, else raises.

    Args:
      mesh: what the caller passed as `mesh=`.
      caller: the public function it was passed to ("map_reduce", "broadcast", ...).
      placement: the placement axis the mesh should have.

    Returns:
      `mesh`, a `Mesh` or `AbstractMesh`, or None.

    Raises:
      TypeError: `mesh` is neither None nor a mesh (e.g. an axis name); the message names the
        argument, what it got and the fix.

    Example:
      >>> mesh = jax.make_mesh((1,), ("clients",))
      >>> bridge_mr.jax_core.check_mesh(mesh, caller="map_reduce", placement="clients") is mesh
      True
    """
    if mesh is None or isinstance(mesh, (Mesh, AbstractMesh)):
        return mesh
    raise TypeError(
        f"{caller}(mesh=...): expected a jax.sharding.Mesh or AbstractMesh (with the placement "
        f"axis {placement!r}), or None for the mesh set with jax.set_mesh; got "
        f"{type(mesh).__name__} {mesh!r}. Fix: pass the mesh itself, not an axis name, e.g. "
        f"mesh=jax.make_mesh((jax.device_count(),), ({placement!r},)), or drop mesh=."
    )


def axis_type(mesh: AnyMesh, name: str) -> AxisType:
    """The type (Auto, Explicit or Manual) of the mesh axis `name`."""
    return mesh.axis_types[mesh.axis_names.index(name)]


def abstract(mesh: AnyMesh) -> AbstractMesh:
    """The abstract mesh of `mesh` (itself if already abstract)."""
    return mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh
