// emu_abi.h: the interface between the emulator runtime (runtime.cpp) and one compiled
// kernel translation unit (the generated <kernel>.cpp, which includes metal_shim.h).
#pragma once

#include <cstdint>

namespace emu {

struct u3 {
  uint32_t x, y, z;
};

// Values of the Metal thread-position attributes for one thread (MSL spec table 5.8).
struct ThreadAttrs {
  u3 thread_position_in_grid;
  u3 thread_position_in_threadgroup;
  u3 threadgroup_position_in_grid;
  u3 threads_per_threadgroup;
  u3 threadgroups_per_grid;
  u3 threads_per_grid;
  u3 grid_size;
  u3 grid_origin;
  u3 dispatch_threads_per_threadgroup;
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t thread_execution_width;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
};

// Buffers of one launch: inputs with MLX's optional shape / strides / ndim companions.
struct Buffers {
  int n_in;
  const void* const* in;
  const int* const* in_shape;
  const int64_t* const* in_strides;
  const int* in_ndim;
  void* const* out;
};

}  // namespace emu

extern "C" void emu_launch(const emu::Buffers* buffers, const emu::ThreadAttrs* attrs);
extern "C" void emu_threadgroup_barrier();
