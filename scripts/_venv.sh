# Sourced by the quick-start scripts: creates or reuses ./.venv (or $TPUSYNC_VENV) and installs
# tpusync into it with the given extras from the one wheel scripts/_wheel.sh builds (rebuilt only
# when the sources changed). Needs python3 with venv and headers, and gcc; pip fetches the rest
# from PyPI.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="${TPUSYNC_VENV:-$repo/.venv}"
extras="${1:-}"
if [[ ! -x "$venv/bin/python" ]]; then
    echo "tpusync: creating $venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
source "$repo/scripts/_wheel.sh" "$venv/bin/python"
stamp="$venv/.tpusync-installed"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$wheel[$extras]" ]]; then
    echo "tpusync: installing $(basename "$wheel")${extras:+[$extras]} into $venv"
    "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"
    "$venv/bin/python" -m pip install --quiet "$wheel${extras:+[$extras]}"
    echo "$wheel[$extras]" >"$stamp"
fi
export PATH="$venv/bin:$PATH"
