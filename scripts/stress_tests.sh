#!/usr/bin/env bash
# Runs the timing- and process-heavy tests again with busy processes beside them (one per core
# by default, TPUSYNC_STRESS_LOOPS to change), so that a test that holds only on an idle
# machine fails CI instead of a user's run. Needs the environments scripts/test.sh made.
# Usage: bash scripts/stress_tests.sh [pytest options]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="${TPUSYNC_VENV:-$repo/.venv}"
loops="${TPUSYNC_STRESS_LOOPS:-$(nproc)}"
main_tests=(
    tests/cluster/test_cluster_faults.py tests/cluster/test_cluster_tls.py tests/cluster/test_preauth.py
    tests/memory/test_fork.py tests/tiers/test_crash.py tests/weights/test_weights_processes.py
    tests/cluster/test_server_loops.py tests/cluster/test_peer_isolation.py
    tests/weights/test_weights_fanout_netns.py
)
# the vLLM connector's tests of lookup deadlines and background loads (its engine tests take
# minutes each under load: CI's 30 minutes do not hold them a second time)
vllm_tests=(tests/vllm/test_lookup_service.py tests/vllm/test_worker_steps.py)
pids=()
stop_loops() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop_loops EXIT
for _ in $(seq "$loops"); do
    bash -c 'while :; do :; done' &
    pids+=($!)
done
echo "tpusync: the heavy tests again beside $loops busy processes (pids ${pids[*]})"
status=0
start=$(date +%s)
"$venv/bin/python" -m pytest "$@" --basetemp="$(mktemp -d -t tpusync-stress-XXXXXX)" \
    "${main_tests[@]}" || status=1
echo "tpusync: main heavy tests under load: $([[ $status == 0 ]] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s"
vllm_venv="${TPUSYNC_VLLM_VENV:-$repo/.venv-vllm}"
if [[ -x "$vllm_venv/bin/python" ]]; then
    start=$(date +%s)
    caches="$(mktemp -d -t tpusync-stress-vllm-XXXXXX)"
    mkdir -p "$caches/rpc"
    vllm_status=0
    TORCHINDUCTOR_CACHE_DIR="$caches/inductor" VLLM_CACHE_ROOT="$caches/vllm" \
        TRITON_CACHE_DIR="$caches/triton" VLLM_RPC_BASE_PATH="$caches/rpc" \
        "$vllm_venv/bin/python" -m pytest "$@" --basetemp="$caches/pytest" "${vllm_tests[@]}" \
        || vllm_status=1
    rm -rf "$caches"
    echo "tpusync: vLLM heavy tests under load: $([[ $vllm_status == 0 ]] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s"
    [[ $vllm_status == 0 ]] || status=1
fi
exit "$status"
