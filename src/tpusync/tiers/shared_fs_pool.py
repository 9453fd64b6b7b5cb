"""Deprecated path: the shared-filesystem tier moved to :mod:`tpusync.tiers.shared_fs`
(``tpusync.tiers.SharedFsPool`` is unchanged). This module re-exports it for one release."""

import warnings

from tpusync.tiers.shared_fs.pool import HEADER_BYTES, SharedFsPool

__all__ = ["HEADER_BYTES", "SharedFsPool"]

warnings.warn(
    "tpusync.tiers.shared_fs_pool is deprecated (removed in the next release): use "
    "tpusync.tiers.SharedFsPool, or tpusync.tiers.shared_fs",
    DeprecationWarning,
    stacklevel=2,
)
