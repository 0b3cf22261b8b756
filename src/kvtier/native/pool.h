// kvtier's own thread pool for its CPU operators: parallel_for(begin, end, grain, f) run by
// the calling thread and helper threads that spin between calls. The range is cut into up to
// 4 parts a thread (each at least grain, contiguous) that the caller and the helpers claim
// as they come: a helper that wakes late, or that another process pushed off its core,
// leaves its parts to the others, and a caller with nothing left to claim sleeps after a
// short spin so that its core is free for the helper it waits for. Which thread runs a part
// never changes its result (every operator computes each output item on one thread).
//
// Why not torch's OpenMP pool: kvtier's engine runs its steps on a worker thread, not the
// process's first thread, and libgomp then counts more threads than CPUs on a 2-core
// machine and lets its idle workers spin only ~100 iterations before sleeping in the
// kernel, so every parallel region pays a futex wake-up. Measured on the 2-core AMD EPYC
// (one 576 x 576 projection, one row, 5,000 calls): 14-18 us a call from the first thread,
// 84-113 us from any other (one thread: 23-26 us). A decode step has ~270 such regions.
// Here each helper spins up to 0.5 ms after its last part (yielding the core to any other
// runnable thread while it does), then sleeps until the next call. A static split (one
// part a thread, the caller spinning until each is done) took 100-230 ms instead of 11-18
// for 60 one-row projections while a busy loop held one of the two cores. (Since
// kvtier.engine.openmp lets the engine's constructing thread's OpenMP helpers exit, the
// worker no longer sees that count; this pool was not measured against torch's since.)
//
// Prefill-sized work stays on torch's pool (parallel_for_rows).
//
// Thread-safety: any thread may call parallel_for; one call uses the helpers at a time and
// a concurrent one (or one nested inside a task) runs serially on its own thread. Helpers
// are started on first use, grow with torch's thread count and are never stopped; a forked
// child starts its own. An exception thrown by f on any thread is rethrown to the caller.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace kvtier_pool {

using Body = void (*)(const void* context, int64_t begin, int64_t end);

void run(int64_t begin, int64_t end, int64_t grain, Body body, const void* context);

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  run(begin, end, grain,
      [](const void* context, int64_t b, int64_t e) { (*static_cast<const F*>(context))(b, e); },
      &f);
}

constexpr int64_t kPoolRows = 64;

// For an operator over ``rows`` token rows: kvtier's helpers up to kPoolRows rows (a decode
// step's, where waking OpenMP's workers costs more than the work), torch's OpenMP pool
// above (a prefill step's, whose regions are long and whose neighbours are oneDNN's
// matmuls on that pool, which spinning helpers would slow).
template <typename F>
inline void parallel_for_rows(int64_t rows, int64_t begin, int64_t end, int64_t grain,
                              const F& f) {
  if (rows <= kPoolRows) {
    parallel_for(begin, end, grain, f);
  } else {
    at::parallel_for(begin, end, grain, f);
  }
}

}  // namespace kvtier_pool
