// Emulated CUDA runtime API (error codes, streams, last error) for the SIMT emulation of the
// tests; see simt/defines.h and docs/cuda_emulation.md.
#pragma once

#include "simt/defines.h"

// The codes of the real runtime, with their values.
enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorMisalignedAddress = 716,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotSupported = 801,
};
typedef enum cudaError cudaError_t;

// Launches run synchronously, so every stream (nullptr included) is in order with every other.
typedef struct CUstream_st* cudaStream_t;

// The error of the last launch (a bad configuration, or a fault the emulator detected in a
// kernel), reset to cudaSuccess by cudaGetLastError as by the real runtime.
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
