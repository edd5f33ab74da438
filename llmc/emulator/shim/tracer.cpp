/*
llmc/emulator/shim/tracer.cpp: the memory counters of the emulated device (a traced build,
llmc/emulator/memory.py): every load and store a kernel makes to global and shared memory,
grouped into warp-level requests and counted as NVIDIA's profiler counts them.

How the accesses are seen without changing the kernels: the kernel's translation unit is compiled
with g++'s ThreadSanitizer instrumentation (-fsanitize=thread), which calls __tsan_readN(addr) /
__tsan_writeN(addr) before every load and store of N bytes that may touch memory outside the
function's own registers. This file defines those functions instead of ThreadSanitizer's runtime
(it is linked into the library, not libtsan). The return address of each call is the access's
site: llmc/emulator/memory.py maps it to the kernel's source line with the debug line table.

What counts: an access whose address lies inside a __shared__ array of the block (shared) or
inside a device allocation that the launch registered (global). Everything else (the thread's
locals on its stack, threadIdx and the other built-in variables, the launch's argument copies) is
not memory a GPU kernel would load from L1TEX, and is ignored. Atomics are not counted (on a GPU
they go to the L2's atomic units, not through the load/store path these counters describe).

How accesses become requests (one warp-level memory instruction, as NVIDIA's L1TEX sees it:
"When an SM executes a global/local/shared memory instruction for a warp, a single request is sent
to L1TEX", NVIDIA's Nsight Compute documentation, Memory Workload Analysis):
1. Per thread, consecutive accesses by *different* instructions to adjacent bytes (just after or
   just before the access so far) within one aligned 16-byte chunk are merged into one access: g++ splits a 16-byte struct copy (Packed128,
   float4) into 8 or 4 scalar loads, where a GPU's compiler emits one 128-bit load. A loop that
   reads x[i], x[i+1], ... from one instruction is never merged (each is its own request).
2. The n-th execution of a site by each lane of a warp forms the warp's n-th request of that site
   (the lanes of a warp run the same instructions; a lane that skips one, under a branch, shifts
   its later ones: an approximation for divergent code).
3. Counters of a request (CUDA C++ Programming Guide, "Device Memory Accesses" and "Shared
   Memory"; Nsight Compute's Kernel Profiling Guide, metrics l1tex__t_requests, l1tex__t_sectors,
   l1tex__data_pipe_lsu_wavefronts_mem_shared, l1tex__data_bank_conflicts_pipe_lsu_mem_shared):
   - global: 1 request; sectors = the distinct 32-byte sectors its lanes' bytes touch; lines =
     the distinct 128-byte cache lines; bytes requested = the sum of the lanes' access sizes, and
     the distinct bytes among them (lanes reading the same word count it once; bytes moved = 32 x
     sectors).
   - shared: 32 banks of 4-byte words; lanes that touch the same word do not conflict (broadcast).
     Accesses of 8 bytes are served per half-warp, of 16 bytes per quarter-warp (8 lanes x 16
     bytes = 128 bytes, all banks once); each phase takes as many wavefronts as the largest number
     of distinct words any one bank must deliver; the ideal is one wavefront per active phase, and
     the bank conflicts are the wavefronts beyond it.
cp.async (a global read and a shared write of one instruction) and ldmatrix (each address-giving
lane reads one 16-byte row) are recorded by the emulator's implementations through
llmc_emu_trace_access, at the kernel's call site.

Memory: requests are counted as soon as all lanes of the warp have contributed (or when the block
ends), and only per-site counters are kept, unless a raw trace was asked for (one launch of the
visual debugger: up to its capacity of individual accesses).
*/
#include <algorithm>
#include <atomic>
#include <dlfcn.h>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace llmc_emu {
bool is_shared(const void* p, size_t bytes);
}

