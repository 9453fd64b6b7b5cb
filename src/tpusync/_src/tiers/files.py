"""Files kept by the layers above the tiers (the KV store's session manifests, its sessions
directory, the deployment secret's file): opened without trusting the path (no symlink
followed, no wait on a FIFO, the type, owner and mode checked on the descriptor) and written
atomically (a temporary file, fsync, rename). The public face of the tiers' own file helpers
(``tiers/_files.py``, ``tiers/_file_writes.py``), so that no other package imports them by
their private names."""

from __future__ import annotations

from tpusync._src.tiers._file_writes import TEMP_MARK, file_error, write_file_atomically
from tpusync._src.tiers._files import (
    DIRECTORY_MODE,
    FILE_MODE,
    check_descriptor,
    check_directory,
    check_owner,
    check_shm_dir,
    make_directory,
    open_file,
    read_private_file,
)

__all__ = [
    "DIRECTORY_MODE",
    "FILE_MODE",
    "TEMP_MARK",
    "check_descriptor",
    "check_directory",
    "check_owner",
    "check_shm_dir",
    "file_error",
    "make_directory",
    "open_file",
    "read_private_file",
    "write_file_atomically",
]
