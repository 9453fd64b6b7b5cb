# Prints the fingerprint of the sources a tpusync wheel is built from, in the checkout $1
# (default: this script's): every file under src/ and include/, meson.build and pyproject.toml,
# by content. scripts/_wheel.sh names its wheel directory with it; `tpusync bench` compares it
# with the installed wheel's, so that a benchmark never files old code under a new commit.
set -euo pipefail
checkout="$(cd "${1:-$(dirname "${BASH_SOURCE[0]}")/..}" && pwd)"
cd "$checkout"
find src include meson.build pyproject.toml -type f ! -name '*.so' ! -path '*/__pycache__/*' \
    -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1
