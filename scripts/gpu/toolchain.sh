#!/usr/bin/env bash
# Install, without a system toolkit or a GPU, what candle's CUDA build needs (docs/gpu.md):
# NVIDIA's CUDA 13.0 wheels from PyPI unpacked under $TERN_CUDA_DIR (default
# ~/.cache/tern/cuda), link names for their versioned libraries, and a libcuda stub for the
# link (the real driver is loaded at run time on the GPU machine).
#
# Usage: scripts/gpu/toolchain.sh          then, to build:  . scripts/gpu/toolchain.sh --env
set -euo pipefail
cuda_dir="${TERN_CUDA_DIR:-$HOME/.cache/tern/cuda}"
root="$cuda_dir/nvidia/cu13"

if [[ "${1:-}" == --env ]]; then
  # Sourced: the variables candle's build script and the linker read.
  export CUDA_ROOT="$root" CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  export PATH="$root/bin:$PATH" LIBRARY_PATH="$root/lib:$cuda_dir/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
  return 0 2>/dev/null || exit 0
fi

mkdir -p "$cuda_dir/wheels" "$cuda_dir/stubs"
cd "$cuda_dir/wheels"
if [[ ! -x "$root/bin/nvcc" ]]; then
  echo "toolchain: downloading the CUDA 13.0 wheels into $cuda_dir/wheels" >&2
  pip download --quiet --no-deps -d . "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
    "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-cccl==13.0.*" \
    "nvidia-cublas==13.0.*" "nvidia-curand==10.4.*" "nvidia-cuda-nvrtc==13.0.*"
  for w in *.whl; do python3 -m zipfile -e "$w" "$cuda_dir"; done
  chmod +x "$root"/bin/* "$root"/nvvm/bin/* 2>/dev/null || true
fi

# libfoo.so.13 -> libfoo.so: the linker looks for the bare names.
for lib in "$root"/lib/lib*.so.*; do
  bare="${lib%%.so.*}.so"
  [[ -e "$bare" ]] || ln -s "$(basename "$lib")" "$bare"
done

# Every driver function cudarc names, as an empty symbol: enough to link, never called here.
if [[ ! -e "$cuda_dir/stubs/libcuda.so" ]]; then
  sys="$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs | tail -n 1)"
  grep -ohE '^\s+fn cu[A-Za-z0-9_]+\(' "$sys" |
    sed -E 's/^\s+fn (cu[A-Za-z0-9_]+)\(/void \1(void) {}/' | sort -u >"$cuda_dir/stubs/stub.c"
  gcc -shared -fPIC -o "$cuda_dir/stubs/libcuda.so" "$cuda_dir/stubs/stub.c" -Wl,-soname,libcuda.so.1
  ln -sf libcuda.so "$cuda_dir/stubs/libcuda.so.1"
fi
echo "toolchain: ready in $root; build with: . scripts/gpu/toolchain.sh --env" >&2
