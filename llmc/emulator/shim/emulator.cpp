/*
llmc/emulator/shim/emulator.cpp: the emulated device's launcher, compiled into every kernel
library after the kernel file (llmc/emulator/build.py generates the unit that includes both).

A launch runs a grid of blocks. Blocks are handed out to workers (the calling thread plus
persistent OS threads, one per core) in blockIdx order. A worker runs one block at a time: each
CUDA thread of the block is a fiber, started in threadIdx order and run until it finishes or waits
(at __syncthreads or a warp-synchronous call); a wait that completes its group wakes the others.
A thread takes a stack of its own only when it waits: threads that finish without waiting run
one after another on the same stack, a plain function call each. If every unfinished thread waits
and no group can complete, the block is deadlocked (a barrier some threads skip, a mask naming
a lane that left): the launch stops and says which threads wait where.

With LLMC_EMU_OS_THREADS (the sanitizer builds), each CUDA thread of a block is an OS thread (of
a pool that persists across launches), the same waits sleep on a futex, and blocks run one after
another.

Errors (a broken warp rule, a deadlock) stop the launch; llmc_emu_launch returns 1 and
llmc_emu_error() holds the message. In OS-thread mode they print it and abort.
*/
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <stdarg.h>
#include <string>
#include <sched.h>
#include <thread>
#include <vector>
#ifndef LLMC_EMU_OS_THREADS
#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#endif

// the shim's bookkeeping, which ThreadSanitizer must not see (OS-thread mode, below)
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define NO_TSAN __attribute__((no_sanitize("thread")))
static void happens_before(void* sync) { __tsan_release(sync); }
static void happens_after(void* sync) { __tsan_acquire(sync); }
#else
#define NO_TSAN
[[maybe_unused]] static void happens_before(void*) {}
[[maybe_unused]] static void happens_after(void*) {}
#endif

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace llmc_emu {

constexpr int WARP = 32;
constexpr int MAX_THREADS_PER_BLOCK = 1024;
constexpr unsigned MAX_GRID_YZ = 65535;

#ifndef LLMC_EMU_OS_THREADS
// a suspended fiber: its stack pointer (the registers are saved on its stack), or a ucontext
#if defined(__x86_64__)
struct Context { void* sp; };
#else
struct Context { ucontext_t uc; };
#endif
#endif

// ----------------------------------------------------------------------------
// the state of one block in flight

enum Wait { RUNNING, AT_BARRIER, AT_WARP_CALL, FINISHED };

// one cp.async in flight: its source bytes, read when it was issued, land at `dst` when the
// thread waits for its group (cp.async.wait_group)
struct AsyncCopy {
    char* dst;
    unsigned char data[16];
    int bytes;
    long group;                     // the commit group it belongs to: 1, 2, ... (groups_committed + 1 at issue)
};

struct CudaThread {
    uint3 idx;
    int linear;                     // x + y*bx + z*bx*by: lane = linear % 32, warp = linear / 32
    Wait wait;
    WarpOp op;                      // the warp call it waits in, and what it brought
    unsigned mask;
    unsigned long long value, result;
    int source;
    const char* what;
    bool started;                   // fiber mode: it has run (a fiber holds its stack while it waits)
    std::vector<AsyncCopy> async_copies;   // issued cp.async copies that have not landed
    long groups_committed;          // cp.async.commit_group calls so far
#ifndef LLMC_EMU_OS_THREADS
    Context context;                // fiber mode: where it continues after a wait
#endif
};

struct Block {
    int n = 0, live, at_barrier, waiting;
    dim3 shape;
    unsigned warp_arrived[MAX_THREADS_PER_BLOCK / WARP];
    std::vector<CudaThread> threads;
};

struct Launch {
    const char* name;
    void (*body)(void*);
    void* args;
    long num_blocks;
    std::atomic<long> next_block;
};

static Launch* launch_now;
static std::atomic<bool> failed;
static std::mutex& error_mutex = *new std::mutex;
static std::string& error_message = *new std::string;

static void record_error(const uint3& block, const CudaThread* t, const char* format, va_list ap) {
    char text[768];
    vsnprintf(text, sizeof(text), format, ap);
    char where[256];
    if (t) {
        snprintf(where, sizeof(where), "kernel %s, block (%u,%u,%u), thread (%u,%u,%u): ", launch_now->name,
                 block.x, block.y, block.z, t->idx.x, t->idx.y, t->idx.z);
    } else {
        snprintf(where, sizeof(where), "kernel %s, block (%u,%u,%u): ", launch_now->name, block.x, block.y, block.z);
    }
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!failed.exchange(true)) {
        error_message = std::string(where) + text;
    }
}

static void record_error(const uint3& block, const CudaThread* t, const char* format, ...) {
    va_list ap;
    va_start(ap, format);
    record_error(block, t, format, ap);
    va_end(ap);
}

static const char* op_name(const CudaThread& t) { return t.wait == AT_BARRIER ? "__syncthreads" : t.what; }

