/*
llmc/emulator/shim/stack_pool.cpp: the fiber stacks of the emulated device, in one pool per process
that every kernel library's workers share. llmc/emulator/build.py compiles it into its own small
library and loads it once per process (RTLD_GLOBAL) before any kernel library of the fiber modes;
shim/emulator.cpp takes a stack from here when a CUDA thread first waits, and gives every stack of
its worker back when the worker's part of a launch ends.

Why a pool outside the kernel libraries: each kernel library has its own workers (emulator.cpp is
compiled into every library), and a launch of 1024-thread blocks that all wait at a barrier needs
1024 stacks per worker. A stack is two memory mappings (its guard page and the rest), and Linux
allows a process 65530 (vm.max_map_count): if every worker of every library kept its stacks, a test
run that loads a hundred libraries would run out. Unmapping them at the end of every launch bounds
the count but costs a few milliseconds per launch (mmap, mprotect, munmap with its TLB shootdown on
every core, and a page fault on each stack's first use). Here the stacks outlive the launch and
move between libraries, so the mapped stacks are bounded by what one launch uses plus POOL_KEPT,
however many libraries are loaded, and a launch after the first maps nothing.

What it is not: an allocator of anything but stacks of one layout (bytes, the lowest `guard` bytes
inaccessible); a stack of another size is mapped and unmapped without the pool.
*/
#include <mutex>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <vector>

namespace {

// Free stacks kept mapped (two mappings each): twice what one launch of 1024-thread blocks takes
// on a 2-core machine, and 8192 of Linux's 65530 mappings.
constexpr size_t POOL_KEPT = 4096;

std::mutex& pool_mutex = *new std::mutex;        // never destroyed: a worker may give stacks back at exit
std::vector<char*>& free_stacks = *new std::vector<char*>;
size_t pooled_bytes;                             // the layout of the pooled stacks (0 until the first)
size_t pooled_guard;

char* map_stack(size_t bytes, size_t guard) {
    char* stack = (char*)mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stack == MAP_FAILED) {
        fputs("llmc emulator: out of memory for fiber stacks\n", stderr);
        abort();
    }
    mprotect(stack, guard, PROT_NONE);
    return stack;
}

}  // namespace

// a stack of `bytes` bytes whose lowest `guard` bytes fault when touched: a free one of the pool, or
// a fresh mapping
extern "C" char* llmc_emu_stack_take(size_t bytes, size_t guard) {
    {
        std::lock_guard<std::mutex> lock(pool_mutex);
        if (bytes == pooled_bytes && guard == pooled_guard && !free_stacks.empty()) {
            char* stack = free_stacks.back();
            free_stacks.pop_back();
            return stack;
        }
    }
    return map_stack(bytes, guard);
}

// n stacks taken with (bytes, guard) are free again: kept for the next taker, up to POOL_KEPT
extern "C" void llmc_emu_stack_give(char* const* stacks, size_t n, size_t bytes, size_t guard) {
    size_t kept = 0;
    {
        std::lock_guard<std::mutex> lock(pool_mutex);
        if (pooled_bytes == 0) {
            pooled_bytes = bytes;
            pooled_guard = guard;
        }
        if (bytes == pooled_bytes && guard == pooled_guard) {
            for (; kept < n && free_stacks.size() < POOL_KEPT; kept++) free_stacks.push_back(stacks[kept]);
        }
    }
    for (size_t i = kept; i < n; i++) munmap(stacks[i], bytes);
}

// how many free stacks the pool holds (tests)
extern "C" size_t llmc_emu_stack_pool_size() {
    std::lock_guard<std::mutex> lock(pool_mutex);
    return free_stacks.size();
}
