// kvtier_pool (pool.h): the helpers, their hand-off and their idle spin.

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

constexpr int64_t kSpinMicros = 500;  // a helper's spin after its last task, then sleep

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

struct Task {
  Body body = nullptr;
  const void* context = nullptr;
  int64_t begin = 0, end = 0, chunk = 0;
  int parts = 0;
};

// Never freed: helpers may still spin on it while static objects are destroyed at exit.
struct Pool {
  std::mutex submit;  // held by the one caller using the helpers
  std::mutex sleep_lock;
  std::condition_variable wake;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> pending{0};   // helpers yet to finish the current generation
  std::atomic<int> sleepers{0};
  std::atomic<int> helpers{0};
  Task task;                      // written by the caller before the generation moves
  std::exception_ptr error;       // the first helper error of the current generation
  std::mutex error_lock;
};

std::atomic<Pool*> g_pool{new Pool()};
thread_local bool t_in_task = false;

void run_part(Pool* p, const Task& t, int part) {
  const int64_t b = t.begin + part * t.chunk;
  if (part >= t.parts || b >= t.end) return;
  t_in_task = true;
  try {
    t.body(t.context, b, std::min(t.end, b + t.chunk));
  } catch (...) {
    std::lock_guard<std::mutex> g(p->error_lock);
    if (!p->error) p->error = std::current_exception();
  }
  t_in_task = false;
}

void helper_loop(Pool* p, int index, uint64_t seen) {  // seen: the generation at its start
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    int64_t spins = 0;
    while (p->generation.load(std::memory_order_acquire) == seen) {
      relax();
      if (++spins % 64 != 0) continue;
      sched_yield();  // let a runnable thread on this core go first
      const auto idle = std::chrono::steady_clock::now() - start;
      if (idle > std::chrono::microseconds(kSpinMicros)) {
        std::unique_lock<std::mutex> lock(p->sleep_lock);
        p->sleepers.fetch_add(1);
        p->wake.wait(lock, [&] { return p->generation.load() != seen; });
        p->sleepers.fetch_sub(1);
      }
    }
    seen = p->generation.load(std::memory_order_acquire);
    run_part(p, p->task, index);
    p->pending.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void grow(Pool* p, int wanted) {  // under p->submit
  for (int i = p->helpers.load(); i < wanted; ++i) {
    std::thread(helper_loop, p, i + 1, p->generation.load()).detach();
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
  const int helpers = p->helpers.load();
  Task& t = p->task;
  t.body = body;
  t.context = context;
  t.begin = begin;
  t.end = end;
  t.parts = static_cast<int>(std::min<int64_t>(helpers + 1, (end - begin + grain - 1) / grain));
  t.chunk = (end - begin + t.parts - 1) / t.parts;
  p->error = nullptr;
  p->pending.store(helpers, std::memory_order_release);
  p->generation.fetch_add(1);  // seq_cst: a helper going to sleep sees it or is counted
  if (p->sleepers.load() > 0) {
    { std::lock_guard<std::mutex> g(p->sleep_lock); }
    p->wake.notify_all();
  }
  run_part(p, t, 0);
  while (p->pending.load(std::memory_order_acquire) != 0) relax();
  if (p->error) std::rethrow_exception(p->error);
}

}  // namespace kvtier_pool
