"""SGLang HiCache storage: tpusync's backend beside SGLang's file backend and the memory limit,
driven by SGLang's cache controller code. A thin script over
:mod:`tpusync._src.bench.sglang_hicache` (``tpusync bench sglang_hicache`` in the SGLang
environment); the command line is the same.

    .venv-sglang/bin/python benchmarks/sglang_hicache.py [--page-sizes 64,128] [--repeats 5]
"""

import importlib.util
import sys

if __name__ == "__main__":
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        sys.exit(
            "sglang_hicache: needs SGLang; run it in the SGLang environment (scripts/test.sh "
            "makes .venv-sglang): .venv-sglang/bin/python benchmarks/sglang_hicache.py"
        )
    from tpusync._src.bench.sglang_hicache import main

    sys.exit(main())