// which threads wait where, for the deadlock message
NO_TSAN static std::string describe_waits(const Block& b) {
    std::string s;
    int shown = 0;
    for (const CudaThread& t : b.threads) {
        if (t.wait == AT_BARRIER || t.wait == AT_WARP_CALL) {
            if (shown++ == 8) {
                s += "; ...";
                break;
            }
            char line[160];
            snprintf(line, sizeof(line), "%sthread %d in %s", shown > 1 ? "; " : "", t.linear, op_name(t));
            s += line;
            if (t.wait == AT_WARP_CALL) {
                snprintf(line, sizeof(line), " (mask 0x%08x)", t.mask);
                s += line;
            }
        }
    }
    int finished = b.n - b.live;
    if (finished) {
        s += "; " + std::to_string(finished) + " thread(s) finished";
    }
    return s;
}

// ----------------------------------------------------------------------------
// the rules of the synchronizing calls, shared by both modes. `wake` makes a waiting thread
// runnable; each returns false (with the error recorded) when a rule is broken.

NO_TSAN static unsigned lanes_of_warp(const Block& b, int warp) {
    int lanes = b.n - warp * WARP < WARP ? b.n - warp * WARP : WARP;
    return lanes == WARP ? 0xffffffffu : (1u << lanes) - 1u;
}

// the emulator's own copy of the lanes' registers between their stacks: byte by byte in code that
// ThreadSanitizer does not instrument (a memcpy call would be its interceptor, which checks, and
// the lock that orders these copies is invisible to it: a false race between the lanes in the OS
// threads of a sanitizer run). GCC must not turn the loop back into a memcpy call.
NO_TSAN __attribute__((optimize("no-tree-loop-distribute-patterns")))
static void copy_registers(char* to, const char* from, int bytes) {
    for (int i = 0; i < bytes; i++) to[i] = from[i];
}

// a warp-collective instruction completes: every lane receives every lane's bytes (warp_gather in
// cuda_shim.h). The lanes' buffers are on their own stacks, which stay put while they wait. Not a
// memory fence between the lanes (nor is a GPU's mma or ldmatrix): ThreadSanitizer still reports a
// lane reading shared memory that another wrote without a barrier between them.
NO_TSAN static void gather_complete(CudaThread* lanes) {
    for (int l = 0; l < WARP; l++) {
        const Gather* to = (const Gather*)(uintptr_t)lanes[l].value;
        for (int s = 0; s < WARP; s++) {
            const Gather* from = (const Gather*)(uintptr_t)lanes[s].value;
            copy_registers((char*)to->all + (size_t)s * to->bytes, (const char*)from->mine, to->bytes);
        }
    }
}

// lane t arrives at a warp call (what it brings: see warp_call in cuda_shim.h); completes its
// group if it is the last of the mask to arrive
template <class Wake>
NO_TSAN static bool warp_arrive(Block& b, CudaThread& t, WarpOp op, unsigned mask, unsigned long long value,
                                int source, const char* what, bool* completed, Wake wake) {
    t.op = op;
    t.mask = mask;
    t.value = value;
    t.what = what;
    const int warp = t.linear / WARP, lane = t.linear % WARP;
    t.source = op == WARP_SHFL ? shfl_source(source, lane) : source;     // a shuffle brings its rule
    if (!(t.mask >> lane & 1u)) {
        record_error(blockIdx, &t, "%s: the calling lane %d is not in its mask 0x%08x", t.what, lane, t.mask);
        return false;
    }
    const unsigned existing = lanes_of_warp(b, warp);
    if (op == WARP_GATHER && existing != 0xffffffffu) {
        record_error(blockIdx, &t, "%s: a warp-collective instruction needs all 32 lanes, and this block of %d threads "
                     "leaves warp %d with lanes 0x%08x", t.what, b.n, warp, existing);
        return false;
    }
    if (t.mask & ~existing) {
        record_error(blockIdx, &t, "%s: mask 0x%08x names lanes that do not exist (this warp has lanes 0x%08x)",
                     t.what, t.mask, existing);
        return false;
    }
    t.wait = AT_WARP_CALL;
    b.warp_arrived[warp] |= 1u << lane;
    *completed = (b.warp_arrived[warp] & t.mask) == t.mask;
    if (!*completed) {
        return true;
    }
    // every lane of the mask is waiting in a warp call: it must be the same call with the same mask
    CudaThread* lanes = &b.threads[warp * WARP];
    unsigned ballot = 0;
    for (int l = 0; l < WARP; l++) {
        if (!(t.mask >> l & 1u)) continue;
        if (lanes[l].mask != t.mask || lanes[l].op != t.op) {
            record_error(blockIdx, &t, "%s with mask 0x%08x: lane %d of the mask is waiting in %s with mask 0x%08x",
                         t.what, t.mask, l, lanes[l].what, lanes[l].mask);
            return false;
        }
        if (t.op == WARP_GATHER && (strcmp(lanes[l].what, t.what) != 0 ||
                                    ((const Gather*)(uintptr_t)lanes[l].value)->bytes != ((const Gather*)(uintptr_t)t.value)->bytes)) {
            record_error(blockIdx, &t, "%s: lane %d of the warp is in another warp-collective instruction, %s "
                         "(every lane must execute the same one)", t.what, l, lanes[l].what);
            return false;
        }
        if (t.op == WARP_SHFL && !(t.mask >> lanes[l].source & 1u)) {
            record_error(blockIdx, &lanes[l], "%s with mask 0x%08x: lane %d reads lane %d, which is not in the mask",
                         t.what, t.mask, l, lanes[l].source);
            return false;
        }
        ballot |= (unsigned)(lanes[l].value != 0) << l;
    }
    if (t.op == WARP_GATHER) gather_complete(lanes);
    for (int l = 0; l < WARP; l++) {
        if (!(t.mask >> l & 1u)) continue;
        lanes[l].result = t.op == WARP_SHFL ? lanes[lanes[l].source].value : ballot;
    }
    b.warp_arrived[warp] &= ~t.mask;
    for (int l = WARP - 1; l >= 0; l--) {        // from the last lane: a wake that queues in front runs lane 0 first
        if (t.mask >> l & 1u) {
            lanes[l].wait = RUNNING;
            if (&lanes[l] != &t) wake(lanes[l]);
        }
    }
    return true;
}

