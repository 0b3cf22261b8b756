// kvtier_pool (pool.h): the helpers, how they claim parts of a call, and how they wait.

#include "pool.h"

#include <ATen/Parallel.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace kvtier_pool {
namespace {

constexpr int64_t kSpinMicros = 500;      // a helper's spin after its last part, then sleep
constexpr int64_t kCallerSpinMicros = 20;  // the caller's spin for others' parts, then sleep
constexpr int64_t kPartsPerThread = 4;     // a late helper leaves the rest to the others

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

using Clock = std::chrono::steady_clock;

// The claim word: generation (32 bits) | parts (16) | next unclaimed part (16).
constexpr uint64_t kNextMask = 0xFFFF, kPartsShift = 16, kGenShift = 32;
inline uint32_t gen_of(uint64_t c) { return static_cast<uint32_t>(c >> kGenShift); }
inline int64_t parts_of(uint64_t c) { return static_cast<int64_t>((c >> kPartsShift) & kNextMask); }
inline int64_t next_of(uint64_t c) { return static_cast<int64_t>(c & kNextMask); }

struct Task {  // written by the caller before it publishes a generation; read-only after
  Body body = nullptr;
  const void* context = nullptr;
  int64_t begin = 0, end = 0, chunk = 0;
};

// Never freed: helpers may still spin on it while static objects are destroyed at exit.
struct Pool {
  std::mutex submit;  // held by the one caller using the helpers
  std::atomic<uint64_t> claim{0};
  std::atomic<int64_t> done{0};  // parts finished in the current generation
  Task task;
  uint32_t generation = 0;  // the caller's count (under submit)
  std::mutex sleep_lock;    // helpers waiting for a generation; the caller for the last part
  std::condition_variable wake, finished;
  std::atomic<int> sleepers{0};
  std::atomic<bool> caller_asleep{false};
  std::atomic<int> helpers{0};
  std::exception_ptr error;  // the first error of the current generation
  std::mutex error_lock;
};

std::atomic<Pool*> g_pool{new Pool()};
thread_local bool t_in_task = false;

void run_part(Pool* p, int64_t part) {
  const Task& t = p->task;
  const int64_t b = t.begin + part * t.chunk;
  if (b < t.end) {
    t_in_task = true;
    try {
      t.body(t.context, b, std::min(t.end, b + t.chunk));
    } catch (...) {
      std::lock_guard<std::mutex> g(p->error_lock);
      if (!p->error) p->error = std::current_exception();
    }
    t_in_task = false;
  }
}

// Claim and run parts of generation ``gen`` until none is left (or a newer one started).
void claim_parts(Pool* p, uint32_t gen) {
  uint64_t c = p->claim.load(std::memory_order_acquire);
  while (gen_of(c) == gen && next_of(c) < parts_of(c)) {
    if (!p->claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
    const int64_t parts = parts_of(c);
    run_part(p, next_of(c));
    if (p->done.fetch_add(1) + 1 == parts && p->caller_asleep.load()) {
      { std::lock_guard<std::mutex> g(p->sleep_lock); }
      p->finished.notify_one();
    }
    c = p->claim.load(std::memory_order_acquire);
  }
}

void helper_loop(Pool* p, uint32_t seen) {  // seen: the generation at its start
  for (;;) {
    const auto start = Clock::now();
    int64_t spins = 0;
    while (gen_of(p->claim.load(std::memory_order_acquire)) == seen) {
      relax();
      if (++spins % 64 != 0) continue;
      sched_yield();  // let a runnable thread on this core go first
      if (Clock::now() - start > std::chrono::microseconds(kSpinMicros)) {
        std::unique_lock<std::mutex> lock(p->sleep_lock);
        p->sleepers.fetch_add(1);
        p->wake.wait(lock, [&] { return gen_of(p->claim.load()) != seen; });
        p->sleepers.fetch_sub(1);
      }
    }
    seen = gen_of(p->claim.load(std::memory_order_acquire));
    claim_parts(p, seen);
  }
}

void grow(Pool* p, int wanted) {  // under p->submit
  for (int i = p->helpers.load(); i < wanted; ++i) {
    std::thread(helper_loop, p, gen_of(p->claim.load())).detach();
    p->helpers.store(i + 1);
  }
}

void after_fork_in_child() { g_pool.store(new Pool()); }  // the parent's helpers are gone

const bool g_registered = [] {
  pthread_atfork(nullptr, nullptr, after_fork_in_child);
  return true;
}();

}  // namespace

void run(int64_t begin, int64_t end, int64_t grain, Body body, const void* context) {
  if (begin >= end) return;
  const int threads = at::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
  if (end - begin <= grain || threads <= 1 || t_in_task) {
    body(context, begin, end);
    return;
  }
  Pool* p = g_pool.load();
  std::unique_lock<std::mutex> using_helpers(p->submit, std::try_to_lock);
  if (!using_helpers.owns_lock()) {  // another thread has the helpers: run serially here
    body(context, begin, end);
    return;
  }
  grow(p, threads - 1);
  const int64_t most = std::min<int64_t>(threads * kPartsPerThread, kNextMask);
  int64_t parts = std::min<int64_t>(most, (end - begin + grain - 1) / grain);
  const int64_t chunk = (end - begin + parts - 1) / parts;
  parts = (end - begin + chunk - 1) / chunk;  // none empty
  Task& t = p->task;
  t.body = body;
  t.context = context;
  t.begin = begin;
  t.end = end;
  t.chunk = chunk;
  p->error = nullptr;
  p->done.store(0);
  const uint32_t gen = ++p->generation;
  // seq_cst: a helper going to sleep sees the new generation or is counted in sleepers
  p->claim.store((uint64_t{gen} << kGenShift) | (static_cast<uint64_t>(parts) << kPartsShift));
  if (p->sleepers.load() > 0) {
    { std::lock_guard<std::mutex> g(p->sleep_lock); }
    p->wake.notify_all();
  }
  claim_parts(p, gen);
  // Parts a helper claimed: spin briefly, then sleep so that this core is free for it (a
  // helper pushed off its core by another process runs here sooner than it would there).
  const auto start = Clock::now();
  int64_t spins = 0;
  while (p->done.load(std::memory_order_acquire) != parts) {
    relax();
    if (++spins % 64 != 0) continue;
    if (Clock::now() - start > std::chrono::microseconds(kCallerSpinMicros)) {
      std::unique_lock<std::mutex> lock(p->sleep_lock);
      p->caller_asleep.store(true);
      p->finished.wait(lock, [&] { return p->done.load() == parts; });
      p->caller_asleep.store(false);
      break;
    }
  }
  if (p->error) std::rethrow_exception(p->error);
}

}  // namespace kvtier_pool
