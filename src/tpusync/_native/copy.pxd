# The copy module's C-level interface to the other extensions of tpusync._native.
cimport numpy as cnp


# Checks a segment table (uint64, shape (n, 3)) and returns it C-contiguous.
cdef cnp.ndarray segment_table(cnp.ndarray segments)
