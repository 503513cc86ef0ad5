"""Zero-copy exchange of tensors between torch and JAX over DLPack.

`to_jax` / `to_torch` convert pytrees; `import_tensors` / `export_arrays` are their flat-list
forms for the torch frontend's hot path, and `jit_arguments` a faster `import_tensors` for the
arguments of a jitted call; `tensor_avals` says what shapes and dtypes tensors cross as;
`count_conversions` reports conversions and copies; `host_program_device` says where programs of
CPU tensors run (JAX's default device: an accelerator where there is one).

Zero copy whenever the layout allows it: a compact (contiguous or permuted-dense), 64-byte
aligned tensor of a dtype both sides share, on the same device. Otherwise exactly one copy,
counted. While JAX's x64 mode is off, int64 / uint64 tensors cross as int32 / uint32 (one
counted copy, after one min / max reduction checks that the values fit: a ValueError names the
tensor and the value otherwise); float64 / complex128 tensors are never downcast silently (an
error, unless `allow_x64_downcast=True`).

Aliasing contract:

* A JAX array imported from a torch tensor is a view of it, valid only while nobody writes to
  the tensor. JAX dispatch is asynchronous: code that runs JAX computations on such views must
  block on their results (`jax.block_until_ready`) before returning control to code that may
  mutate the tensors (in-place ops, `resize_`, optimizer steps).
* A torch tensor exported from a JAX array shares the array's buffer. The torch frontend only
  exports fresh outputs of jitted computations, so the tensors it returns alias no input.
* Deleting either side never invalidates the other: each keeps the shared buffer alive.
"""

from ._avals import tensor_avals as tensor_avals
from ._export import export_arrays as export_arrays
from ._export import to_torch as to_torch
from ._import import import_tensors as import_tensors
from ._import import jit_arguments as jit_arguments
from ._import import to_jax as to_jax
from ._runtime import host_device as host_device
from ._runtime import host_program_device as host_program_device
from ._stats import ConversionStats as ConversionStats
from ._stats import count_conversions as count_conversions

__all__ = [
    "ConversionStats",
    "count_conversions",
    "export_arrays",
    "host_device",
    "host_program_device",
    "import_tensors",
    "jit_arguments",
    "tensor_avals",
    "to_jax",
    "to_torch",
]
