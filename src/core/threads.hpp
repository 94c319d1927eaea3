// How many CPU threads the compute kernels use by default.
//
// All cores is the wrong default on a machine that is busy: the kernels'
// OpenMP regions end in barriers, so one thread that shares its core with
// another process (and is descheduled for a time slice) stalls every region.
// On a 2-core machine with one core busy, two threads decoded the embedded
// model 60x slower than one. So the default counts only the cores nobody else
// is using when kvq starts.
#pragma once

namespace kvq {

// Cores this process may run on: the CPU affinity mask (taskset, cpusets),
// further limited by a cgroup v2 CPU quota (containers) when one is set.
int usable_cpu_count();

// usable_cpu_count() minus the cores other processes keep busy (the smaller of
// the 1-minute load average and the number of runnable threads other than this
// one, rounded to nearest), at least 1.
int default_thread_count();
// The rule itself: cpus usable cores, 1-minute load average load1, and
// `runnable` threads runnable now (this one included).
int threads_for_load(int cpus, double load1, int runnable);

// Sets the OpenMP thread count for the calling thread's later parallel
// regions: n > 0 as given; n == 0: $OMP_NUM_THREADS when set, else
// default_thread_count(). Returns the count in effect.
int set_thread_count(int n);

}  // namespace kvq
