"""The device a round runs on, as `auto`'s rules read it: an input of the cost model.

`describe(tensor.device)` reads it once per decision (torch's device properties), or
`describe_program_device` the JAX accelerator a round of CPU tensors runs on; a test gives
`auto` another description (an H200's, on a CPU machine) to check the rules a GPU would get.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class DeviceDescription:
    """What `auto` knows of a device.

    Attributes:
      platform: "cpu", or the accelerator's: "gpu" (CUDA), "tpu" (JAX's), "torch_tpu" (a TPU
        that TorchTPU holds, running the programs JAX exports for it).
      name: the device's name ("cpu", "NVIDIA H200", ...), part of a decision's name on disk.
      memory_bytes: its memory (the host's physical memory for "cpu").

    Example:
      >>> h200 = bridge_mr.auto.DeviceDescription("gpu", "NVIDIA H200", 150_000_000_000)
      >>> h200.accelerator, bridge_mr.auto.describe_device(torch.device("cpu")).accelerator
      (True, False)
    """

    platform: str
    name: str
    memory_bytes: int

    @property
    def accelerator(self) -> bool:
        """Whether it is an accelerator (its rules differ from the CPU's)."""
        return self.platform != "cpu"


def describe(device: torch.device) -> DeviceDescription:
    """The description of a torch device (CPU, CUDA or TorchTPU's "tpu").

    Args:
      device: the round's tensors' device.

    Returns:
      Its `DeviceDescription`.

    Example:
      >>> found = bridge_mr.auto.describe_device(torch.device("cpu"))
      >>> found.platform, found.name, found.memory_bytes > 0
      ('cpu', 'cpu', True)
    """
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return DeviceDescription("gpu", properties.name, int(properties.total_memory))
    if device.type == "tpu":
        return _torch_tpu(device)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceDescription("cpu", "cpu", int(memory))


@functools.cache
def _torch_tpu(device: torch.device) -> DeviceDescription:
    """TorchTPU's description of its "tpu" device (read once: its `get_device_properties` warns,
    once a process, that it is experimental; only that warning is silenced, for that call)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*get_device_properties.* is experimental")
        properties = torch.get_device_module("tpu").get_device_properties(device)
    return DeviceDescription("torch_tpu", properties.name, int(properties.total_memory))


def describe_program_device(device: Any) -> DeviceDescription:
    """The description of the JAX accelerator a round of CPU tensors runs on.

    That is `bridge_mr.dlpack.host_program_device()`: JAX's default device, a TPU say.

    Args:
      device: a JAX device.

    Returns:
      Its `DeviceDescription`: platform, kind, and memory as JAX reports it (0 where unknown).

    Example:
      >>> found = bridge_mr.auto.describe_program_device(jax.devices()[0])
      >>> found.platform == jax.devices()[0].platform
      True
    """
    stats = device.memory_stats() or {}
    return DeviceDescription(device.platform, device.device_kind, int(stats.get("bytes_limit", 0)))
