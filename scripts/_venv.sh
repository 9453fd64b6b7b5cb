# Sourced by the quick-start scripts: creates or reuses ./.venv (or $TPUSYNC_VENV) and installs
# tpusync into it with the given extras, rebuilding only when the sources changed since the last
# install. Needs python3 with venv and headers, and gcc; pip fetches the rest from PyPI.
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
# A fingerprint of everything that goes into the wheel; reinstall only when it changes.
stamp="$venv/.tpusync-installed"
fingerprint="$(
    { echo "extras=$extras"; find src include meson.build pyproject.toml -type f \
        ! -name '*.so' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha1sum; } \
        | sha1sum | cut -d' ' -f1
)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$fingerprint" ]]; then
    echo "tpusync: building and installing tpusync${extras:+[$extras]} into $venv (about a minute)"
    "$venv/bin/python" -m pip install --quiet ".${extras:+[$extras]}"
    echo "$fingerprint" >"$stamp"
fi
export PATH="$venv/bin:$PATH"
