#!/usr/bin/env bash
# The device check (`make device-check`): on a machine with an NVIDIA GPU, within about 10
# minutes,
#   1. llama.cpp from the sources llama-cpp-python vendors, built once with CUDA for this
#      GPU's compute capability: the shared library edge-agent loads (LLAMA_CPP_LIB_PATH),
#      llama-server and llama-bench;
#   2. the GPU tests (`-m gpu`): every layer offloaded and reported as VRAM, NVML's
#      telemetry, the CPU fallback with no layer offloaded, on that build;
#   3. the client-side bench's repeats against the CUDA llama-server (2 rounds).
# Its figures and logs go to $OUT (default: ./device-check). On a machine without an
# NVIDIA GPU it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/device-check}"
mkdir -p "$out"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "device check: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing to check"
    exit 0
fi
export PATH="$PATH:/usr/local/cuda/bin"
if ! command -v nvcc >/dev/null 2>&1; then
    echo "device check: an NVIDIA GPU but no CUDA toolkit (nvcc) to build llama.cpp with" >&2
    exit 1
fi
started=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - started )) s)"; }
nvidia-smi | tee "$out/nvidia-smi.txt"
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
jobs=$(nproc)

step "the project's environment"
export CMAKE_BUILD_PARALLEL_LEVEL="$jobs"
make .venv/.test-deps .venv/.bench-deps >"$out/setup.log" 2>&1
version=$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')

step "llama.cpp $version with CUDA for compute capability $cc"
src="$PWD/.device-build/llama_cpp_python-$version"
if [ ! -d "$src" ]; then
    mkdir -p .device-build
    .venv/bin/pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$version" -d .device-build
    tar -xzf ".device-build/llama_cpp_python-$version.tar.gz" -C .device-build
fi
cmake -S "$src/vendor/llama.cpp" -B "$src/build-cuda" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$cc" \
    -DBUILD_SHARED_LIBS=ON >"$out/cmake.log" 2>&1
cmake --build "$src/build-cuda" -j "$jobs" --target llama llama-server llama-bench \
    >"$out/build.log" 2>&1
bin="$src/build-cuda/bin"
export LLAMA_CPP_LIB_PATH="$bin"
.venv/bin/python -c 'from edge_agent.engine.runtime.llama import gpu_offload_supported, system_info
assert gpu_offload_supported(), "the CUDA build offers no GPU offload"
print(system_info())' | tee "$out/system-info.txt"

step "the GPU tests"
.venv/bin/pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py tests/test_hardware.py \
    2>&1 | tee "$out/gpu-tests.txt"

step "llama-bench (the ceiling) and the client-side repeats against the CUDA llama-server"
state="$PWD/.device-build/state"
mkdir -p "$state"
EDGE_AGENT_STATE_DIR="$state" timeout 420 .venv/bin/edge-agent bench llama-server \
    "$bin/llama-server" --repeats --rounds 2 --json \
    >"$out/bench.json" 2> >(tee "$out/bench.txt" >&2)
step "done"