// all threads that have not finished wait at __syncthreads: release them (exited threads count
// as arrived, as on sm_70+)
template <class Wake>
NO_TSAN static void barrier_release_if_complete(Block& b, CudaThread* self, Wake wake) {
    if (b.at_barrier == 0 || b.at_barrier != b.live) return;
    b.at_barrier = 0;
    for (CudaThread& u : b.threads) {
        if (u.wait == AT_BARRIER) {
            u.wait = RUNNING;
            if (&u != self) wake(u);
        }
    }
}

NO_TSAN static void init_block(Block& b, const dim3& block) {
    const int n = (int)(block.x * block.y * block.z);
    if (b.n != n || b.shape.x != block.x || b.shape.y != block.y) {    // the indices, once per shape
        b.n = n;
        b.shape = block;
        b.threads.resize(n);
        for (int i = 0; i < n; i++) {
            b.threads[i].idx = {(unsigned)i % block.x, ((unsigned)i / block.x) % block.y, (unsigned)i / (block.x * block.y)};
            b.threads[i].linear = i;
        }
    }
    b.live = n;
    b.at_barrier = 0;
    b.waiting = 0;
    memset(b.warp_arrived, 0, sizeof(b.warp_arrived));
    for (CudaThread& t : b.threads) {
        t.wait = RUNNING;
        t.mask = 0;
        t.op = WARP_SYNC;
        t.value = t.result = 0;
        t.source = 0;
        t.what = "";
        t.started = false;
        t.async_copies.clear();
        t.groups_committed = 0;
    }
}

static uint3 block_index(long i) {
    return {(unsigned)(i % gridDim.x), (unsigned)(i / gridDim.x % gridDim.y), (unsigned)(i / ((long)gridDim.x * gridDim.y))};
}

#ifndef LLMC_EMU_OS_THREADS
// ----------------------------------------------------------------------------
// fiber mode
//
// A worker runs a block's threads in the order of its run queue: first every thread in threadIdx
// order, then each thread again when its wait completes: a barrier's threads join the back of the
// queue, the lanes a warp call releases its front (a warp's shuffles run back to back). A thread
// that never waits costs a function call: a *runner* (a loop on a fiber stack) calls the kernel
// for one thread after another, as long as each returns. When a thread waits, its frames stay on the runner's stack,
// and it hands the worker directly to the next thread of the queue: a fresh runner on a free
// stack when that thread has not started, else the waiting thread itself (a warp whose lanes only
// shuffle switches lane to lane). The worker's own stack (the scheduler) is reached only when the
// block ends, fails or deadlocks (the queue runs empty while threads still wait).

constexpr size_t STACK_BYTES = 256 * 1024;       // per waiting CUDA thread; the lowest page is a guard
constexpr size_t GUARD_BYTES = 4096;
// Stacks are mmap'd at multiples of 4 KiB, so the tops of a block's fibers would all fall into the
// same cache sets and evict each other at every switch. Each stack's top is moved down to its own
// place in a 64 KiB window (the "color"; 64 KiB is the span of the L2 cache's sets): stack i's top
// at 13*i cache lines into the window (mod 1024 lines), so the hot frames of consecutive fibers
// (about 11 lines from the runner down to a wait) do not share sets, and 1024 stacks cover the
// window's lines evenly (13 is odd).
constexpr uintptr_t COLOR_WINDOW = 64 * 1024;
constexpr uintptr_t COLOR_STRIDE = 13 * 64;
constexpr size_t STACK_MAPPING = STACK_BYTES + COLOR_WINDOW;
// The stacks come from the process's one pool (shim/stack_pool.cpp, its own library, which
// build.py loads before any kernel library): a worker takes one when a CUDA thread first waits and
// gives all of them back when its part of a launch ends, so that the stacks mapped stay bounded
// however many kernel libraries (each with its own workers) a process loads, and a launch maps
// nothing once the pool holds what it needs.
extern "C" char* llmc_emu_stack_take(size_t bytes, size_t guard) __attribute__((weak));
extern "C" void llmc_emu_stack_give(char* const* stacks, size_t n, size_t bytes, size_t guard) __attribute__((weak));

// __shared__ arrays: thread_local, at these offsets from the start of this library's TLS block
// (llmc/emulator/build.py reads them from the symbol table: readelf's TLS symbols)
thread_local char llmc_emu_tls_anchor;
static std::vector<std::pair<long, long>>& shared_arrays = *new std::vector<std::pair<long, long>>;   // (offset, bytes)
static long anchor_offset;

