// How many CPU threads the compute kernels use by default.
//
// All cores is the wrong default on a machine that is busy: the kernels'
// OpenMP regions end in barriers, so one thread that shares its core with
// another process (and is descheduled for a time slice) stalls every region.
// On a 2-core machine with one core busy, two threads decoded the embedded
// model 60x slower than one. So the default counts only the cores nobody else
// is using when kvq starts (a core kept busy by a process that starts later
// still slows kvq down; --threads 1 is the answer there).
#pragma once

namespace kvq {

// Cores this process may run on: the CPU affinity mask (taskset, cpusets),
// further limited by a cgroup v2 CPU quota (containers) when one is set.
int usable_cpu_count();

// usable_cpu_count() minus the cores other processes keep busy: the fewest
// runnable threads other than this one over a few samples ~10 ms long, at least 1.
int default_thread_count();
// The rule itself: cpus usable cores, `runnable` threads runnable throughout
// (this one included).
int threads_for_load(int cpus, int runnable);

// Sets the OpenMP thread count for the calling thread's later parallel
// regions: n > 0 as given; n == 0: $OMP_NUM_THREADS when set, else
// default_thread_count(). Returns the count in effect.
int set_thread_count(int n);

}  // namespace kvq
