#!/usr/bin/env bash
# Builds llama.cpp's benchmark tools for `eaglet bench` from the llama.cpp that the
# `llama-cpp-python` source package vendors (no model hub or git clone needed), tuned for this CPU.
#
#     bash tools/bench_setup_llama_cpp.sh            # into ~/.cache/eaglet/llama.cpp
#     EAGLET_LLAMA_CPP_DIR=/tmp/llama.cpp bash tools/bench_setup_llama_cpp.sh
#     EAGLET_LLAMA_CPP_SPEC="llama-cpp-python==0.3.36" bash tools/bench_setup_llama_cpp.sh
#
# Also builds llama-greedy-ids (tools/llama_cpp_greedy.cpp), which the bench uses to check a
# conversion's greedy tokens against transformers'. 6-20 minutes on 2 cores; a finished build is
# reused. The GGUF converter (convert_hf_to_gguf.py and its gguf-py) comes from the same source
# tree, so the converter and the binaries always agree on the file format.
set -euo pipefail

ROOT="${EAGLET_LLAMA_CPP_DIR:-$HOME/.cache/eaglet/llama.cpp}"
SPEC="${EAGLET_LLAMA_CPP_SPEC:-llama-cpp-python}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
TARGETS=(llama-bench llama-batched-bench llama-quantize)

mkdir -p "$ROOT"
# The unpacked tree is reused only when it came from the same package spec.
if [ ! -f "$ROOT/src/EAGLET_SOURCE" ] || [ "$(cat "$ROOT/src/EAGLET_SPEC" 2>/dev/null)" != "$SPEC" ]; then
    echo "downloading the $SPEC source package"
    rm -rf "$ROOT/sdist" "$ROOT/src" "$ROOT/build"
    "$PYTHON" -m pip download --no-binary :all: --no-deps -d "$ROOT/sdist" "$SPEC"
    tar -xzf "$ROOT"/sdist/*.tar.gz -C "$ROOT/sdist"
    echo "$SPEC" > "$ROOT"/sdist/*/vendor/llama.cpp/EAGLET_SPEC
    basename "$ROOT"/sdist/*.tar.gz .tar.gz > "$ROOT"/sdist/*/vendor/llama.cpp/EAGLET_SOURCE
    mv "$ROOT"/sdist/*/vendor/llama.cpp "$ROOT/src"
    rm -rf "$ROOT/sdist"
fi
echo "llama.cpp from $(cat "$ROOT/src/EAGLET_SOURCE"), building ${TARGETS[*]} with $JOBS jobs (6-20 min on 2 cores)"
start=$(date +%s)
cmake -S "$ROOT/src" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DBUILD_SHARED_LIBS=OFF >"$ROOT/cmake.log" 2>&1 || { tail -20 "$ROOT/cmake.log"; exit 1; }
cmake --build "$ROOT/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" >"$ROOT/build.log" 2>&1 \
    || { tail -30 "$ROOT/build.log"; exit 1; }
# The bench's token check: greedy ids from prompt ids (tools/llama_cpp_greedy.cpp), linked against
# the static libraries just built.
mapfile -t libs < <(find "$ROOT/build" -name 'libllama.a' -o -name 'libggml*.a')
g++ -O2 -std=c++17 -I "$ROOT/src/include" -I "$ROOT/src/ggml/include" \
    "$(dirname "$0")/llama_cpp_greedy.cpp" -Wl,--start-group "${libs[@]}" -Wl,--end-group \
    -fopenmp -lpthread -ldl -o "$ROOT/build/bin/llama-greedy-ids"
echo "built in $(( $(date +%s) - start )) s: $ROOT/build/bin"
"$ROOT/build/bin/llama-bench" --help >/dev/null
