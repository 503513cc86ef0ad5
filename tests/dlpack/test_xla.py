"""torch-xla tensors are refused by the DLPack path with an error naming the leaf."""

from __future__ import annotations

import os
import textwrap

import pytest
from helpers.child import run_python

# In a child process: an XLA tensor made here would fix torch-xla's runtime mode (SPMD or not)
# for the rest of the session, before the torch-xla tests get to choose it.
_CHILD = textwrap.dedent(
    """
    import torch, torch_xla
    from bridge_mr import dlpack

    tensor = torch.ones(3, device=torch_xla.device())
    try:
        dlpack.to_jax({"params": [torch.ones(1), tensor]})
    except TypeError as error:
        print(error)
    else:
        raise SystemExit("no TypeError")
    """
)


@pytest.mark.xla
def test_torch_xla_tensor_is_refused_with_the_leaf_path() -> None:
    env = {"PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    stdout = run_python(["-c", _CHILD], env=env, timeout=300)
    message = stdout.strip().splitlines()[-1]
    assert message.startswith("tree['params'][1]: expected a dense (strided) CPU or CUDA")
    assert "got a torch-xla tensor" in message
    assert "Fix:" in message
