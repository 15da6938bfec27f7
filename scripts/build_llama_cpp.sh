#!/bin/sh
# Builds llama.cpp's llama-server and llama-quantize, a bench-only peer
# (bench/llama_peer.py), from the llama.cpp sources vendored in the
# llama-cpp-python sdist: PyPI is the only source reachable here, and the
# project publishes no Linux wheel. The build is cached outside the
# repository, one directory per version; a second run only prints its path.
# Usage: scripts/build_llama_cpp.sh [VERSION]   (prints the bin directory)
set -eu
VERSION=${1:-0.3.36}
PYTHON=${PYTHON:-python3}
ROOT=${SLUICEWAY_CACHE:-$HOME/.cache/sluiceway}/llama.cpp-$VERSION
BIN=$ROOT/build/bin
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ]; then
	echo "$BIN"
	exit 0
fi
if ! command -v cmake >/dev/null; then
	if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
		flock /tmp/sluiceway-apt.lock sh -c 'apt-get update && DEBIAN_FRONTEND=noninteractive \
			apt-get -o DPkg::Lock::Timeout=600 install -y cmake' >&2
	else
		echo "cmake is missing (apt-get install cmake)" >&2
		exit 1
	fi
fi
mkdir -p "$ROOT"
SDIST=$ROOT/llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
	"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
		"llama-cpp-python==$VERSION" -d "$ROOT" >&2
fi
SRC=$ROOT/llama_cpp_python-$VERSION/vendor/llama.cpp
[ -d "$SRC" ] || tar xzf "$SDIST" -C "$ROOT"
# Native CPU flags (AVX-512 here), no curl/openssl (the GGUF is local), only
# the two tools: the rest of llama.cpp's tree is an hour on two cores.
cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$ROOT/build" --config Release -j "${JOBS:-2}" --target llama-server llama-quantize >&2
echo "$BIN"
