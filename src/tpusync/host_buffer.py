"""Deprecated spelling (issue 19): this module moved to :mod:`tpusync.memory.host_buffer`.

Kept for one release; every name read here warns with a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from typing import Any

from tpusync.memory import host_buffer as _moved

__all__ = list(_moved.__all__)


def __getattr__(name: str) -> Any:
    value = getattr(_moved, name)  # AttributeError for names that never were here
    warnings.warn(
        f"tpusync.host_buffer is deprecated: import {name} from tpusync.memory.host_buffer "
        "(or tpusync.DevicePool / tpusync.HostBuffer)",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