struct Worker {
    Block block;
    Context scheduler;                           // the worker's own stack, in run_block
    Context runner;                              // a runner about to start (on stacks[runner_stack])
    Context discarded;                           // where a runner that leaves for good saves itself
    int runner_stack;
    std::vector<char*> stacks;                   // all stacks this worker owns
    std::vector<int> free_stacks;
    int queue[MAX_THREADS_PER_BLOCK];            // the run queue, a ring: a thread is in it at most once
    unsigned head, tail;                         // next to run, next free slot (both counting up)
    CudaThread* current;
    uint3* thread_index;                         // &threadIdx of this worker's OS thread, found once per launch
};
static thread_local Worker* this_worker;

#if defined(__x86_64__)
// switch(save, next): push the callee-saved registers, store the stack pointer in *save, load
// `next`, pop the same from it and return into that context. The SSE and x87 control words are
// not switched: every fiber of a worker runs with the ones work() sets for the launch.
extern "C" void llmc_emu_switch(void** save, void* next);
asm(R"(
    .text
    .p2align 4
    .type llmc_emu_switch, @function
    .hidden llmc_emu_switch
llmc_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size llmc_emu_switch, .-llmc_emu_switch
)");

static void switch_context(Context& save, Context& next) { llmc_emu_switch(&save.sp, next.sp); }
#else
static void switch_context(Context& save, Context& next) { swapcontext(&save.uc, &next.uc); }
#endif

static void enqueue(Worker& w, CudaThread& t) { w.queue[w.tail++ % MAX_THREADS_PER_BLOCK] = t.linear; }
// in front of the queue: the lanes a warp call releases run next, so a warp goes through its
// shuffles with its 32 stacks warm in the cache, instead of after every other thread of the block
static void enqueue_first(Worker& w, CudaThread& t) { w.queue[--w.head % MAX_THREADS_PER_BLOCK] = t.linear; }

// the next thread of the run queue, or nullptr when it is empty or the launch failed
static CudaThread* next_thread(Worker& w) {
    if (w.head == w.tail || failed.load(std::memory_order_relaxed)) return nullptr;
    return &w.block.threads[w.queue[w.head++ % MAX_THREADS_PER_BLOCK]];
}

static void start_runner(Worker& w);

// leave the running context (saved in `save`) for thread `next`: resume it where it waits, or
// start it on a fresh runner; nullptr returns to the scheduler
static void run_next(Worker& w, Context& save, CudaThread* next) {
    if (next == nullptr) {
        switch_context(save, w.scheduler);
    } else if (!next->started) {
        w.current = next;
        start_runner(w);
        switch_context(save, w.runner);
    } else {
        w.current = next;
        switch_context(save, next->context);
    }
}

// the loop of a runner: run w.current, then each following thread that has not started, while
// each finishes without waiting on this stack
[[noreturn]] static void runner_main() {
    Worker& w = *this_worker;
    const int stack = w.runner_stack;
    for (;;) {
        CudaThread& t = *w.current;
        t.started = true;
        *w.thread_index = t.idx;                 // threadIdx, without a TLS lookup per thread
        launch_now->body(launch_now->args);
        t.wait = FINISHED;
        w.block.live--;
        barrier_release_if_complete(w.block, &t, [&](CudaThread& u) { enqueue(w, u); });
        CudaThread* next = next_thread(w);
        if (next != nullptr && !next->started) {
            w.current = next;
            continue;
        }
        w.free_stacks.push_back(stack);          // nothing of this runner is needed any more
        run_next(w, w.discarded, next);
        __builtin_unreachable();
    }
}

// prepare w.runner: runner_main on a free stack (taken from the pool on first need)
static void start_runner(Worker& w) {
    if (w.free_stacks.empty()) {
        if (!llmc_emu_stack_take) {
            fputs("llmc emulator: the fiber stack pool is not loaded (llmc.emulator.build loads it before any "
                  "kernel library)\n", stderr);
            abort();
        }
        w.stacks.push_back(llmc_emu_stack_take(STACK_MAPPING, GUARD_BYTES));
        w.free_stacks.push_back((int)w.stacks.size() - 1);
    }
    w.runner_stack = w.free_stacks.back();
    w.free_stacks.pop_back();
    char* end = w.stacks[w.runner_stack] + STACK_MAPPING;
    const uintptr_t color = (uintptr_t)w.runner_stack * COLOR_STRIDE % COLOR_WINDOW;
    char* top = end - ((uintptr_t)end - color) % COLOR_WINDOW;     // top == color (mod the window)
#if defined(__x86_64__)
    // the frame llmc_emu_switch pops: r15..rbp, then `ret` enters runner_main with the stack
    // aligned as after a call (a zero return address above it ends backtraces)
    unsigned long long* sp = (unsigned long long*)(top - 64);
    for (int i = 0; i < 6; i++) sp[i] = 0;
    sp[6] = (unsigned long long)&runner_main;
    sp[7] = 0;
    w.runner.sp = sp;
#else
    getcontext(&w.runner.uc);
    w.runner.uc.uc_stack.ss_sp = w.stacks[w.runner_stack] + GUARD_BYTES;
    w.runner.uc.uc_stack.ss_size = top - (w.stacks[w.runner_stack] + GUARD_BYTES);
    w.runner.uc.uc_link = nullptr;
    makecontext(&w.runner.uc, (void (*)())runner_main, 0);
#endif
}

