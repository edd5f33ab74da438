/*
llmc/emulator/shim/cuda_bf16.h: the emulated device's <cuda_bf16.h>, found before CUDA's own by
`-I llmc/emulator/shim`. The bf16 type and its conversions live in cuda_shim.h (force-included
before every kernel file), so this header only has to exist.
*/
#pragma once
#include "cuda_shim.h"
