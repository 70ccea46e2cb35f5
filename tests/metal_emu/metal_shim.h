// metal_shim.h: enough of the Metal Shading Language, as C++20, to compile the kernel
// sources that `mx.fast.metal_kernel` builds (body + generated signature) with g++.
//
// What is mapped, and how faithfully:
// - Address spaces `device`, `constant`, `thread` vanish: one flat CPU address space.
// - `threadgroup` declarations become `static`: one copy shared by every thread running
//   the kernel function. The runtime runs one threadgroup at a time, so that copy is exactly
//   the group's threadgroup memory (it is not cleared between groups; neither is Metal's).
//   Consequence: `threadgroup` works for variable declarations in the kernel body only,
//   not as a pointer qualifier in helper signatures (the selector kernels need neither).
// - Each thread of a group is a std::thread; threadgroup_barrier is a std::barrier over
//   the group (runtime.cpp). Barriers synchronize all memory (a superset of any mem_flags).
// - Attribute parameters (`[[thread_position_in_grid]]` ...) are ordinary parameters; g++
//   ignores the unknown attributes (-Wno-attributes) and the runtime passes the values.
// - float16_t / bfloat16_t / half are stored as float. The harness rounds inputs to the
//   real format before the launch, so every load sees exactly the Metal value; arithmetic
//   in these types would not round like the GPU, which is why kernels convert to float.
// - Vector types: plain structs with x, y, z, w and element-wise + - *.
// - metal:: math maps to <cmath>; max/min follow Metal (float: NaN-ignoring fmax/fmin).
// Not mapped: simdgroup functions, atomics, textures, half arithmetic rounding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "emu_abi.h"

#define device
#define constant
#define thread
#define threadgroup static

using uint = unsigned int;
using half = float;
using float16_t = float;
using bfloat16_t = float;

template <typename T>
struct vec2 {
  T x, y;
};
template <typename T>
struct vec3 {
  T x, y, z;
};
template <typename T>
struct vec4 {
  T x, y, z, w;
};

#define EMU_VEC_OPS(V, ...)                                                  \
  template <typename T>                                                      \
  V<T> operator+(V<T> a, V<T> b) { return V<T>{__VA_ARGS__(+)}; }            \
  template <typename T>                                                      \
  V<T> operator-(V<T> a, V<T> b) { return V<T>{__VA_ARGS__(-)}; }            \
  template <typename T>                                                      \
  V<T> operator*(V<T> a, V<T> b) { return V<T>{__VA_ARGS__(*)}; }
#define EMU_EL2(op) a.x op b.x, a.y op b.y
#define EMU_EL3(op) a.x op b.x, a.y op b.y, a.z op b.z
#define EMU_EL4(op) a.x op b.x, a.y op b.y, a.z op b.z, a.w op b.w
EMU_VEC_OPS(vec2, EMU_EL2)
EMU_VEC_OPS(vec3, EMU_EL3)
EMU_VEC_OPS(vec4, EMU_EL4)

using uint2 = vec2<uint>;
using uint3 = vec3<uint>;
using uint4 = vec4<uint>;
using int2 = vec2<int>;
using int3 = vec3<int>;
using int4 = vec4<int>;
using float2 = vec2<float>;
using float3 = vec3<float>;
using float4 = vec4<float>;

namespace metal {

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}
inline void threadgroup_barrier(mem_flags) { emu_threadgroup_barrier(); }

template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }

inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float abs(float x) { return std::fabs(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float tanh(float x) { return std::tanh(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
}  // namespace precise
namespace fast {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
}  // namespace fast
template <typename T>
using numeric_limits = std::numeric_limits<T>;

}  // namespace metal

// MLX's kernel preamble (utils.h -> bf16.h) opens the namespace for every custom kernel.
using namespace metal;
