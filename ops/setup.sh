#!/usr/bin/env bash
# Installs what building and testing Lazarus needs, skipping whatever is already there.
# Usage: ops/setup.sh [build|test|interop]
#   build:   system packages only
#   test:    also Slurm and munge (for the local cluster), the S3 test server, and Python's
#            safetensors for the interop tests
#   interop: also torch and transformers, in the virtual environment .venv-interop (several
#            GB), for the transformers logits comparison and the PyTorch benchmark baseline
set -euo pipefail
what="${1:-test}"
export PATH="$HOME/.cargo/bin:$PATH"

sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"

# Installs the Debian packages given that are not installed yet.
apt_need() {
  local need=() package options=()
  if [ "${1:-}" = "--no-recommends" ]; then
    options+=(--no-install-recommends)
    shift
  fi
  for package in "$@"; do
    dpkg -s "$package" >/dev/null 2>&1 || need+=("$package")
  done
  [ "${#need[@]}" -gt 0 ] || return 0
  echo "setup: installing ${need[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${options[@]}" "${need[@]}" >/dev/null
}

apt_need libclang-dev mpich libmpich-dev pkg-config
[ "$what" = "build" ] && exit 0

# The local Slurm cluster the tests start (ops/slurm/local-cluster.sh).
apt_need slurm-wlm munge
# promtool, which checks and unit-tests the alert rules (the server is not started).
apt_need --no-recommends prometheus

if ! s3s-fs --version 2>/dev/null | grep -q "0.14.1"; then
  echo "setup: installing the S3 test server (s3s-fs 0.14.1)"
  cargo install s3s-fs@0.14.1 --locked --features binary --quiet
fi

if ! python3 -c "import safetensors.numpy, numpy" >/dev/null 2>&1; then
  echo "setup: installing Python's safetensors and numpy for the interop tests"
  command -v python3 >/dev/null || $sudo_cmd apt-get install -y -qq python3 python3-pip >/dev/null || true
  python3 -m pip install --quiet --disable-pip-version-check safetensors numpy 2>/dev/null \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages safetensors numpy \
    || echo "setup: could not install them; the Python interop test will say it skipped"
fi

[ "$what" = "interop" ] || exit 0
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv-interop"
if ! "$venv/bin/python" -c "import torch, transformers, safetensors" >/dev/null 2>&1; then
  echo "setup: installing torch and transformers into .venv-interop (several GB)"
  python3 -m venv "$venv" 2>/dev/null || {
    $sudo_cmd apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  }
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch transformers safetensors numpy
fi
echo "setup: interop Python is .venv-interop/bin/python (the tests and benchmarks find it there)"
