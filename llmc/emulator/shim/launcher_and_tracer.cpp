/*
llmc/emulator/shim/launcher_and_tracer.cpp: the uninstrumented half of a traced build (build.py's
mode "trace", the memory counters of llmc/emulator/memory.py): the launcher and the tracer that
stands in for ThreadSanitizer's runtime. The kernel's own unit is compiled apart, instrumented.
*/
#include "emulator.cpp"
#include "tracer.cpp"
