// Emulated CUDA runtime for the SIMT emulation of the tests: the device builtins (threadIdx,
// blockIdx, blockDim, gridDim, __syncthreads, __shfl_down_sync) and the kernel launch
// FUSEDOPT_LAUNCH_KERNEL, run by the scheduler of tests/simt/runtime.cpp. See
// docs/cuda_emulation.md.
#pragma once

#include "cuda_runtime_api.h"
#include "simt/runtime.h"

// csrc/cuda/multi_tensor_apply.cuh launches every kernel with this macro (its default is the
// <<<grid, block, 0, stream>>> launch); here the emulator's launcher takes it.
#define FUSEDOPT_LAUNCH_KERNEL(kernel, grid, block, stream, ...) \
  ::simt::launch(#kernel, kernel, grid, block, stream, __VA_ARGS__)
