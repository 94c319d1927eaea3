#include "core/threads.hpp"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace kvq {

int usable_cpu_count() {
  int n = 0;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
  if (n <= 0) n = int(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  // cgroup v2: "max 100000" (no quota) or "<quota> <period>".
  std::ifstream in("/sys/fs/cgroup/cpu.max");
  std::string quota;
  long period = 0;
  if (in >> quota >> period && quota != "max" && period > 0) {
    const long q = std::atol(quota.c_str());
    if (q > 0) n = std::min(n, int(std::max(1L, (q + period - 1) / period)));
  }
  return std::max(1, n);
}

namespace {

// Runnable threads on the machine now, this one included: the "3" of
// /proc/loadavg's "0.52 0.58 0.59 3/1234 5678". 0 when unknown.
int runnable_now() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return 0;
  double l1, l5, l15;
  int running = 0, total = 0;
  if (std::fscanf(f, "%lf %lf %lf %d/%d", &l1, &l5, &l15, &running, &total) != 5) running = 0;
  std::fclose(f);
  return running;
}

}  // namespace

int default_thread_count() {
  // The fewest runnable threads over a few samples 2 ms apart: a process that
  // keeps a core busy is runnable in every sample, a passing one is not. (The
  // load average is no help: it lags by a minute both ways.)
  int fewest = 0;
  for (int i = 0; i < 5; ++i) {
    const int r = runnable_now();
    if (r <= 0) return usable_cpu_count();
    fewest = i == 0 ? r : std::min(fewest, r);
    if (fewest <= 1) break;
    ::usleep(2000);
  }
  return threads_for_load(usable_cpu_count(), fewest);
}

int threads_for_load(int cpus, int runnable) {
  cpus = std::max(1, cpus);
  const int others = std::max(0, runnable - 1);  // minus this thread
  return std::clamp(cpus - others, 1, cpus);
}

int set_thread_count(int n) {
  if (n <= 0) {
    const char* env = std::getenv("OMP_NUM_THREADS");
    if (env && *env) return omp_get_max_threads();  // the user's choice, already applied by OpenMP
    n = default_thread_count();
  }
  omp_set_num_threads(n);
  return n;
}

}  // namespace kvq
