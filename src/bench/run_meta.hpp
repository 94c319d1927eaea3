// Run metadata for runs.db: the build (git sha, build type, version), the
// host and the device as the backend describes it.
#pragma once

#include <string>

#include "bench/runs_db.hpp"

namespace kvq {
class Backend;
}

namespace kvq::bench {

// The source revision: `git rev-parse` in the source tree when git and the
// tree are there (with "-dirty" for uncommitted changes), else the revision
// recorded when the build was configured, else "unknown".
std::string git_sha();
// CMAKE_BUILD_TYPE of this build.
std::string build_type();
// "2024-05-01T12:34:56Z"
std::string utc_now();

// Everything RunMeta holds that does not depend on the run's parameters:
// build, host, and the backend's device name / driver / clocks. With
// measure_bandwidth the backend's copy bandwidth is measured (about a second
// on a GPU) and stored in copy_bw_gbs. The caller fills kind, model, params_json.
RunMeta collect_run_meta(Backend& backend, bool measure_bandwidth);

}  // namespace kvq::bench
