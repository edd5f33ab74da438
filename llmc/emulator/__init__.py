"""llmc/emulator/: the emulated CUDA device (device memory as host memory) and its vendor libraries."""
