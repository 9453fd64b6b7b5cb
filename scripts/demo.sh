#!/usr/bin/env bash
# Quick start 1: set up ./.venv if needed and run the tpusync demo (embedded defaults, CPU).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" ""
exec tpusync demo "$@"