// the start of this library's TLS block: through an integer, since the anchor is one char and a
// pointer derived from it may not reach the arrays (_FORTIFY_SOURCE=3 checks the memsets below)
static char* tls_block() { return (char*)((uintptr_t)&llmc_emu_tls_anchor - (uintptr_t)anchor_offset); }

static void fill_shared_with_nan() {
    char* base = tls_block();
    for (auto& [offset, bytes] : shared_arrays) memset(base + offset, 0xff, bytes);
}

bool is_shared(const void* p, size_t bytes) {
    const char* base = tls_block();
    for (auto& [offset, size] : shared_arrays) {
        if ((const char*)p >= base + offset && (const char*)p + bytes <= base + offset + size) return true;
    }
    return false;
}

static CudaThread& current_thread() { return *this_worker->current; }

static void run_block(Worker& w, long index) {
    Block& b = w.block;
    blockIdx = block_index(index);
    init_block(b, blockDim);
    fill_shared_with_nan();
    w.head = w.tail = 0;
    for (int i = 0; i < b.n; i++) enqueue(w, b.threads[i]);
    run_next(w, w.scheduler, next_thread(w));    // back when the queue is empty or the launch failed
#ifdef LLMC_EMU_TRACE
    trace_block_end();                           // the memory counters of the block (tracer.cpp)
#endif
    if (!failed.load() && b.live > 0) {
        record_error(blockIdx, nullptr, "deadlock: every unfinished thread waits and no wait can complete: %s",
                     describe_waits(b).c_str());
    }
    if (failed.load()) {                         // abandon the block's fibers: their stacks are free again
        w.free_stacks.clear();
        for (int i = 0; i < (int)w.stacks.size(); i++) w.free_stacks.push_back(i);
    }
}

// the running thread t waits: the worker runs the next thread until t's wait completes
static void wait_here(Worker& w, CudaThread& t) {
    run_next(w, t.context, next_thread(w));
    w.current = &t;
    *w.thread_index = t.idx;                     // threadIdx (gdb reads it there)
}

[[noreturn]] void fail(const char* format, ...) {
    Worker* w = this_worker;
    va_list ap;
    va_start(ap, format);
    record_error(blockIdx, w ? w->current : nullptr, format, ap);
    va_end(ap);
    if (!w) {
        fprintf(stderr, "llmc emulator: %s\n", error_message.c_str());
        abort();
    }
    switch_context(w->current->context, w->scheduler);
    __builtin_unreachable();
}

unsigned long long warp_call(WarpOp op, unsigned mask, unsigned long long value, int source, const char* what) {
    Worker& w = *this_worker;
    CudaThread& t = *w.current;
    bool completed = false;
    if (!warp_arrive(w.block, t, op, mask, value, source, what, &completed, [&](CudaThread& u) { enqueue_first(w, u); })) {
        switch_context(t.context, w.scheduler);  // failed: never resumed
    }
    if (!completed) wait_here(w, t);
    return t.result;
}

void sync_threads() {
    Worker& w = *this_worker;
    CudaThread& t = *w.current;
    t.wait = AT_BARRIER;
    w.block.at_barrier++;
    barrier_release_if_complete(w.block, &t, [&](CudaThread& u) { enqueue(w, u); });
    if (t.wait == AT_BARRIER) wait_here(w, t);
}

// ----------------------------------------------------------------------------
// the workers: the calling thread and num_workers - 1 persistent OS threads

// never destroyed: at exit the pool's threads still wait on them (glibc's destructor of a
// condition variable with waiters would block the exit). The same for every other object with a
// destructor here (the caller's worker, the error message, the launch lock): a Python thread
// still inside a launch when the process exits must not find them destroyed under it
static std::mutex& pool_mutex = *new std::mutex;
static std::condition_variable& pool_wake = *new std::condition_variable;
static std::condition_variable& pool_done = *new std::condition_variable;
static std::vector<std::thread>& pool = *new std::vector<std::thread>;
static long pool_generation;
static int pool_busy, pool_wanted;

#if defined(__x86_64__)
// the floating-point control words every fiber runs with, whatever its worker's OS thread had:
// the defaults (round to nearest even, no flush to zero, every exception masked)
struct ControlWords {
    unsigned mxcsr;
    unsigned short x87;
};
constexpr ControlWords FIBER_CONTROL_WORDS = {0x1f80, 0x037f};

static ControlWords exchange_control_words(ControlWords next) {
    ControlWords old;
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(old.mxcsr), "=m"(old.x87));
    asm volatile("ldmxcsr %0\n\tfldcw %1" : : "m"(next.mxcsr), "m"(next.x87));
    return old;
}
#endif

// after a worker's last block of a launch, when every stack is free again (a finished runner
// returns its stack; a failed block returns them all): all of them back to the pool
static void give_back_stacks(Worker& w) {
    if (w.stacks.empty()) return;
    llmc_emu_stack_give(w.stacks.data(), w.stacks.size(), STACK_MAPPING, GUARD_BYTES);
    w.stacks.clear();
    w.free_stacks.clear();
}

