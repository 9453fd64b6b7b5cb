#!/usr/bin/env bash
# Installs real PJRT plugins (libtpu, the CUDA 13 plugin) into a private directory, for
# tests/native/test_pjrt_plugins.py. They only need to load: no TPU or GPU is used.
#
# Never into the venv's site-packages: a jax_plugins CUDA plugin on sys.path whose version does
# not match jaxlib breaks JAX's start-up. The tests load each plugin by path, in a child process.
#
# Usage: scripts/install_pjrt_plugins.sh [DIR]   (DIR default: $TPUSYNC_PLUGIN_DIR or <repo>/.plugins)
# Env:   PYTHON (default: python), LIBTPU_VERSION, JAX_CUDA_PJRT_VERSION to change the pins.
# Idempotent: a plugin whose pinned version is already in DIR is skipped.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-${TPUSYNC_PLUGIN_DIR:-$repo/.plugins}}"
PYTHON="${PYTHON:-python}"
# libtpu 0.0.52 reports PJRT C API 0.117; jax-cuda13-pjrt 0.10.2 (matches jax 0.10.2) 0.112.
LIBTPU_VERSION="${LIBTPU_VERSION:-0.0.52}"
JAX_CUDA_PJRT_VERSION="${JAX_CUDA_PJRT_VERSION:-0.10.2}"

install_one() {  # install_one SUBDIR DIST VERSION LIBRARY(relative to SUBDIR)
    local target="$DIR/$1" dist="$2" version="$3" lib="$4"
    local dist_info="$target/${dist//-/_}-$version.dist-info"
    if [[ -d "$dist_info" && -f "$target/$lib" ]]; then
        echo "$dist $version: already in $target"
        return
    fi
    # A different version (or a broken install) is replaced whole: pip --target does not upgrade.
    rm -rf "$target"
    mkdir -p "$target"
    "$PYTHON" -m pip install --quiet --no-deps --no-compile --target "$target" "$dist==$version"
    if [[ ! -f "$target/$lib" ]]; then
        echo "error: $dist $version did not install $target/$lib" >&2
        exit 1
    fi
    echo "$dist $version: installed $target/$lib"
}

install_one libtpu libtpu "$LIBTPU_VERSION" libtpu/libtpu.so
install_one cuda jax-cuda13-pjrt "$JAX_CUDA_PJRT_VERSION" jax_plugins/xla_cuda13/xla_cuda_plugin.so
