#!/usr/bin/env bash
# Build llama.cpp's llama-server, the peer of `python bench.py serve`, from the llama.cpp sources
# that llama-cpp-python's sdist vendors (the same version as the decode benchmark's peer).
# Also builds, from the same tree (beside it in build/bin), llama-quantize, which `bench.py gguf`
# uses to make its test files, and llama-completion, llama.cpp's command-line runner, which
# `bench.py serve` sets beside llama-server as serve_local.py is beside server.py. Bench-only: no
# test needs them. About 10 minutes on 2 cores; a tree configured before builds only what it lacks.
# Prints the llama-server binary's path.
#   scripts/build_llama_server.sh [BUILD_DIR]   (default: ~/.cache/nanoinfer/llama-server)
set -euo pipefail
VERSION=0.3.36
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/nanoinfer/llama-server}
BIN=$DIR/build/bin/llama-server
TOOLS="llama-server llama-quantize llama-completion"
built=1
for t in $TOOLS; do [ -x "$DIR/build/bin/$t" ] || built=0; done
if [ $built = 1 ]; then echo "$BIN"; exit 0; fi
if [ ! -f "$DIR/build/CMakeCache.txt" ]; then   # not configured yet: fetch the sources, configure
  mkdir -p "$DIR"
  PY=${PYTHON:-python3}
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR" >&2
  tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
  SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
  # Portable flags for the CPU features this machine has (GGML_NATIVE=ON dies with "Illegal instruction"
  # on some AMX machines of this pool; AVX512 on a CPU without it would too).
  flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  for f in avx512f:AVX512 avx512_vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if grep -qw "${f%%:*}" /proc/cpuinfo; then flags="$flags -DGGML_${f##*:}=ON"; fi
  done
  cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF $flags >&2
fi
cmake --build "$DIR/build" --target $TOOLS -j "$(nproc)" >&2
echo "$BIN"
