"""The device a round runs on, as `auto`'s rules read it: an input of the cost model.

`describe(tensor.device)` reads it once per decision (torch's device properties); a test gives
`auto` another description (an H200's, on a CPU machine) to check the rules a GPU would get.
"""

from __future__ import annotations

import dataclasses
import os

import torch


@dataclasses.dataclass(frozen=True)
class DeviceDescription:
    """What `auto` knows of a device.

    Attributes:
      platform: "cpu", or "gpu" for an accelerator (CUDA).
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
    """The description of a torch device (CPU or CUDA).

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
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceDescription("cpu", "cpu", int(memory))
