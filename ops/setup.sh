#!/usr/bin/env bash
# Installs what building and testing Lazarus needs, skipping whatever is already there.
# Usage: ops/setup.sh [build|test]   (build: system packages only; test: also the S3 test
# server and Python's safetensors for the interop tests)
set -euo pipefail
what="${1:-test}"
export PATH="$HOME/.cargo/bin:$PATH"

sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
need_apt=()
for package in libclang-dev mpich libmpich-dev pkg-config; do
  dpkg -s "$package" >/dev/null 2>&1 || need_apt+=("$package")
done
if [ "${#need_apt[@]}" -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

[ "$what" = "test" ] || exit 0

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