namespace llmc_emu_trace {

constexpr int WARP = 32;
constexpr int MAX_THREADS = 1024;
constexpr int CHUNK = 16;                       // the widest access a GPU thread makes (128-bit)
enum Space { GLOBAL = 0, SHARED = 1 };

struct Range {
    uintptr_t begin, end;
};
static std::vector<Range>& allocations = *new std::vector<Range>;   // sorted, set by trace_begin
static std::atomic<bool> active{false};

// the counters of one site (instruction address, space, load or store), summed over its requests
struct Counters {
    unsigned long long requests, lanes, sectors, lines, bytes, unique_bytes, wavefronts, ideal_wavefronts;
};
struct SiteKey {
    uintptr_t pc;
    int space, write;
    bool operator==(const SiteKey& o) const { return pc == o.pc && space == o.space && write == o.write; }
};
struct SiteHash {
    size_t operator()(const SiteKey& k) const { return std::hash<uintptr_t>()(k.pc * 4 + k.space * 2 + k.write); }
};
static std::unordered_map<SiteKey, Counters, SiteHash>& sites = *new std::unordered_map<SiteKey, Counters, SiteHash>;
static std::mutex& sites_mutex = *new std::mutex;

// the raw trace (for one launch, when asked): every merged access
struct RawAccess {
    uintptr_t pc, addr;
    unsigned block_x, block_y, block_z;
    int thread, size, space, write;
};
static std::vector<RawAccess>& raw = *new std::vector<RawAccess>;
static size_t raw_capacity = 0;
static std::atomic<size_t> raw_dropped{0};

// ----------------------------------------------------------------------------
// one block in flight on this worker (fibers: one block at a time per OS thread)

struct Access {
    uintptr_t addr;
    int size;
};
struct Request {
    unsigned lanes = 0;
    Access access[WARP];
};
struct GroupKey {
    uintptr_t pc;
    int warp, space, write;
    bool operator==(const GroupKey& o) const {
        return pc == o.pc && warp == o.warp && space == o.space && write == o.write;
    }
};
struct GroupHash {
    size_t operator()(const GroupKey& k) const {
        return std::hash<uintptr_t>()(k.pc) ^ ((size_t)k.warp << 2) ^ ((size_t)k.space << 1) ^ (size_t)k.write;
    }
};
struct Group {
    unsigned count[WARP] = {};                  // how many requests of this site each lane has made
    std::vector<Request*> requests;             // by occurrence; nullptr once counted
};
// a thread's access being merged (rule 1)
struct Run {
    bool valid = false;
    uintptr_t pc, last_pc, addr;
    int size, space, write;
};
struct BlockState {
    std::unordered_map<GroupKey, Group, GroupHash> groups;
    std::unordered_map<SiteKey, Counters, SiteHash> sites;
    Run runs[MAX_THREADS];
    unsigned block_x, block_y, block_z;
};
static thread_local BlockState* block_state;

static int lanes_in_warp(int warp, int threads) {
    const int n = threads - warp * WARP;
    return n < WARP ? n : WARP;
}

// the counters of one finished request, added to its site
static void count(BlockState& b, const GroupKey& key, const Request& r) {
    Counters& c = b.sites[SiteKey{key.pc, key.space, key.write}];
    c.requests++;
    c.lanes += __builtin_popcount(r.lanes);
    std::vector<uintptr_t> sectors, lines;
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;
    int size = 0;
    for (int l = 0; l < WARP; l++) {
        if (!(r.lanes >> l & 1u)) continue;
        const Access& a = r.access[l];
        c.bytes += a.size;
        spans.push_back({a.addr, a.addr + a.size});
        size = a.size > size ? a.size : size;
        for (uintptr_t s = a.addr >> 5; s <= (a.addr + a.size - 1) >> 5; s++) sectors.push_back(s);
        for (uintptr_t s = a.addr >> 7; s <= (a.addr + a.size - 1) >> 7; s++) lines.push_back(s);
    }
    // the distinct bytes of the request (lanes reading the same bytes count them once)
    std::sort(spans.begin(), spans.end());
    uintptr_t covered_to = 0;
    for (auto [begin, end] : spans) {
        if (end > covered_to) c.unique_bytes += end - std::max(begin, covered_to);
        covered_to = std::max(covered_to, end);
    }
    if (key.space == GLOBAL) {
        std::sort(sectors.begin(), sectors.end());
        std::sort(lines.begin(), lines.end());
        c.sectors += std::unique(sectors.begin(), sectors.end()) - sectors.begin();
        c.lines += std::unique(lines.begin(), lines.end()) - lines.begin();
        return;
    }
    // shared: phases of 32, 16 or 8 lanes by the access size; per phase, the most distinct words of one bank
    const int phase_lanes = size > 8 ? 8 : (size > 4 ? 16 : 32);
    for (int p = 0; p < WARP; p += phase_lanes) {
        std::vector<uintptr_t> words;
        for (int l = p; l < p + phase_lanes; l++) {
            if (!(r.lanes >> l & 1u)) continue;
            const Access& a = r.access[l];
            for (uintptr_t w = a.addr >> 2; w <= (a.addr + a.size - 1) >> 2; w++) words.push_back(w);
        }
        if (words.empty()) continue;
        std::sort(words.begin(), words.end());
        words.erase(std::unique(words.begin(), words.end()), words.end());
        int per_bank[WARP] = {};
        int most = 0;
        for (uintptr_t w : words) most = std::max(most, ++per_bank[w % WARP]);
        c.wavefronts += most;
        c.ideal_wavefronts += 1;
    }
}

// rule 2: a thread's (merged) access joins its warp's request of that site and occurrence
static void commit(BlockState& b, int thread, const Run& run) {
    const int threads = (int)(blockDim.x * blockDim.y * blockDim.z);
    const int warp = thread / WARP, lane = thread % WARP;
    const GroupKey key{run.pc, warp, run.space, run.write};
    Group& g = b.groups[key];
    const unsigned occurrence = g.count[lane]++;
    if (g.requests.size() <= occurrence) g.requests.resize(occurrence + 1, nullptr);
    Request*& r = g.requests[occurrence];
    if (r == nullptr) r = new Request();
    r->lanes |= 1u << lane;
    r->access[lane] = Access{run.addr, run.size};
    if (raw_capacity) {
        std::lock_guard<std::mutex> lock(sites_mutex);
        if (raw.size() < raw_capacity) {
            raw.push_back(RawAccess{run.pc, run.addr, b.block_x, b.block_y, b.block_z, thread, run.size, run.space, run.write});
        } else {
            raw_dropped++;
        }
    }
    const int full = lanes_in_warp(warp, threads);
    if (__builtin_popcount(r->lanes) == full) {
        count(b, key, *r);
        delete r;
        r = nullptr;
    }
}

static BlockState& state() {
    BlockState* b = block_state;
    if (b == nullptr) {
        b = block_state = new BlockState();      // one per worker OS thread, kept
        b->block_x = blockIdx.x, b->block_y = blockIdx.y, b->block_z = blockIdx.z;
    }
    return *b;
}

static bool is_global(uintptr_t addr, size_t size) {
    auto it = std::upper_bound(allocations.begin(), allocations.end(), addr,
                               [](uintptr_t a, const Range& r) { return a < r.begin; });
    if (it == allocations.begin()) return false;
    --it;
    return addr >= it->begin && addr + size <= it->end;
}

static void record(const void* p, int size, int write, uintptr_t pc) {
    if (!active.load(std::memory_order_relaxed) || size <= 0) return;
    const uintptr_t addr = (uintptr_t)p;
    int space;
    if (llmc_emu::is_shared(p, size)) {
        space = SHARED;
    } else if (is_global(addr, size)) {
        space = GLOBAL;
    } else {
        return;                                  // a local, a built-in variable, an argument copy
    }
    BlockState& b = state();
    const int thread = (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
    Run& run = b.runs[thread];
    // rule 1: another instruction continuing the same access, before or after it, within its 16-byte chunk
    if (run.valid && run.write == write && run.space == space && pc != run.last_pc &&
        (addr == run.addr + run.size || addr + size == run.addr) &&
        std::min(addr, run.addr) / CHUNK == (std::max(addr + size, run.addr + run.size) - 1) / CHUNK) {
        run.addr = std::min(addr, run.addr);
        run.size += size;
        run.last_pc = pc;
        return;
    }
    if (run.valid) commit(b, thread, run);
    run = Run{true, pc, pc, addr, size, space, write};
}

}  // namespace llmc_emu_trace

// ----------------------------------------------------------------------------
// the emulator's hooks

namespace llmc_emu {

// an access made by the emulator's own implementation of an instruction (cp.async, ldmatrix), at
// the kernel's call site `pc`
void trace_access(const void* p, int size, bool write, const void* pc) {
    llmc_emu_trace::record(p, size, write, (uintptr_t)pc);
}

// the block of this worker has finished: every access joins its request, every request is counted
void trace_block_end() {
    using namespace llmc_emu_trace;
    BlockState* b = block_state;
    if (b == nullptr) return;
    const int threads = (int)(blockDim.x * blockDim.y * blockDim.z);
    for (int t = 0; t < threads && t < MAX_THREADS; t++) {
        if (b->runs[t].valid) commit(*b, t, b->runs[t]);
        b->runs[t].valid = false;
    }
    for (auto& [key, group] : b->groups) {
        for (Request*& r : group.requests) {
            if (r != nullptr) {
                count(*b, key, *r);
                delete r;
                r = nullptr;
            }
        }
    }
    b->groups.clear();
    {
        std::lock_guard<std::mutex> lock(sites_mutex);
        for (auto& [key, c] : b->sites) {
            Counters& total = sites[key];
            total.requests += c.requests, total.lanes += c.lanes, total.sectors += c.sectors;
            total.lines += c.lines, total.bytes += c.bytes, total.unique_bytes += c.unique_bytes;
            total.wavefronts += c.wavefronts;
            total.ideal_wavefronts += c.ideal_wavefronts;
        }
    }
    b->sites.clear();
    block_state = nullptr;                       // the next block starts a fresh state (its blockIdx)
    delete b;
}

}  // namespace llmc_emu

// ----------------------------------------------------------------------------
// the C interface (llmc/emulator/memory.py)

struct LlmcTraceSite {
    unsigned long long pc_offset;
    int space, write;
    unsigned long long requests, lanes, sectors, lines, bytes, unique_bytes, wavefronts, ideal_wavefronts;
};
struct LlmcTraceRaw {
    unsigned long long pc_offset, addr;
    unsigned block_x, block_y, block_z;
    int thread, size, space, write;
};

static uintptr_t library_base() {
    Dl_info info;
    dladdr((void*)&library_base, &info);
    return (uintptr_t)info.dli_fbase;
}

// start counting: `n` device allocations [begins[i], ends[i]); keep up to raw_capacity raw accesses
extern "C" void llmc_emu_trace_begin(int n, const unsigned long long* begins, const unsigned long long* ends,
                                     long raw_capacity) {
    using namespace llmc_emu_trace;
    allocations.clear();
    for (int i = 0; i < n; i++) allocations.push_back(Range{(uintptr_t)begins[i], (uintptr_t)ends[i]});
    std::sort(allocations.begin(), allocations.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
    sites.clear();
    raw.clear();
    raw_dropped = 0;
    llmc_emu_trace::raw_capacity = raw_capacity > 0 ? (size_t)raw_capacity : 0;
    active = true;
}

extern "C" void llmc_emu_trace_end() { llmc_emu_trace::active = false; }

// the counters of the launch since trace_begin: writes up to `capacity` sites, returns how many there are
extern "C" long llmc_emu_trace_sites(LlmcTraceSite* out, long capacity) {
    using namespace llmc_emu_trace;
    const uintptr_t base = library_base();
    long i = 0;
    for (auto& [key, c] : sites) {
        if (i < capacity) {
            out[i] = LlmcTraceSite{key.pc - base, key.space, key.write, c.requests, c.lanes, c.sectors, c.lines,
                                   c.bytes, c.unique_bytes, c.wavefronts, c.ideal_wavefronts};
        }
        i++;
    }
    return i;
}

// the raw accesses kept (up to `capacity` copied); returns how many were kept; *dropped: how many not
extern "C" long llmc_emu_trace_raw(LlmcTraceRaw* out, long capacity, long* dropped) {
    using namespace llmc_emu_trace;
    const uintptr_t base = library_base();
    for (size_t i = 0; i < raw.size() && (long)i < capacity; i++) {
        const RawAccess& a = raw[i];
        out[i] = LlmcTraceRaw{a.pc - base, a.addr, a.block_x, a.block_y, a.block_z, a.thread, a.size, a.space, a.write};
    }
    *dropped = (long)raw_dropped.load();
    return (long)raw.size();
}

// ----------------------------------------------------------------------------
// ThreadSanitizer's instrumentation entry points, defined here (the kernel unit calls them)

#define LLMC_TRACE_ACCESS(N)                                                                           \
    extern "C" void __tsan_read##N(void* p) { llmc_emu_trace::record(p, N, 0, (uintptr_t)__builtin_return_address(0)); } \
    extern "C" void __tsan_write##N(void* p) { llmc_emu_trace::record(p, N, 1, (uintptr_t)__builtin_return_address(0)); } \
    extern "C" void __tsan_unaligned_read##N(void* p) {                                                \
        llmc_emu_trace::record(p, N, 0, (uintptr_t)__builtin_return_address(0));                          \
    }                                                                                                  \
    extern "C" void __tsan_unaligned_write##N(void* p) {                                               \
        llmc_emu_trace::record(p, N, 1, (uintptr_t)__builtin_return_address(0));                          \
    }                                                                                                  \
    extern "C" void __tsan_volatile_read##N(void* p) {                                                 \
        llmc_emu_trace::record(p, N, 0, (uintptr_t)__builtin_return_address(0));                           \
    }                                                                                                  \
    extern "C" void __tsan_volatile_write##N(void* p) {                                                \
        llmc_emu_trace::record(p, N, 1, (uintptr_t)__builtin_return_address(0));                           \
    }
