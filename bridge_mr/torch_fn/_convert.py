"""`from_torch`: a function written in torch, as a JAX function (torchax underneath)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge_mr._compat import jax as jax_compat
from bridge_mr._compat import torchax as torchax_compat

from ._aliases import current
from ._environment import UnsupportedTorchOperation, environment, keyed, traceable

__all__ = ["FromTorch", "client_keys", "from_torch"]


@dataclasses.dataclass(frozen=True)
class FromTorch:
    """A torch function run as JAX operations, with the options `from_torch` was given.

    Attributes:
      torch_fn: the torch function.
      mutable: the positional arguments whose values after the call are returned too.
      rng: whether the converted function takes a key as its first argument.
    """

    torch_fn: Callable[..., Any]
    mutable: tuple[int, ...] = ()
    mutable_one: bool = False  # `mutable` was given as one int: return that argument alone
    rng: bool = False

    def __repr__(self) -> str:
        name = getattr(self.torch_fn, "__qualname__", None) or repr(self.torch_fn)
        options = "".join(
            [
                f", mutable={self.mutable[0] if self.mutable_one else self.mutable}"
                if self.mutable
                else "",
                ", rng=True" if self.rng else "",
            ]
        )
        return f"from_torch({name}{options})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the torch function on JAX values (see `from_torch`)."""
        key = None
        if self.rng:
            if not args:
                raise TypeError(
                    f"{self!r} takes a JAX key as its first argument (it was converted with "
                    f"rng=True), got no positional argument. Fix: call it as fn(key, *args)."
                )
            key, args = _as_key(args[0], self), args[1:]
        for i in self.mutable:
            if i >= len(args):
                raise TypeError(
                    f"{self!r}: mutable names positional argument {i}, but the call has "
                    f"{len(args)} positional argument(s). Fix: pass it positionally."
                )
        env = environment()
        tx = torchax_compat.import_torchax()
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
        wrapped = [_to_torch(leaf, path, self, tx, env) for path, leaf in paths_leaves]
        # What each tensor held when the call began (a numpy leaf's JAX copy, not the leaf).
        originals = [
            torchax_compat.value_of(t) if isinstance(t, tx.Tensor) else leaf
            for t, (_, leaf) in zip(wrapped, paths_leaves, strict=True)
        ]
        t_args, t_kwargs = jax.tree_util.tree_unflatten(treedef, wrapped)
        with (
            keyed(key) if key is not None else contextlib.nullcontext(),
            env,
            # The torch code starts in grad mode whatever the caller's (map_reduce is often
            # called under torch.no_grad): only its own no_grad blocks stop gradients.
            torch.enable_grad(),
            torchax_compat.device(),
            jax.numpy_dtype_promotion("standard"),
        ):
            # Functionalized: torchax copies the results of view ops, so an in-place write
            # through a view (`h.view(-1).mul_(2)`) would otherwise be lost.
            out = torch.func.functionalize(self._traced_fn, remove="mutations")(*t_args, **t_kwargs)
            out = jax.tree_util.tree_map(lambda x: _to_jax(x, self, tx, env), out)
        after = list(originals)
        for n, ((path, _), original, tensor) in enumerate(
            zip(paths_leaves, originals, wrapped, strict=True)
        ):
            if not isinstance(tensor, tx.Tensor):
                continue
            value = torchax_compat.value_of(tensor)
            if value is original:
                continue
            position = _position(path)
            if position is None:
                raise UnsupportedTorchOperation(
                    f"{self!r} wrote in place to its keyword argument {_describe(path)}; only "
                    f"positional arguments can be mutable. Fix: pass it positionally and list "
                    f"its index in mutable=."
                )
            if position not in self.mutable:
                raise UnsupportedTorchOperation(
                    f"{self!r} wrote in place to its argument {_describe(path)}; a JAX function "
                    f"cannot hand the new value back unless asked to (JAX values are immutable, "
                    f"so the write would be lost). Fix: convert with mutable={position} to get "
                    f"that argument's value after the call returned as well (e.g. a BatchNorm's "
                    f"running statistics in training mode), or do not write to it."
                )
            after[n] = value
        if not self.mutable:
            return out
        new_args, _ = jax.tree_util.tree_unflatten(treedef, after)
        if self.mutable_one:
            return out, new_args[self.mutable[0]]
        return out, tuple(new_args[i] for i in self.mutable)

    def _traced_fn(self, *args: Any, **kwargs: Any) -> Any:
        """The torch function on its arguments' functionalization wrappers, each answering
        `.jax()` as a torchax tensor does (libraries ask it whether they are being traced)."""
        traceable((args, kwargs))
        return self.torch_fn(*args, **kwargs)


