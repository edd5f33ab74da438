/*
doc/transpose.cu: three ways to transpose an N x N float matrix, out[c][r] = inp[r][c], for the
memory counters tutorial (doc/memory_counters.md; doc/memory_counters.py runs them on the emulated
device and counts their memory accesses). Block (32, 32): thread (x, y) of block (bx, by) owns
element (r, c) = (32 by + y, 32 bx + x) of a 32 x 32 tile. N must be a multiple of 32.

- transpose_naive: each thread copies its element straight across. A warp (32 threads of one y,
  x = 0..31) reads 32 consecutive floats of row r (coalesced) but writes 32 floats of column r of
  out, N floats apart: one sector per lane.
- transpose_shared: the warp reads its row of the tile into shared memory, the block waits, then
  the warp writes a row of the transposed tile, read from a column of the shared tile: both global
  accesses coalesced, but the column read puts all 32 lanes in one bank (a 32-way conflict).
- transpose_padded: the same with each shared row padded to 33 floats: lane x of the column read
  reads word 33x + y, in bank (x + y) % 32: 32 different banks, no conflict.
*/
#define TILE 32

extern "C" __global__ void transpose_naive(float* out, const float* inp, int N) {
    const int r = blockIdx.y * TILE + threadIdx.y, c = blockIdx.x * TILE + threadIdx.x;
    out[c * N + r] = inp[r * N + c];
}

extern "C" __global__ void transpose_shared(float* out, const float* inp, int N) {
    __shared__ float tile[TILE][TILE];
    const int x = threadIdx.x, y = threadIdx.y;
    tile[y][x] = inp[(blockIdx.y * TILE + y) * N + blockIdx.x * TILE + x];
    __syncthreads();
    out[(blockIdx.x * TILE + y) * N + blockIdx.y * TILE + x] = tile[x][y];
}

extern "C" __global__ void transpose_padded(float* out, const float* inp, int N) {
    __shared__ float tile[TILE][TILE + 1];
    const int x = threadIdx.x, y = threadIdx.y;
    tile[y][x] = inp[(blockIdx.y * TILE + y) * N + blockIdx.x * TILE + x];
    __syncthreads();
    out[(blockIdx.x * TILE + y) * N + blockIdx.y * TILE + x] = tile[x][y];
}
