"""A second SGLang process for tests/sglang: its own host pool and backend (made through
SGLang's factory) over the store config in argv[1] (JSON); loads the pages of the keys in
argv[2] (JSON) and prints one JSON line: the leading pages held, and each loaded page's
bytes in hex."""

from __future__ import annotations

import json
import sys

from tests.sglang.conftest import host_pool, indices, page_bytes, storage_config


def main() -> None:
    extra, keys = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = host_pool("mha", "page_first")
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config("mha", "page_first", extra), pool
    )
    backend.register_mem_pool_host(pool)
    try:
        held = backend.batch_exists(keys)
        pages = list(range(40, 40 + len(keys)))
        got = backend.batch_get_v1(keys, indices(pages, pool.page_size))
        loaded = [page_bytes(pool, p).hex() for p, ok in zip(pages, got, strict=True) if ok]
    finally:
        backend.close()
    print(json.dumps({"held": held, "loaded": loaded}), flush=True)


if __name__ == "__main__":
    main()
