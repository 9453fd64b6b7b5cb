# The checksum module's C-level interface to the other extensions of tpusync._native.

cdef int *shared_path_flag() noexcept nogil