static void work(Worker& w) {
    this_worker = &w;
    w.thread_index = &threadIdx;
#if defined(__x86_64__)
    const ControlWords thread_control_words = exchange_control_words(FIBER_CONTROL_WORDS);
#endif
    for (long i; !failed.load(std::memory_order_relaxed) && (i = launch_now->next_block++) < launch_now->num_blocks;) {
        run_block(w, i);
    }
    give_back_stacks(w);
#if defined(__x86_64__)
    exchange_control_words(thread_control_words);
#endif
}

static void pool_thread(int id) {
    Worker w;
    long seen = 0;
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(pool_mutex);
            pool_wake.wait(lock, [&] { return pool_generation != seen; });
            seen = pool_generation;
            if (id >= pool_wanted) continue;
        }
        work(w);
        std::lock_guard<std::mutex> lock(pool_mutex);
        if (--pool_busy == 0) pool_done.notify_all();
    }
}

static int num_workers() {
    const char* env = getenv("LLMC_EMULATOR_WORKERS");
    int n = env ? atoi(env) : (int)std::thread::hardware_concurrency();
    return n < 1 ? 1 : n;
}

static void run_grid(long num_blocks) {
    static Worker& caller = *new Worker();
    const int helpers = (int)std::min<long>(num_workers(), num_blocks) - 1;
    if (helpers > 0) {
        std::lock_guard<std::mutex> lock(pool_mutex);
        while ((int)pool.size() < helpers) {
            pool.emplace_back(pool_thread, (int)pool.size());
            pool.back().detach();
        }
        pool_wanted = helpers;
        pool_busy = helpers;
        pool_generation++;
        pool_wake.notify_all();
    }
    work(caller);
    this_worker = nullptr;
    if (helpers > 0) {
        std::unique_lock<std::mutex> lock(pool_mutex);
        pool_done.wait(lock, [] { return pool_busy == 0; });
    }
}

#else
// ----------------------------------------------------------------------------
// OS-thread mode (sanitizer builds): a block's CUDA threads are OS threads, blocks one at a time
//
// The OS threads are a pool that lives as long as the process, in the sanitizer's python
// (shim/sanitizer_python.cpp, llmc_emu_run_threads), shared by every kernel library: pool thread
// k runs threadIdx k (linear) of every block, so a launch creates no thread once the pool has
// grown to the largest block. A thread that waits (at __syncthreads, in a warp call) sleeps on a
// futex: a spinning waiter would take the core from the threads it waits for (a block of 1024
// threads on 2 cores).
//
// The shim's own bookkeeping must not order the kernel's memory accesses, or ThreadSanitizer
// would miss a missing barrier: a mutex around every shuffle would make all threads of the block
// happen-after each other. So the bookkeeping runs under a lock of atomics and futexes (system
// calls that ThreadSanitizer does not see) in code that it does not instrument (NO_TSAN), and only
// what CUDA orders is told to ThreadSanitizer:
// - __syncthreads orders the whole block: each thread releases into the barrier's sync object
//   before it waits and acquires from it after. Consecutive barriers alternate between two
//   objects, so a thread already at the next barrier cannot add its later accesses to the object
//   a slow thread has yet to acquire from (the next barrier cannot complete without that thread).
//   An exited thread counts as arrived at the next barrier, and so releases into its object.
// - __syncwarp orders the lanes of its mask, in the same way per warp (exact when the lanes of a
//   warp make the same sequence of __syncwarp calls, as full-warp masks do).
// - a shuffle orders nothing.
// - each thread of a block starts after everything before it (the caller's writes, the blocks
//   before) and the launch returns after all of them; neither orders the block's threads among
//   themselves.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

extern "C" char __start_llmc_emu_shared[] __attribute__((weak));
extern "C" char __stop_llmc_emu_shared[] __attribute__((weak));
// body(k, context) for k = 0 .. n-1, each on its own OS thread, all at once (shim/sanitizer_python.cpp)
extern "C" void llmc_emu_run_threads(int n, void (*body)(int, void*), void* context) __attribute__((weak));

static Block& os_block = *new Block();
static CudaThread& current_thread();
static uint3 os_block_index;                     // blockIdx of the block in flight
static int bookkeeping;                          // the bookkeeping's lock: 0 free, 1 held, 2 held and waited for
static char start_sync, end_sync, barrier_sync[2], warp_sync[MAX_THREADS_PER_BLOCK / WARP][2];   // ThreadSanitizer's
static thread_local CudaThread* this_thread;
static thread_local int barriers_passed, syncwarps_passed;   // which of the two sync objects is next
static_assert(sizeof(Wait) == sizeof(int), "a thread's wait state is a futex word");

NO_TSAN static void futex_wait(int* word, int value) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
}
NO_TSAN static void futex_wake(int* word, int count) {
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}
NO_TSAN static void sleep_while(int* word, int value) {
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == value) futex_wait(word, value);
}

