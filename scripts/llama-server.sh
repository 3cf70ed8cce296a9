#!/bin/bash
# Put a real llama-server on this machine and print its path.
#
#   bash scripts/llama-server.sh          # prints e.g. /root/.cache/corral/llama-server-0.3.36/llama-server
#   bash scripts/llama-server.sh --where  # the path if it is already there (exit 1 if not); never builds
#   bash scripts/llama-server.sh --optional  # as the first, but a machine without cmake or a
#                                            # C++ compiler only gets a note (exit 0)
#
# Builds llama.cpp's server (router mode included) from the llama.cpp that the
# llama-cpp-python sdist vendors, CPU only, Release; only the `llama-server` target. The
# binary is cached under ${CORRAL_CACHE:-~/.cache/corral}, so every later run is instant.
# Needs pip (PyPI), cmake and a C++ compiler; about 6 minutes on 2 cores the first time.
# Set LLAMA_SERVER to use a binary you already have instead.
set -euo pipefail

if [ -n "${LLAMA_SERVER:-}" ]; then
  [ -x "$LLAMA_SERVER" ] || { echo "llama-server.sh: LLAMA_SERVER=$LLAMA_SERVER is not executable" >&2; exit 1; }
  echo "$LLAMA_SERVER"
  exit 0
fi

version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
cache=${CORRAL_CACHE:-$HOME/.cache/corral}
dest=$cache/llama-server-$version
bin=$dest/llama-server
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
if [ "${1:-}" = "--where" ]; then
  exit 1
fi

for tool in cmake c++; do
  if ! command -v "$tool" >/dev/null; then
    echo "llama-server.sh: $tool is needed to build llama-server; the tests that use it will skip" >&2
    [ "${1:-}" = "--optional" ] && exit 0
    exit 1
  fi
done
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "llama-server.sh: building llama-server from llama-cpp-python $version (a few minutes)" >&2
python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src=$work/llama_cpp_python-$version/vendor/llama.cpp
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$dest"
cp "$work/build/bin/llama-server" "$bin.tmp"
mv "$bin.tmp" "$bin"
echo "$bin"
