"""tpusync's native core, one Cython extension per job: ``copy`` (block gather/scatter and the
copy engine), ``checksum`` (CRC-32C, sum64, XXH64, BLAKE2b), ``net`` (socket I/O and the frame
receiver) and ``pjrt`` (the PJRT C API binding). ``tpusync._core`` re-exports them all."""
