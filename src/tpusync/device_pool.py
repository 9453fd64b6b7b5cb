"""Deprecated spelling (issue 19): this module moved to :mod:`tpusync.memory.device_pool`.

Kept for one release; every name read here warns with a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from typing import Any

from tpusync.memory import device_pool as _moved

__all__ = list(_moved.__all__)


def __getattr__(name: str) -> Any:
    value = getattr(_moved, name)  # AttributeError for names that never were here
    warnings.warn(
        f"tpusync.device_pool is deprecated: import {name} from tpusync.memory.device_pool "
        "(or tpusync.DevicePool / tpusync.HostBuffer)",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
