// A small work-claiming thread pool shared by the C++ CPU kernels of one library (the quantized
// matmuls, the norm/rotary/SiLU/attention ops), in place of an OpenMP parallel region per call.
//
// Why: a decode step makes ~250 kernel calls of a few to a few hundred microseconds each. An
// OpenMP region splits the work statically and ends in a barrier, so every call waits for every
// thread it split to: when another process holds the second core (a shared or loaded machine, or
// the server's own tokenizer processes), each call waits a scheduler time slice for a descheduled
// thread (measured: 11 ms per GEMV, 50x the single-thread time). Here the caller publishes a job
// of `n` chunks and claims chunks itself, next to the workers that are awake; a call returns when
// every chunk is done, so a worker that wakes late finds nothing left and is never waited for.
// The worst case is the single-thread time, the idle case the all-threads one.
//
// Workers spin for SPIN_US after their last chunk (a decode step's calls come tens of us apart),
// yielding the core between checks after YIELD_US, then sleep on a condition variable; a job
// wakes sleepers, but does not wait for them.
// One pool per process: each library that includes this header has its own Pool object, so a
// library can adopt another's (`adopt`): the quantized matmuls run on the CPU-kernels library's
// pool (kernels/cpu_quant.py: share_pool), or a decode step would keep two workers spinning after
// alternate calls on a 2-core machine, each taking turns on the core the other's job wants.
// Built with the library's default flags (no ISA target): include it from the dispatch files only.
#pragma once
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define MINISGL_POOL_PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define MINISGL_POOL_PAUSE() asm volatile("yield")
#else
#define MINISGL_POOL_PAUSE() ((void)0)
#endif

namespace minisgl_pool {

// fn(ctx, chunk): one chunk of a job, on the caller's thread or a worker's.
using ChunkFn = void (*)(void* ctx, int64_t chunk);

constexpr int64_t SPIN_US = 300, YIELD_US = 30;

class Pool {
 public:
  // The process's pool for this library, created at first use (and again in a forked child:
  // its workers are not copied by fork).
  static Pool& get() {
    static std::once_flag once;
    std::call_once(once, [] { pthread_atfork(nullptr, nullptr, [] { instance() = nullptr; }); });
    Pool*& p = instance();
    if (p == nullptr) p = new Pool();  // never freed: workers may still be parked at exit
    return *p;
  }

  // fn(ctx, c) for every c in [0, n), on the caller and up to nthreads - 1 workers.
  void run(int64_t n, int nthreads, ChunkFn fn, void* ctx) {
    if (n <= 0) return;
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (nthreads <= 1 || n == 1 || !busy.owns_lock() || n >= (int64_t{1} << 31)) {
      // One thread asked, one chunk, or another caller's job in flight: this thread does it all.
      for (int64_t c = 0; c < n; ++c) fn(ctx, c);
      return;
    }
    ensure_workers(nthreads - 1);
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    want_.store(nthreads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t job = ++job_;
    state_.store(job << 32, std::memory_order_seq_cst);  // publishes the fields above
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mutex_);
      cv_.notify_all();
    }
    const int64_t mine = work(job);
    // The chunks claimed by workers: only those already running are waited for.
    while (done_.load(std::memory_order_acquire) + mine < n) MINISGL_POOL_PAUSE();
  }

 private:
  static Pool*& instance() {
    static Pool* p = nullptr;
    return p;
  }