def _position(path: tuple[Any, ...]) -> int | None:
    """The positional-argument index of a leaf of ((args...), {kwargs}), None for a keyword."""
    return path[1].idx if path[0].idx == 0 else None


def _describe(path: tuple[Any, ...]) -> str:
    head = f"[{path[1].idx}]" if path[0].idx == 0 else f"{path[1].key!r}"
    return f"{head}{jax.tree_util.keystr(path[2:])}" if len(path) > 2 else head


def _to_torch(leaf: Any, path: tuple[Any, ...], fn: FromTorch, tx: Any, env: Any) -> Any:
    """An argument leaf as the torch code sees it: arrays as torchax tensors."""
    if isinstance(leaf, torch.Tensor):
        raise TypeError(
            f"{fn!r}: argument {_describe(path)} is a torch tensor; the converted function is a "
            f"JAX function and takes JAX arrays. Fix: call it through bridge_mr (map_reduce, "
            f"map_fn or torch_function(...)), which hands it JAX arrays, or convert the tensor "
            f"with bridge_mr.dlpack.to_jax."
        )
    if isinstance(leaf, np.ndarray | np.generic):
        if leaf.dtype.itemsize == 8 and leaf.dtype.kind in "fciu" and not jax_compat.x64_enabled():
            raise TypeError(
                f"{fn!r}: argument {_describe(path)} is a numpy array of dtype {leaf.dtype}, "
                f"which JAX would silently narrow to 32 bits while its x64 mode is off. Fix: "
                f"cast it to a 32-bit dtype yourself, or enable x64 with "
                f'jax.config.update("jax_enable_x64", True).'
            )
        leaf = jnp.asarray(leaf)
    if not isinstance(leaf, jax.Array):
        return leaf  # numbers, strings, None: the torch code gets them as they are
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"{fn!r}: argument {_describe(path)} is a JAX PRNG key, which torch has no dtype "
            f"for. Fix: convert with rng=True and pass the key as the first argument; random "
            f"ops in the torch code then draw from it."
        )
    return tx.Tensor(leaf, env)


def _to_jax(value: Any, fn: FromTorch, tx: Any, env: Any) -> Any:
    """A leaf of the torch code's result as a JAX value."""
    if isinstance(value, tx.View):
        value = env.v2t_iso(value)
    if isinstance(value, tx.Tensor):
        return torchax_compat.value_of(current(value))  # a view, as its root now holds it
    if isinstance(value, torch.Tensor):
        raise UnsupportedTorchOperation(
            f"{fn!r} returned a {value.device.type} torch tensor of shape {tuple(value.shape)} "
            f"that it did not compute from its arguments (a tensor captured from outside). "
            f"Fix: return values computed from the arguments, or create the tensor inside "
            f"the function."
        )
    return value


