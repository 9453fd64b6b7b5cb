"""tpusync's native core, one Cython extension per job: ``copy`` (block gather/scatter and the
copy engine), ``checksum`` (CRC-32C, sum64, XXH64, BLAKE2b), ``net`` (socket I/O and the frame
receiver), ``pjrt`` (the PJRT C API binding), ``fileio``, ``limits`` and ``convert`` (float
conversions of weights as they land); ``core`` holds the memory (page-aligned mappings, slot
pins) and re-exports all of them; ``mac`` tags shared-FS blocks (Poly1305)."""
