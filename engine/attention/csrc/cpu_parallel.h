// How our kernels split their work over threads: how much a parallel task of the elementwise
// kernels gets (below it, waking another thread costs more than it saves), and the team in which a
// decode step's kernels share one OpenMP region.

#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <atomic>

namespace pdserve_parallel {

// Whether OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, as `pdserve up` sets for engines
// that share cores) rather than spin for a while (the default). Read once: the runtime reads it once.
inline bool threads_sleep() {
  static const bool sleep = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    std::string p = policy != nullptr ? policy : "";
    std::transform(p.begin(), p.end(), p.begin(), [](unsigned char c) { return std::tolower(c); });
    return p == "passive";
  }();
  return sleep;
}

// Items per task, for items of `item_elems` elements each: about 8K elements where idle threads
// spin, 32K (torch's own grain) where they sleep. On a 2-core Zen 5 EPYC, in a bfloat16 decode step
// of 16 rows, 8K made SiLU·mul 1.7x and the residual-add RMSNorm 1.25x faster, and the step
// 1-4% faster, with spinning threads; with sleeping ones the same split made the step 1.2x slower
// (each region woke a thread: about 40 us).
inline int64_t grain(int64_t item_elems) {
  const int64_t per_task = threads_sleep() ? 32768 : 8192;
  return std::max<int64_t>(1, per_task / std::max<int64_t>(item_elems, 1));
}

// ---- One region for many ops ----------------------------------------------------------------
//
// A decode step's layers are about ten ops each, and each op's at::parallel_for opens an OpenMP
// region of its own: the main thread wakes the pool, runs its share, waits for the others, then
// alone goes through the dispatcher, the next op's checks and allocations while the pool spins.
// cpu_decode_step.cpp's one-region loop instead runs every op of the step inside one region (a
// "team"): each thread walks the same ops, takes its share of each, and meets the others at a
// barrier before the next. The kernels split their work through pdserve_parallel::parallel_for,
// which outside a team is at::parallel_for itself.

// A team's barrier: a count of arrivals and a generation each completed barrier moves on.
struct TeamBarrier {
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<unsigned> generation{0};
};

// The barrier of the team this thread is in, or null outside one. A function-local thread_local:
// one per thread across the library's files.
inline TeamBarrier*& team() {
  static thread_local TeamBarrier* barrier = nullptr;
  return barrier;
}

inline bool in_team() { return team() != nullptr; }

// Makes this thread a member of the team of `barrier` for its scope (inside `#pragma omp parallel`,
// one barrier shared by the region's threads).
struct TeamMember {
  explicit TeamMember(TeamBarrier* barrier) { team() = barrier; }
  ~TeamMember() { team() = nullptr; }
  TeamMember(const TeamMember&) = delete;
  TeamMember& operator=(const TeamMember&) = delete;
};

// Every member waits here until all have arrived. Where idle threads spin (the default), on our own
// counter: OpenMP's barrier made whole bfloat16 decode steps 1.01-1.02x slower at 16 rows on the
// 2-core AMX Xeon (alternated in one process; float32 level). Where they sleep
// (OMP_WAIT_POLICY=PASSIVE, engines sharing cores), on OpenMP's, which sleeps too.
inline void team_wait() {
  if (threads_sleep()) {
#pragma omp barrier
    return;
  }
  TeamBarrier& b = *team();
  const int n = omp_get_num_threads();
  const unsigned generation = b.generation.load(std::memory_order_acquire);
  if (b.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
    b.arrived.store(0, std::memory_order_relaxed);
    b.generation.fetch_add(1, std::memory_order_release);
    return;
  }
  while (b.generation.load(std::memory_order_acquire) == generation) _mm_pause();
}

// Threads that will share the next parallel_for: the team's, or torch's pool.
inline int64_t threads() {
  return in_team() ? omp_get_num_threads() : std::max(1, at::get_num_threads());
}

// f(b, e) over [begin, end) split among threads as at::parallel_for splits it (at most
// ceil(n / grain) threads, contiguous chunks in thread order). In a team, every member must call it
// (a member with no chunk too): it ends at a barrier, after which every chunk is done.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (!in_team()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (begin < end) {
    const int64_t n = end - begin;
    int64_t workers = omp_get_num_threads();
    if (grain > 0) workers = std::min(workers, (n + grain - 1) / grain);
    const int64_t chunk = (n + workers - 1) / workers;
    const int64_t first = begin + omp_get_thread_num() * chunk;
    if (first < end) f(first, std::min(end, first + chunk));
  }
  team_wait();
}

}  // namespace pdserve_parallel