def _as_key(key: Any, fn: FromTorch) -> jax.Array:
    """A typed JAX key from a key, raw key data (uint32 / int32 [2]) or an integer seed."""
    if isinstance(key, torch.Tensor):
        raise TypeError(
            f"{fn!r}: the key is a torch tensor; the converted function is a JAX function. "
            f"Fix: call it through bridge_mr (map_reduce / map_fn), which hands it JAX arrays."
        )
    array = jnp.asarray(key) if isinstance(key, int | np.ndarray | np.generic) else key
    if isinstance(array, jax.Array):
        if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
            return array
        if array.dtype in (jnp.uint32, jnp.int32) and array.shape == (2,):
            return jax.random.wrap_key_data(jax.lax.bitcast_convert_type(array, jnp.uint32))
        if jnp.issubdtype(array.dtype, jnp.integer) and array.shape == ():
            return jax.random.key(array)
    shape = getattr(key, "shape", None)
    dtype = getattr(key, "dtype", type(key).__name__)
    raise TypeError(
        f"{fn!r}: expected a JAX key as the first argument (jax.random.key(seed), raw key data "
        f"of dtype uint32 or int32 and shape (2,) such as a row of bridge_mr.client_keys(...), "
        f"or an integer seed), got {dtype} of shape {shape}."
    )


def from_torch(
    torch_fn: Callable[..., Any],
    *,
    mutable: int | Sequence[int] = (),
    rng: bool = False,
) -> Callable[..., Any]:
    """Turns a function written in torch into a JAX function: pytrees of arrays in and out.

    The torch code runs as JAX operations (through torchax), so the result composes with
    everything a JAX function composes with: `map_reduce`, `map_fn`, `torch_function`,
    `jax.grad`, `jax.vmap`, `lax.scan`, `jax.jit`, sharding over clients. Each array argument
    reaches the torch code as a tensor of the same shape and dtype (with JAX's x64 mode off,
    integers are 32-bit); numbers and other leaves arrive as they are. Everything the torch
    code computes with must come in through its arguments or be created inside it: for a
    module, pass its parameters and buffers and call `torch.func.functional_call`.

    Args:
      torch_fn: the torch function, e.g. a client loss `(params, batch) -> loss`.
      mutable: positional arguments (an index, or several) the torch code may write in place
        (a BatchNorm's running statistics in training mode). The converted function then
        returns `(result, new_value)` for one index, `(result, (new_values...))` for several.
        A write to any other argument is an error, since it would be lost.
      rng: whether the torch code draws random numbers (dropout, `torch.randn`). The converted
        function then takes a key as its first argument (`jax.random.key(seed)`, raw key data
        such as a row of `client_keys`, or an integer seed); each random op draws from a split
        of it. `torch.manual_seed` does not reach inside.

    Returns:
      The JAX function: `fn(*args, **kwargs)`, or `fn(key, *args, **kwargs)` with `rng=True`.
      Convert once and reuse the result: like a function given to `jax.jit`, it reads the
      modules its torch code uses (train / eval mode included) when it is traced, so after
      `model.eval()` convert again (or call `bridge_mr.clear_caches()`).

    Raises:
      TypeError: `torch_fn` is not callable, or `mutable` is not an index or a sequence of
        distinct non-negative indices.
      ImportError: (on first call) torchax, the pinned version, is not installed.
      UnsupportedTorchOperation: (while tracing) an op has no JAX lowering, the code mixes a
        tensor it did not receive with its traced values, draws random numbers without a key,
        or writes in place to an argument that is not mutable; the message names the op and
        the source line.

    Example:
      >>> model = torch.nn.Linear(3, 2)
      >>> def classifier_loss(params, batch):  # torch code
      ...     logits = torch.func.functional_call(model, params, (batch["x"],))
      ...     return torch.nn.functional.cross_entropy(logits, batch["y"])
      >>> labelled = {"x": batch["x"], "y": torch.arange(32).reshape(8, 4) % 2}  # 8 clients
      >>> loss = bridge_mr.map_reduce(
      ...     bridge_mr.from_torch(classifier_loss), dict(model.named_parameters()), labelled
      ... )
      >>> loss.backward()
      >>> model.weight.grad.shape
      torch.Size([2, 3])

      The converted function is a JAX function of JAX arrays:

      >>> bridge_mr.from_torch(torch.sin)(jnp.zeros(2))
      Array([0., 0.], dtype=float32)
    """
    if not callable(torch_fn):
        raise TypeError(
            f"from_torch: expected torch_fn to be a callable (a function of torch tensors), got "
            f"{type(torch_fn).__name__}."
        )
    one = isinstance(mutable, int) and not isinstance(mutable, bool)
    indices: Any = (mutable,) if isinstance(mutable, int) else mutable
    if (
        isinstance(indices, str | bytes)
        or not isinstance(indices, Sequence)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices)
        or len(set(indices)) != len(indices)
    ):
        raise TypeError(
            f"from_torch: expected mutable to be a non-negative positional-argument index or a "
            f"sequence of distinct ones, got {mutable!r}. Fix: e.g. mutable=0 for the first "
            f"argument."
        )
    if not isinstance(rng, bool):
        raise TypeError(f"from_torch: expected rng to be True or False, got {rng!r}.")
    spec = FromTorch(torch_fn, tuple(indices), one, rng)

    # A plain function, so bridge_mr keys it as it keys any function (docs/strategies.md, "When a
    # call traces again"): the same object reuses its traces; a new conversion of code that reads a
    # module (its train / eval mode, its attributes) is traced again, as jax.jit would.
    def converted(*args: Any, **kwargs: Any) -> Any:
        return spec(*args, **kwargs)

    converted.__name__ = converted.__qualname__ = repr(spec)
    converted.__doc__ = getattr(torch_fn, "__doc__", None)
    return converted


