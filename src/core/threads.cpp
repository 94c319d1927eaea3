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

int default_thread_count() {
  const int cpus = usable_cpu_count();
  // /proc/loadavg: "0.52 0.58 0.59 3/1234 5678": 1-minute load, and runnable
  // threads now (this one included) over all threads.
  double load1 = 0.0;
  int runnable = 1, total = 0;
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    double l5, l15;
    if (std::fscanf(f, "%lf %lf %lf %d/%d", &load1, &l5, &l15, &runnable, &total) != 5) {
      load1 = 0.0;
      runnable = 1;
    }
    std::fclose(f);
  }
  return threads_for_load(cpus, load1, runnable);
}

int threads_for_load(int cpus, double load1, int runnable) {
  cpus = std::max(1, cpus);
  // Both measures must agree that a core is busy: the load average lags (it
  // remembers a build that just finished), the runnable count is a snapshot.
  const double others = std::max(0.0, std::min(load1, double(std::max(0, runnable - 1))));
  return std::clamp(cpus - int(std::lround(others)), 1, cpus);
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