  // Claims and runs chunks of `job` until none is left; returns how many it ran.
  int64_t work(uint64_t job) {
    int64_t ran = 0;
    for (;;) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if ((s >> 32) != job) return ran;
      const ChunkFn fn = fn_.load(std::memory_order_relaxed);
      void* ctx = ctx_.load(std::memory_order_relaxed);
      const int64_t n = n_.load(std::memory_order_relaxed);
      const int64_t c = static_cast<int64_t>(s & 0xffffffffu);
      if (c >= n) return ran;
      // The claim names the job: a worker late from an earlier job cannot take this one's chunk
      // with that job's fields (they are rewritten only after every chunk of a job is done).
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      fn(ctx, c);
      ++ran;
      if (worker_) done_.fetch_add(1, std::memory_order_release);
    }
  }

  void ensure_workers(int count) {
    while (static_cast<int>(workers_) < count) {
      const int index = workers_++;
      std::thread([this, index] { loop(index); }).detach();
    }
  }

  void loop(int index) {
    worker_ = true;
    uint64_t seen = job_at_start();
    auto last = std::chrono::steady_clock::now();
    for (int spins = 0;;) {
      const uint64_t job = state_.load(std::memory_order_acquire) >> 32;
      if (job != seen) {
        seen = job;
        if (index < want_.load(std::memory_order_relaxed)) work(job);
        last = std::chrono::steady_clock::now();
        spins = 0;
        continue;
      }
      if (++spins % 64 != 0) {
        MINISGL_POOL_PAUSE();
        continue;
      }
      const auto idle = std::chrono::steady_clock::now() - last;
      if (idle < std::chrono::microseconds(SPIN_US)) {
        // Past the first YIELD_US, give the core to any other runnable thread between checks
        // (torch's own OpenMP workers, whose barriers do wait for every thread).
        if (idle >= std::chrono::microseconds(YIELD_US)) std::this_thread::yield();
        continue;
      }
      std::unique_lock<std::mutex> lk(mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait(lk, [&] { return (state_.load(std::memory_order_seq_cst) >> 32) != seen; });
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  uint64_t job_at_start() const { return state_.load(std::memory_order_acquire) >> 32; }

  static inline thread_local bool worker_ = false;  // set on the pool's own threads
  std::atomic<uint64_t> state_{0};  // (job << 32) | next unclaimed chunk
  std::atomic<ChunkFn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0};
  std::atomic<int> want_{0};  // workers 0 .. want_ - 1 take part in the current job
  std::atomic<int64_t> done_{0};  // chunks finished by workers in the current job
  std::atomic<int> sleepers_{0};
  std::atomic<int> workers_{0};
  uint64_t job_ = 0;  // written by the caller holding run_mutex_ only
  std::mutex run_mutex_, mutex_;
  std::condition_variable cv_;
};

// Runs a job on some library's pool: this one's own (`run_here`), or the one adopted.
using RunFn = void (*)(int64_t n, int nthreads, ChunkFn fn, void* ctx);

inline void run_here(int64_t n, int nthreads, ChunkFn fn, void* ctx) { Pool::get().run(n, nthreads, fn, ctx); }

inline std::atomic<RunFn>& adopted() {
  static std::atomic<RunFn> fn{nullptr};
  return fn;
}

// This library's jobs go to `fn`'s pool from now on (another library's run_here; nullptr: its own).
// A job in flight on the previous pool finishes there.
inline void adopt(RunFn fn) { adopted().store(fn == run_here ? nullptr : fn, std::memory_order_release); }

inline void run(int64_t n, int nthreads, ChunkFn fn, void* ctx) {
  const RunFn other = adopted().load(std::memory_order_acquire);
  if (other != nullptr) {
    other(n, nthreads, fn, ctx);
  } else {
    run_here(n, nthreads, fn, ctx);
  }
}

// fn(begin, end) over [0, n) in chunks of `grain` (the last one shorter), on up to nthreads threads.
template <typename Fn>
inline void parallel_chunks(int64_t n, int64_t grain, int nthreads, const Fn& fn) {
  if (n <= 0) return;
  grain = grain < 1 ? 1 : grain;
  struct Ctx {
    const Fn* fn;
    int64_t n, grain;
  } ctx{&fn, n, grain};
  run((n + grain - 1) / grain, nthreads, [](void* p, int64_t c) {
    const Ctx& x = *static_cast<const Ctx*>(p);
    const int64_t b = c * x.grain, e = b + x.grain < x.n ? b + x.grain : x.n;
    (*x.fn)(b, e);
  }, &ctx);
}

}  // namespace minisgl_pool
