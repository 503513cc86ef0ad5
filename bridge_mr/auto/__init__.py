"""`map_reduce(strategy="auto")`: which strategy a round runs with, chosen once per signature.

The torch `map_reduce` asks `choose` on a first call of a signature; everything `auto` does to
answer lives here, below the torch frontend: the cost model (`cost`: FLOPs, peak bytes and
convolution groups read from a jaxpr), the device's description (`describe_device`: an input
of the rules, CPU or GPU), the pick, the optional timing, and the decisions kept on disk. Its
tuning is public in `bridge_mr.auto.settings`; `map_reduce_choices()` (also
`bridge_mr.map_reduce_choices`) lists what it picked and why. `choose`, `RoundKind` and
`same` are the torch frontend's way in (not in `__all__`, not for users).
"""

from . import settings as settings
from ._choose import choose as choose
from ._choose import forget_choices as forget_choices
from ._choose import map_reduce_choices as map_reduce_choices
from ._cost import Cost as Cost
from ._cost import cost as cost
from ._decisions import DISK_SWITCH as DISK_SWITCH
from ._decisions import directory as directory
from ._decisions import forget_all as forget_all
from ._device import DeviceDescription as DeviceDescription
from ._device import describe as describe_device
from ._device import describe_program_device as describe_program_device
from ._kind import RoundKind as RoundKind
from ._kind import same as same
from ._report import Candidate as Candidate
from ._report import Choice as Choice

__all__ = [
    "DISK_SWITCH",
    "Candidate",
    "Choice",
    "Cost",
    "DeviceDescription",
    "cost",
    "describe_device",
    "describe_program_device",
    "directory",
    "forget_all",
    "forget_choices",
    "map_reduce_choices",
    "settings",
]
