"""Tensor exchange between torch and JAX (the "boundary" case, `studies.bench_dlpack`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def dlpack_paths(tensors: list[Any], arrays: list[Any]) -> dict[str, dict[str, Callable[[], Any]]]:
    """Ways to move `tensors` into JAX ("import") and `arrays` into torch ("export").

    "bridge_mr": `bridge_mr.dlpack.import_tensors` / `export_arrays`; "public dlpack":
    `jax.dlpack.from_dlpack(t)` / `torch.from_dlpack(a)`; "numpy copy": a copy through host
    memory onto the other side's device (on CPU `jax.device_put(t.numpy())` would alias the
    buffer, so it is `jnp.asarray`).
    """
    import jax
    import jax.numpy as jnp
    import torch

    from bridge_mr import dlpack

    device = tensors[0].device
    if device.type == "cpu":
        import_copy = lambda: [jnp.asarray(t.numpy()) for t in tensors]
        export_copy = lambda: [torch.from_numpy(np.array(a)) for a in arrays]
    else:
        gpu = jax.devices("gpu")[device.index or 0]
        import_copy = lambda: [jax.device_put(t.cpu().numpy(), gpu) for t in tensors]
        export_copy = lambda: [torch.from_numpy(np.array(a)).to(device) for a in arrays]
    return {
        "import": {
            "bridge_mr": lambda: dlpack.import_tensors(tensors),
            "public dlpack": lambda: [jax.dlpack.from_dlpack(t) for t in tensors],
            "numpy copy": import_copy,
        },
        "export": {
            "bridge_mr": lambda: dlpack.export_arrays(arrays),
            "public dlpack": lambda: [torch.from_dlpack(a) for a in arrays],
            "numpy copy": export_copy,
        },
    }
