# Sourced by scripts/_venv.sh: builds the tpusync wheel once per change of its sources, into
# ./.wheelhouse/<fingerprint>/, and sets $wheel to it; every environment installs that one wheel.
# Needs a Python with pip ($1, default python3) and gcc; the build requirements come from PyPI.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
builder="${1:-python3}"
fingerprint="$(bash "$repo/scripts/_fingerprint.sh" "$repo")"
wheel_dir="$repo/.wheelhouse/$fingerprint"
wheel="$(ls "$wheel_dir"/tpusync-*.whl 2>/dev/null | head -1 || true)"
if [[ -z "$wheel" ]]; then
    echo "tpusync: building the wheel (about a minute)"
    rm -rf "$repo/.wheelhouse"
    "$builder" -m pip wheel --quiet --no-deps -w "$wheel_dir" "$repo"
    wheel="$(ls "$wheel_dir"/tpusync-*.whl | head -1)"
fi
