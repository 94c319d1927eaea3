// Host entry points of the test-only kernels in rotation_test_kernels.cu
// (kept out of the GoogleTest sources, which are plain C++).
#pragma once

#include "backend/cuda/kv_store.hpp"

namespace kvq::gputest {

// y[r] = R x[r] (inverse: R^T x[r]) for n rows of D floats (device memory),
// one warp per row through cuda::warp_rotate_row; table: the device rotation
// table (kv::Rotation::table()). via_shared: the row is copied into shared
// memory and rotated in place there (the decode kernel's use), else rotated
// from global x into global y. Synchronous.
void rotate_rows_on_gpu(cuda::RotationKind kind, const float* table, const float* x, float* y, int n, int D,
                        bool inverse, bool via_shared);

}  // namespace kvq::gputest
