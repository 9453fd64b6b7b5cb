#!/usr/bin/env bash
# Fetches (here, where pip reaches PyPI) the build wheels the GPU machine lacks, for its Python
# 3.12 on x86-64, into .wheelhouse/ (ignored by git; carried by the device tool's run).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --dest .wheelhouse --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 "meson-python>=0.16" "meson>=1.3" ninja "cython>=3.0.10"
ls .wheelhouse
