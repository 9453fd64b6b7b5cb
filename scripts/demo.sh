#!/usr/bin/env bash
# Quick start 1: set up ./.venv if needed and run the tpusync demo (embedded defaults, CPU).
# The demo extra brings matplotlib, for `--plot ttft.png`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" "demo"
exec tpusync demo "$@"
