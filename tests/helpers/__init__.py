"""Helpers shared by the test suite; `import helpers` imports neither torch, JAX nor bridge_mr.

helpers                 assert_trees_all_close
helpers.precision       precisions(): float64 (x64 leg) and float32 (default leg) params;
                        leaf_errors(), assert_leaves_close(), torch_value_and_grads()
helpers.child           run_python(): a script in a fresh interpreter
helpers.beam            jit_of(), assert_close(), local_sgd(), the CNN: the Beam tests'
helpers.examples        example_module(): an examples/*.py script as a module
helpers.jaxprs          live_shapes(), count_equations()
helpers.jax_precision   float32_and_float64(): JAX dtype and tolerance params (x64 leg too)
helpers.zoo             the small-model zoo (torch only; the benchmarks import it too)
helpers.fuzz            the differential fuzz harness of tests/torch_api/test_fuzz.py
helpers.bench           benchmark(): a module of benchmarks/, for tests/benchmarks/ only
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _to_numpy(leaf: Any) -> np.ndarray:
    if hasattr(leaf, "detach") and hasattr(leaf, "cpu"):  # torch.Tensor, without importing torch
        leaf = leaf.detach().cpu()
        if str(leaf.dtype) == "torch.bfloat16":
            leaf = leaf.float()
        return leaf.numpy()
    array = np.asarray(leaf)
    if array.dtype.name == "bfloat16":
        array = array.astype(np.float32)
    return array


def assert_trees_all_close(
    actual: Any, expected: Any, *, rtol: float = 1e-6, atol: float = 1e-6, check_dtype: bool = False
) -> None:
    """Asserts two pytrees have the same structure and leaf-wise close values (and shapes)."""
    import jax  # Here: the benchmarks import `helpers.zoo`, also where there is no JAX.

    actual_leaves, actual_def = jax.tree.flatten(actual)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert actual_def == expected_def, f"tree structures differ: {actual_def} vs {expected_def}"
    for index, (a, e) in enumerate(zip(actual_leaves, expected_leaves, strict=True)):
        if check_dtype:
            assert str(a.dtype).removeprefix("torch.") == str(e.dtype).removeprefix("torch."), (
                f"leaf {index}: dtype {a.dtype} != {e.dtype}"
            )
        a_np, e_np = _to_numpy(a), _to_numpy(e)
        assert a_np.shape == e_np.shape, f"leaf {index}: shape {a_np.shape} != {e_np.shape}"
        np.testing.assert_allclose(a_np, e_np, rtol=rtol, atol=atol, err_msg=f"leaf {index}")
