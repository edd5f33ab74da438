/*
llmc/emulator/shim/sanitizer_python.cpp: a Python interpreter linked with a sanitizer runtime
(-fsanitize=thread, or address,undefined), so that the emulated device's sanitizer builds can be
loaded from Python: ThreadSanitizer must be in the executable, not preloaded into python3.
llmc/emulator/build.py (sanitizer_python) compiles it; it runs exactly as `python3 ARGS...`.

It also holds the one pool of OS threads on which the sanitizer builds of every kernel library
run their CUDA threads (llmc_emu_run_threads, exported with -rdynamic; called by the OS-thread
mode of emulator.cpp). A pool per library would keep the threads of every library alive at once:
~5,000 in a model run, 10 GB under ThreadSanitizer. The pool itself orders nothing that
ThreadSanitizer sees (futexes, in code it does not instrument): the caller says what CUDA orders.
*/
#include <Python.h>
#include <linux/futex.h>
#include <mutex>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>

#if defined(__SANITIZE_THREAD__)
#define NO_TSAN __attribute__((no_sanitize("thread")))
#else
#define NO_TSAN
#endif

namespace {

constexpr int MAX_THREADS = 1024;                // CUDA's most threads per block

void (*job_body)(int, void*);                    // the job in flight: job_body(k, job_context) on thread k
void* job_context;
int starts[MAX_THREADS];                         // futex per pool thread: the jobs it has been started for
int running;                                     // futex: threads of the job in flight not yet returned
int pool_size;
std::mutex& one_job_at_a_time = *new std::mutex;   // never destroyed: a thread may be inside at exit

NO_TSAN void futex_wait(int* word, int value) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, nullptr, nullptr, 0);
}
NO_TSAN void futex_wake(int* word) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0); }

NO_TSAN void pool_thread(int k) {
    for (int seen = 0;; seen++) {
        while (__atomic_load_n(&starts[k], __ATOMIC_ACQUIRE) == seen) futex_wait(&starts[k], seen);
        job_body(k, job_context);
        if (__atomic_sub_fetch(&running, 1, __ATOMIC_ACQ_REL) == 0) futex_wake(&running);
    }
}

}  // namespace

// body(k, context) for k = 0 .. n-1 (n <= 1024), each on its own thread of the pool, all at once;
// returns when every one has returned
extern "C" NO_TSAN void llmc_emu_run_threads(int n, void (*body)(int, void*), void* context) {
    if (n < 1 || n > MAX_THREADS) {
        fprintf(stderr, "llmc_emu_run_threads: %d threads (1 to %d)\n", n, MAX_THREADS);
        abort();
    }
    std::lock_guard<std::mutex> lock(one_job_at_a_time);
    while (pool_size < n) std::thread(pool_thread, pool_size++).detach();
    job_body = body;
    job_context = context;
    __atomic_store_n(&running, n, __ATOMIC_RELEASE);
    for (int k = 0; k < n; k++) {
        __atomic_add_fetch(&starts[k], 1, __ATOMIC_RELEASE);
        futex_wake(&starts[k]);
    }
    for (int r; (r = __atomic_load_n(&running, __ATOMIC_ACQUIRE)) != 0;) futex_wait(&running, r);
}

int main(int argc, char** argv) {
    wchar_t** wide = new wchar_t*[argc];
    for (int i = 0; i < argc; i++) {
        wide[i] = Py_DecodeLocale(argv[i], nullptr);
    }
    return Py_Main(argc, wide);
}
