#!/usr/bin/env bash
# Makes the environments of the benchmark peers that cannot share tpusync's:
#   .venv-tpu-sync  Google TPU Sync's wheel (Python 3.12, jax 0.11 on its CPU backend)
#   .venv-mooncake  Mooncake's transfer engine (its non-CUDA wheel, Python 3.11)
# `tpusync bench` finds them here (or under --peers-dir) and lists a missing one as skipped.
#   bash benchmarks/peers/setup.sh [tpu-sync] [mooncake]      (default: both)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TPU_SYNC_WHEEL="tpu-sync-jax==0.0.1rc20261023185136"
JAX="jax==0.11.2"
JAXLIB="jaxlib==0.11.2"
MOONCAKE="mooncake-transfer-engine-non-cuda==0.3.13.post1"

source "$here/../../scripts/_engine_envs.sh"  # find_python

make_venv() {  # name, python; a half-made one is removed first
  rm -rf "$here/$1"
  "$2" -m venv "$here/$1"
  "$here/$1/bin/pip" install --quiet --upgrade pip
}

setup_tpu_sync() {
  make_venv .venv-tpu-sync "$(find_python 3.12)"
  # The wheel asks for libtpu and tpu-info, which the CPU backend does not use: hence --no-deps
  # for it, with the dependencies it imports installed by name.
  "$here/.venv-tpu-sync/bin/pip" install --quiet "$JAX" "$JAXLIB" numpy absl-py \
    "protobuf>=6.33.5" requests
  "$here/.venv-tpu-sync/bin/pip" install --quiet --no-deps --pre "$TPU_SYNC_WHEEL"
  "$here/.venv-tpu-sync/bin/python" -c \
    "import tpu_sync.api.jax.kv_cache_manager, jax; print('tpu-sync: jax', jax.__version__)"
}

setup_mooncake() {
  make_venv .venv-mooncake "$(find_python 3.11)"
  "$here/.venv-mooncake/bin/pip" install --quiet numpy "$MOONCAKE"
  "$here/.venv-mooncake/bin/python" -c "import mooncake.engine; print('mooncake: ok')"
}

peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(tpu-sync mooncake)
for peer in "${peers[@]}"; do
  case "$peer" in
    tpu-sync) setup_tpu_sync ;;
    mooncake) setup_mooncake ;;
    *) echo "setup.sh: unknown peer '$peer' (expected tpu-sync or mooncake)" >&2; exit 2 ;;
  esac
done