// a futex mutex (Drepper, "Futexes Are Tricky", mutex 2)
NO_TSAN static void lock() {
    int c = 0;
    if (__atomic_compare_exchange_n(&bookkeeping, &c, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return;
    if (c != 2) c = __atomic_exchange_n(&bookkeeping, 2, __ATOMIC_ACQUIRE);
    while (c != 0) {
        futex_wait(&bookkeeping, 2);
        c = __atomic_exchange_n(&bookkeeping, 2, __ATOMIC_ACQUIRE);
    }
}
NO_TSAN static void unlock() {
    if (__atomic_exchange_n(&bookkeeping, 0, __ATOMIC_RELEASE) == 2) futex_wake(&bookkeeping, 1);
}

[[noreturn]] void fail(const char* format, ...) {
    va_list ap;
    va_start(ap, format);
    record_error(blockIdx, this_thread, format, ap);
    va_end(ap);
    fprintf(stderr, "llmc emulator: %s\n", error_message.c_str());
    abort();
}

// the waiting threads made RUNNING under the lock are woken after it is released, so that a woken
// thread does not find the lock still held by its waker
static thread_local int to_wake[MAX_THREADS_PER_BLOCK], num_to_wake;
NO_TSAN static void wake(CudaThread& u) { to_wake[num_to_wake++] = u.linear; }
NO_TSAN static void unlock_and_wake() {
    unlock();
    CudaThread* threads = os_block.threads.data();   // (std::vector's code is not inlined into NO_TSAN code)
    for (int i = 0; i < num_to_wake; i++) futex_wake((int*)&threads[to_wake[i]].wait, 1);
    num_to_wake = 0;
}

// with the lock held, after a thread starts waiting or finishes. The threads that wait are those
// at the barrier and those whose bit is set in their warp's arrivals.
NO_TSAN static void check_deadlock(Block& b) {
    int waiting = b.at_barrier;
    for (int w = 0; w < (b.n + WARP - 1) / WARP; w++) waiting += __builtin_popcount(b.warp_arrived[w]);
    if (b.live > 0 && waiting == b.live) {
        fail("deadlock: every unfinished thread waits and no wait can complete: %s", describe_waits(b).c_str());
    }
}

NO_TSAN unsigned long long warp_call(WarpOp op, unsigned mask, unsigned long long value, int source, const char* what) {
    CudaThread& t = *this_thread;
    char* sync = &warp_sync[t.linear / WARP][syncwarps_passed % 2];
    if (op == WARP_SYNC) happens_before(sync);
    lock();
    bool completed = false;
    if (!warp_arrive(os_block, t, op, mask, value, source, what, &completed, wake)) {
        fprintf(stderr, "llmc emulator: %s\n", error_message.c_str());
        abort();
    }
    if (!completed) check_deadlock(os_block);
    unlock_and_wake();
    sleep_while((int*)&t.wait, AT_WARP_CALL);
    if (op == WARP_SYNC) {
        happens_after(sync);
        syncwarps_passed++;
    }
    return t.result;
}

NO_TSAN void sync_threads() {
    CudaThread& t = *this_thread;
    char* sync = &barrier_sync[barriers_passed % 2];
    happens_before(sync);
    lock();
    t.wait = AT_BARRIER;
    os_block.at_barrier++;
    barrier_release_if_complete(os_block, &t, wake);
    if (t.wait == AT_BARRIER) check_deadlock(os_block);
    unlock_and_wake();
    sleep_while((int*)&t.wait, AT_BARRIER);
    happens_after(sync);
    barriers_passed++;
}

NO_TSAN static void finish(CudaThread& t) {
    happens_before(&barrier_sync[barriers_passed % 2]);   // arrived at the next barrier, for good
    lock();
    t.wait = FINISHED;
    os_block.live--;
    barrier_release_if_complete(os_block, &t, wake);
    check_deadlock(os_block);
    unlock_and_wake();
    happens_before(&end_sync);                   // after its last look at the block (std::vector's code is instrumented)
}

// CUDA thread k of the block in flight, on pool thread k
NO_TSAN static void run_cuda_thread(int k, void*) {
    happens_after(&start_sync);
    CudaThread& t = os_block.threads[k];
    this_thread = &t;
    threadIdx = t.idx;
    blockIdx = os_block_index;
    barriers_passed = syncwarps_passed = 0;
    launch_now->body(launch_now->args);
    finish(t);
}

bool is_shared(const void* p, size_t bytes) {
    return (const char*)p >= __start_llmc_emu_shared && (const char*)p + bytes <= __stop_llmc_emu_shared;
}

static CudaThread& current_thread() { return *this_thread; }

NO_TSAN static void run_grid(long num_blocks) {
    if (!llmc_emu_run_threads) {
        fputs("llmc emulator: a sanitizer build runs in the python of llmc.emulator.build.sanitizer_python "
              "(it holds the OS threads)\n", stderr);
        abort();
    }
    for (long i = 0; i < num_blocks; i++) {
        os_block_index = block_index(i);
        if (__start_llmc_emu_shared != __stop_llmc_emu_shared) {
            memset(__start_llmc_emu_shared, 0xff, __stop_llmc_emu_shared - __start_llmc_emu_shared);
        }
        init_block(os_block, blockDim);
        happens_before(&start_sync);
        llmc_emu_run_threads(os_block.n, run_cuda_thread, nullptr);
        happens_after(&end_sync);
    }
}
#endif

// ----------------------------------------------------------------------------
// the shared-memory window (the PTX ISA's "cvta": cvta.to.shared turns a generic address into
// one of the .shared state space, the 32-bit address that ldmatrix and cp.async take). Here the
// window starts where this library's __shared__ arrays start: the TLS block in fiber mode, the
// llmc_emu_shared section in OS-thread mode.

#ifdef LLMC_EMU_OS_THREADS
static char* shared_window() { return __start_llmc_emu_shared; }
#else
static char* shared_window() { return tls_block(); }
#endif

unsigned shared_window_address(const void* p) {
    if (!is_shared(p, 1)) fail("cvta.to.shared: the address %p is not inside the block's shared memory", p);
    return (unsigned)((const char*)p - shared_window());
}

void* shared_window_pointer(unsigned address) { return shared_window() + address; }

// ----------------------------------------------------------------------------
// cp.async (tensor_cores.h, the PTX ISA's "cp.async", "cp.async.commit_group" and
// "cp.async.wait_group"): each CUDA thread keeps its copies in flight; a copy joins the group that
// the thread's next commit_group closes, and wait_group N lands every copy of the committed groups
// except the N most recent, in the order they were issued. Copies not yet committed are not
// waited for (wait_all commits first).

void cp_async(void* dst, const void* src, int cp_size, int src_size, const char* what) {
    if (cp_size != 4 && cp_size != 8 && cp_size != 16) fail("%s: cp-size %d (4, 8 or 16 bytes)", what, cp_size);
    if (src_size < 0 || src_size > cp_size) fail("%s: src-size %d outside 0..cp-size %d", what, src_size, cp_size);
    if ((uintptr_t)dst % cp_size != 0) fail("%s: the shared address %p is not %d-byte aligned", what, dst, cp_size);
    if ((uintptr_t)src % cp_size != 0) fail("%s: the global address %p is not %d-byte aligned", what, src, cp_size);
    if (!is_shared(dst, cp_size)) fail("%s: the destination %p (%d bytes) is not inside the block's shared memory", what, dst, cp_size);
    if (src_size > 0 && is_shared(src, src_size)) fail("%s: the source %p is in shared memory, not global", what, src);
#ifdef LLMC_EMU_TRACE
    // one instruction, two requests: its global read and its shared write (tracer.cpp), at the kernel's call
    trace_access(src, src_size, false, __builtin_return_address(0));
    trace_access(dst, cp_size, true, __builtin_return_address(0));
#endif
    CudaThread& t = current_thread();
    AsyncCopy copy;
    copy.dst = (char*)dst;
    copy.bytes = cp_size;
    memset(copy.data, 0, sizeof(copy.data));                 // src-size < cp-size: the rest is zero-filled
    if (src_size > 0) memcpy(copy.data, src, src_size);
    copy.group = t.groups_committed + 1;
    t.async_copies.push_back(copy);
}

void cp_async_commit_group() { current_thread().groups_committed++; }

void cp_async_wait_group(int pending) {
    CudaThread& t = current_thread();
    size_t kept = 0;
    for (size_t i = 0; i < t.async_copies.size(); i++) {
        AsyncCopy& copy = t.async_copies[i];
        if (copy.group <= t.groups_committed - pending) {
            memcpy(copy.dst, copy.data, copy.bytes);
        } else {
            t.async_copies[kept++] = copy;
        }
    }
    t.async_copies.resize(kept);
}

// ----------------------------------------------------------------------------
// the launch

static std::mutex& launch_mutex = *new std::mutex;                  // one launch at a time (the emulated stream)

int launch(const char* name, const unsigned* grid, const unsigned* block, void (*body)(void*), void* args) {
    std::lock_guard<std::mutex> lock(launch_mutex);
    Launch l;
    l.name = name;
    l.body = body;
    l.args = args;
    l.next_block = 0;
    launch_now = &l;
    failed = false;
    error_message.clear();
    const long threads = (long)block[0] * block[1] * block[2];
    if (threads < 1 || threads > MAX_THREADS_PER_BLOCK) {
        error_message = std::string("kernel ") + name + ": a block of " + std::to_string(threads) +
                        " threads (CUDA allows 1 to 1024)";
        return 1;
    }
    if (grid[0] < 1 || grid[1] < 1 || grid[2] < 1 || grid[1] > MAX_GRID_YZ || grid[2] > MAX_GRID_YZ) {
        error_message = std::string("kernel ") + name + ": grid (" + std::to_string(grid[0]) + "," +
                        std::to_string(grid[1]) + "," + std::to_string(grid[2]) + ") is not a CUDA grid";
        return 1;
    }
    blockDim = dim3(block[0], block[1], block[2]);
    gridDim = dim3(grid[0], grid[1], grid[2]);
    l.num_blocks = (long)grid[0] * grid[1] * grid[2];
    run_grid(l.num_blocks);
    return failed.load() ? 1 : 0;
}

}  // namespace llmc_emu

extern "C" const char* llmc_emu_error() { return llmc_emu::error_message.c_str(); }

extern "C" void llmc_emu_set_shared(int n, const long* offsets, const long* bytes, long anchor_offset) {
#ifndef LLMC_EMU_OS_THREADS
    llmc_emu::shared_arrays.clear();
    for (int i = 0; i < n; i++) llmc_emu::shared_arrays.push_back({offsets[i], bytes[i]});
    llmc_emu::anchor_offset = anchor_offset;
#endif
}
