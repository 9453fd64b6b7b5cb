# Sourced by scripts/test.sh: runs the test suites, each whatever the others did (the engine
# suites beside the main one, see below), while the engine environments are made in the
# background, then prints one line per suite and returns non-zero if any failed. The caller
# defines what each step does:
#   make_env NAME            makes engine environment NAME (vllm, sglang); runs in a subshell
#                            with errexit, its output in $logs/NAME-env.log
#   suite_main ARGS...       the main suite (options and test paths)
#   suite_vllm OPTIONS...    the suites of the engines (options only)
#   suite_sglang OPTIONS...
# and sets $logs, the folder this run's logs stay in. While the environments are made, $env_job
# is the pid of the job making them (for the caller's EXIT trap). tests/project/test_scripts.py runs
# this with fake steps.
#
# TPUSYNC_SUITES (default "main vllm sglang") names the suites to run; the others are reported
# as skipped, and an environment no selected suite needs is not made.
#
# The engine suites run beside the main one, each as soon as its environment is made, their
# output in $logs/NAME-suite.log (printed whole when the main suite is done): each suite keeps
# about one core busy, so on 2 cores the three take little more than the longest alone.
# TPUSYNC_SIDE_BY_SIDE=0 runs them one after the other, after the main suite, their output
# straight to the terminal.

SUITES=(main vllm sglang)

# whether word $1 is among the rest
_suites_has() {
    local word="$1" item
    shift
    for item in "$@"; do [[ "$item" == "$word" ]] && return 0; done
    return 1
}

# pytest's exit code 5 (no test collected) is a skip where the options chose the tests
# (-k, -m, --deselect); without a selection an empty suite is a failure, e.g. a conftest that
# ignored the suite because its engine is missing.
_suites_status() {
    local code="$1" option
    shift
    if [[ "$code" == 0 ]]; then
        echo passed
        return
    fi
    if [[ "$code" == 5 ]]; then
        for option in "$@"; do
            if [[ "$option" == -k* || "$option" == -m* || "$option" == --deselect* ]]; then
                echo skipped
                return
            fi
        done
    fi
    echo failed
}

# runs suite NAME with OPTIONS..., its output in $logs/NAME-suite.log; writes "EXIT SECONDS" to
# $logs/NAME-suite.status
_suites_run_logged() {
    local name="$1" start code
    shift
    start=$(date +%s)
    "suite_$name" "$@" >"$logs/$name-suite.log" 2>&1 </dev/null
    code=$?
    echo "$code $(($(date +%s) - start))" >"$logs/$name-suite.status"
}

