#!/usr/bin/env bash
# Quick start 2: set up ./.venv if needed and run the whole test suite against the installed
# package. Also installs the real PJRT plugins (libtpu, CUDA) into ./.plugins for the tests that
# load them without hardware; set TPUSYNC_SKIP_PLUGINS=1 to skip that download (those tests then
# skip, unless TPUSYNC_REQUIRE_PLUGINS=1).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" "test"
if [[ "${TPUSYNC_SKIP_PLUGINS:-0}" != 1 ]]; then
    PYTHON="$venv/bin/python" bash "$repo/scripts/install_pjrt_plugins.sh"
fi
exec python -m pytest "$@"