LLMC_TRACE_ACCESS(1)
LLMC_TRACE_ACCESS(2)
LLMC_TRACE_ACCESS(4)
LLMC_TRACE_ACCESS(8)
LLMC_TRACE_ACCESS(16)

extern "C" void __tsan_read_range(void* p, unsigned long size) {
    llmc_emu_trace::record(p, (int)size, 0, (uintptr_t)__builtin_return_address(0));
}
extern "C" void __tsan_write_range(void* p, unsigned long size) {
    llmc_emu_trace::record(p, (int)size, 1, (uintptr_t)__builtin_return_address(0));
}
extern "C" void __tsan_init() {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
extern "C" void __tsan_vptr_update(void**, void*) {}
extern "C" void __tsan_vptr_read(void**) {}

// atomics: performed (sequentially consistent), not counted
#define LLMC_TRACE_ATOMICS(BITS, T)                                                                             \
    extern "C" T __tsan_atomic##BITS##_load(const volatile T* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); } \
    extern "C" void __tsan_atomic##BITS##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); } \
    extern "C" T __tsan_atomic##BITS##_exchange(volatile T* a, T v, int) {                                       \
        return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                      \
    }                                                                                                            \
    extern "C" T __tsan_atomic##BITS##_fetch_add(volatile T* a, T v, int) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); } \
    extern "C" T __tsan_atomic##BITS##_fetch_sub(volatile T* a, T v, int) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); } \
    extern "C" T __tsan_atomic##BITS##_fetch_and(volatile T* a, T v, int) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); } \
    extern "C" T __tsan_atomic##BITS##_fetch_or(volatile T* a, T v, int) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }   \
    extern "C" T __tsan_atomic##BITS##_fetch_xor(volatile T* a, T v, int) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); } \
    extern "C" T __tsan_atomic##BITS##_fetch_nand(volatile T* a, T v, int) {                                     \
        return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                                      \
    }                                                                                                            \
    extern "C" int __tsan_atomic##BITS##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {           \
        return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                  \
    }                                                                                                            \
    extern "C" int __tsan_atomic##BITS##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {             \
        return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                   \
    }                                                                                                            \
    extern "C" T __tsan_atomic##BITS##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                 \
        __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                        \
        return c;                                                                                                \
    }
LLMC_TRACE_ATOMICS(8, unsigned char)
LLMC_TRACE_ATOMICS(16, unsigned short)
LLMC_TRACE_ATOMICS(32, unsigned int)
LLMC_TRACE_ATOMICS(64, unsigned long long)
extern "C" void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
extern "C" void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