def client_keys(seed: int, step: int, num_clients: int) -> torch.Tensor:
    """Raw JAX keys, one per client, for a step: different per client and step, reproducible.

    Row `c` is the raw key data (uint32) of `fold_in(fold_in(jax.random.key(seed), step), c)`.
    Pass the tensor in the client data of `map_reduce`: row `c` reaches client `c` as a raw JAX
    key, which a converted function (`from_torch(..., rng=True)`) takes as its key and
    `jax.random` functions (`fold_in`, `split`) take as they are.

    Args:
      seed: the experiment's seed, 0 <= seed < 2**31.
      step: the training step (or round), 0 <= step < 2**31.
      num_clients: how many clients, >= 1.

    Returns:
      A torch.uint32 CPU tensor of shape [num_clients, 2].

    Raises:
      TypeError: an argument is not an int.
      ValueError: an argument is out of range.

    Example:
      >>> keys = bridge_mr.client_keys(seed=0, step=3, num_clients=8)
      >>> keys.shape, keys.dtype
      (torch.Size([8, 2]), torch.uint32)
      >>> def dropout_loss(params, batch):  # torch code that draws random numbers
      ...     x = torch.nn.functional.dropout(batch["x"], p=0.5)
      ...     return torch.mean((x @ params["w"] + params["b"] - batch["y"]) ** 2)
      >>> dropout = bridge_mr.from_torch(dropout_loss, rng=True)  # takes a key first
      >>> loss = bridge_mr.map_reduce(  # row c of keys reaches client c
      ...     lambda params, batch: dropout(batch["key"], params, batch),
      ...     params, {**batch, "key": keys},
      ...     strategy="vmap",  # no one-time measurement of the strategies, as "auto" makes
      ... )
      >>> loss  # zero params: the dropout does not change the loss
      tensor(1., grad_fn=<...>)
    """
    for name, value, low in (("seed", seed, 0), ("step", step, 0), ("num_clients", num_clients, 1)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"client_keys: expected {name} to be an int, got {value!r}.")
        if not low <= value < 2**31:
            raise ValueError(f"client_keys: expected {low} <= {name} < 2**31, got {value}.")
    data = np.asarray(_client_key_data(seed, step, num_clients))
    return torch.from_numpy(data.copy())


@functools.partial(jax.jit, static_argnums=2)
def _client_key_data(seed: jax.Array, step: jax.Array, num_clients: int) -> jax.Array:
    base = jax.random.fold_in(jax.random.key(seed), step)
    keys = jax.vmap(lambda c: jax.random.fold_in(base, c))(jnp.arange(num_clients))
    return jax.random.key_data(keys)
