# doc/layernorm_demo.gdb: stop thread 37 (lane 5 of warp 1, so row 1) of layernorm_forward on the
# line of kernels/layernorm.cu that computes rstd; see doc/from_numpy_to_cuda.md, section 6.
#   LLMC_EMULATOR_DEBUG=1 gdb -q -batch -x doc/layernorm_demo.gdb --args python doc/layernorm_demo.py
set breakpoint pending on
break layernorm.cu:87 if threadIdx.x == 37
run
print threadIdx
print lane
print row
print row_mean
print sum_sq
next
print row_rstd
continue
