"""The only place bridge_mr touches private names of jax, jaxlib, torch and torch_xla.

Rule: every private entry point (`jax._src`, jaxlib's extension module, `torch._C`,
`torch._functorch`, `torch_xla._internal`, private attributes of their objects) is reached
through one function or constant here, which states the versions it was checked on, and
`tests/compat/test_fast_paths.py` asserts that its fast path is the one taken on the pinned
versions. Each submodule imports only its own library, never bridge_mr, and this package's
`__init__` imports nothing, so importing `bridge_mr._compat.jax` does not import torch.

Entries:

* `bridge_mr._compat.jax`: `trace_context`, `concrete_mesh`, `legacy_mesh`,
  `shardy_partitioner`, `x64_enabled`, `default_device`, `transfer_guard_host_to_device`,
  `backends_generation`, `ArrayImpl`, `DimExpr`, `single_device`, `fresh_handle`, `clear_counter`.
* `bridge_mr._compat.jaxlib`: `EXTENSION_VERSION`, `DL_CPU`, `DL_CUDA`, `capsule_to_array`,
  `array_to_capsule` (raises ImportError on a jaxlib older than 0.10.2).
* `bridge_mr._compat.torch`: `dispatches_to_python`, `forward_ad_active`,
  `graph_break_resumes`, `functorch_transforms_active`, `autograd_apply`,
  `flatten_dense_tensors`, `tensor_from_capsule`.
* `bridge_mr._compat.torch_xla`: `INSTALL_HINT`, `TorchXla`, `import_torch_xla` (imports
  torch_xla on first call only).
* `bridge_mr._compat.torchax`: `import_torchax` (imports torchax on first call only, without
  its process-wide registrations), `device`, `own_every_factory`, `value_of`, `rebind`.
"""
