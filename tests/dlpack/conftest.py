"""Makes this folder's shared test data (`dlpack_cases`) importable from its test modules."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)
