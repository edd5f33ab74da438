# doc/tensor_cores_demo.gdb: stop thread 9 (lane 9 of warp 0: groupID 2, threadID_in_group 1) of
# matmul_forward_v6 at its first mma (dev/cuda/matmul.cu) and print its fragments before and after;
# see doc/tensor_cores.md, section 7.
#   LLMC_EMULATOR_DEBUG=1 gdb -q -batch -x doc/tensor_cores_demo.gdb --args python doc/tensor_cores_demo.py
set breakpoint pending on
break matmul.cu:338 if threadIdx.x == 9 && ks == 0 && mi == 0 && ni == 0
run
print threadIdx
print/x a[0]
print/f a[0][0] << 16
print/f a[0][0] >> 16 << 16
print/x b[0]
print acc[0][0]
next
print acc[0][0]
delete
continue