run_suites() {
    set +e  # from here on a failure is recorded, not fatal: every suite runs
    local selected=(${TPUSYNC_SUITES:-${SUITES[*]}})
    local name arg
    for name in "${selected[@]}"; do
        if ! _suites_has "$name" "${SUITES[@]}"; then
            echo "tpusync: TPUSYNC_SUITES: unknown suite '$name' (choose from ${SUITES[*]})" >&2
            return 2
        fi
    done
    # Options go to every suite; test paths (an existing file or folder, with or without a
    # ::node id) only to the main one.
    local options=()
    for arg in "$@"; do
        [[ -e "${arg%%::*}" ]] || options+=("$arg")
    done
    mkdir -p "$logs"
    declare -A status=() seconds=() note=()
    local engines=()
    env_job=""
    for name in vllm sglang; do
        _suites_has "$name" "${selected[@]}" && engines+=("$name")
    done
    local side_by_side=0
    if _suites_has main "${selected[@]}" && ((${#engines[@]})) \
        && [[ "${TPUSYNC_SIDE_BY_SIDE:-1}" != 0 ]]; then
        side_by_side=1
    fi
    if ((${#engines[@]})); then
        if ((side_by_side)); then
            echo "tpusync: making the environments of ${engines[*]} in the background, then" \
                "running their suites there beside the main one (logs: $logs)"
        else
            echo "tpusync: making the environments of ${engines[*]} in the background (logs: $logs)"
        fi
        # the environments one after the other, each in its own subshell (errexit holds there:
        # an asynchronous command is not one whose status is tested), each writing its exit
        # code beside its log; side by side, a suite starts once its environment is made and
        # the one before it ended (the next environment is made meanwhile)
        (
            suite_job=""
            for name in "${engines[@]}"; do
                (set -euo pipefail; make_env "$name") >"$logs/$name-env.log" 2>&1 &
                wait $! && echo 0 >"$logs/$name-env.status" || echo $? >"$logs/$name-env.status"
                if ((side_by_side)) && [[ "$(cat "$logs/$name-env.status")" == 0 ]]; then
                    [[ -z "$suite_job" ]] || wait "$suite_job"
                    (
                        echo "tpusync: the $name suite started beside the main one" \
                            "($logs/$name-suite.log)"
                        _suites_run_logged "$name" "${options[@]}"
                        read -r code took <"$logs/$name-suite.status"
                        echo "tpusync: the $name suite ended (exit $code) after $took s"
                    ) &
                    suite_job=$!
                fi
            done
            [[ -z "$suite_job" ]] || wait "$suite_job"
        ) &
        env_job=$!
    fi
    local start code
    if _suites_has main "${selected[@]}"; then
        start=$(date +%s)
        suite_main "$@"
        code=$?
        seconds[main]=$(($(date +%s) - start))
        status[main]=$(_suites_status "$code" "$@")
        [[ "$code" == 0 ]] || note[main]="exit $code"
    fi
    if [[ -n "$env_job" ]]; then
        start=$(date +%s)
        wait "$env_job"
        env_job=""
        if ((side_by_side)); then
            echo "tpusync: waited $(($(date +%s) - start)) s for the engine suites"
        else
            echo "tpusync: waited $(($(date +%s) - start)) s for the engine environments"
        fi
    fi
    for name in vllm sglang; do
        _suites_has "$name" "${selected[@]}" || continue
        if [[ "$(cat "$logs/$name-env.status" 2>/dev/null)" != 0 ]]; then
            tail -n 40 "$logs/$name-env.log" >&2
            echo "tpusync: making the $name environment failed: $logs/$name-env.log" >&2
            status[$name]=failed seconds[$name]=0
            note[$name]="its environment was not made: $logs/$name-env.log"
            continue
        fi
        if ((side_by_side)); then
            echo
            echo "tpusync: the $name suite's output ($logs/$name-suite.log):"
            cat "$logs/$name-suite.log"
            if ! read -r code seconds[$name] <"$logs/$name-suite.status" 2>/dev/null; then
                code=1 seconds[$name]=0  # stopped before it could say (killed)
                echo "tpusync: the $name suite left no status: $logs/$name-suite.log" >&2
            fi
        else
            start=$(date +%s)
            "suite_$name" "${options[@]}"
            code=$?
            seconds[$name]=$(($(date +%s) - start))
        fi
        status[$name]=$(_suites_status "$code" "${options[@]}")
        [[ "$code" == 0 ]] || note[$name]="exit $code"
    done
    local failed=0
    echo
    echo "tpusync: suites (logs: $logs)"
    for name in "${SUITES[@]}"; do
        if ! _suites_has "$name" "${selected[@]}"; then
            status[$name]=skipped seconds[$name]=0 note[$name]="not in TPUSYNC_SUITES"
        fi
        [[ "${status[$name]}" == failed ]] && failed=$((failed + 1))
        printf '  %-7s %-8s %6d s%s\n' "$name" "${status[$name]}" "${seconds[$name]}" \
            "${note[$name]:+  (${note[$name]})}"
    done
    if ((failed)); then
        echo "tpusync: $failed of ${#SUITES[@]} suites failed"
        return 1
    fi
    echo "tpusync: no suite failed"
    return 0
}
