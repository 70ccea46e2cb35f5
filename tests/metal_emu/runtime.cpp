// runtime.cpp: runs one emulated Metal dispatch (dispatchThreads semantics) on the CPU.
//
// usage: <kernel-binary> META IN OUT
//   META  text:  "grid gx gy gz" / "threadgroup tx ty tz" / "inputs N" then per input
//                "<elem_bytes> <ndim> <d0> ..." / "outputs M" then per output
//                "<elem_bytes> <count> <fill: poison|float|int> <value>"
//   IN    the inputs' row-contiguous bytes, concatenated in order
//   OUT   written: the outputs' bytes, concatenated in order
// Threadgroups run one after another (metal_shim.h maps threadgroup memory to statics);
// the threads of a group run concurrently as std::threads meeting at a std::barrier.
// Outputs without a fill value start as 0xFF bytes (NaN / -1), so unwritten cells show.

#include <barrier>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "emu_abi.h"

namespace {

thread_local std::barrier<>* group_barrier = nullptr;

struct Launch {
  emu::u3 grid{}, group{};
  std::vector<std::vector<int>> shapes;
  std::vector<std::vector<int64_t>> strides;
  std::vector<int> ndims;
  std::vector<std::vector<char>> in, out;
};

void expect(std::istream& s, const char* word) {
  std::string got;
  s >> got;
  if (got != word) throw std::runtime_error(std::string("meta: expected ") + word + ", got " + got);
}

std::vector<char> read_bytes(std::istream& s, size_t n) {
  std::vector<char> buf(n);
  s.read(buf.data(), static_cast<std::streamsize>(n));
  if (static_cast<size_t>(s.gcount()) != n) throw std::runtime_error("input data is short");
  return buf;
}

void fill(std::vector<char>& buf, size_t elem, const std::string& kind, double value) {
  if (kind == "poison") {
    std::memset(buf.data(), 0xFF, buf.size());
    return;
  }
  for (size_t k = 0; k < buf.size(); k += elem) {
    if (kind == "float" && elem == 4) {
      float v = static_cast<float>(value);
      std::memcpy(&buf[k], &v, 4);
    } else if (kind == "int" && elem == 4) {
      int32_t v = static_cast<int32_t>(value);
      std::memcpy(&buf[k], &v, 4);
    } else {
      throw std::runtime_error("unsupported output fill " + kind);
    }
  }
}

Launch read_launch(const char* meta_path, const char* in_path) {
  Launch run;
  std::ifstream meta(meta_path);
  std::ifstream data(in_path, std::ios::binary);
  expect(meta, "grid");
  meta >> run.grid.x >> run.grid.y >> run.grid.z;
  expect(meta, "threadgroup");
  meta >> run.group.x >> run.group.y >> run.group.z;
  int n_in = 0, n_out = 0;
  expect(meta, "inputs");
  meta >> n_in;
  for (int k = 0; k < n_in; ++k) {
    size_t elem = 0;
    int ndim = 0;
    meta >> elem >> ndim;
    std::vector<int> shape(ndim);
    size_t count = 1;
    for (auto& d : shape) {
      meta >> d;
      count *= static_cast<size_t>(d);
    }
    std::vector<int64_t> stride(ndim);
    int64_t step = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      stride[d] = step;
      step *= shape[d];
    }
    run.shapes.push_back(shape);
    run.strides.push_back(stride);
    run.ndims.push_back(ndim);
    run.in.push_back(read_bytes(data, elem * count));
  }
  expect(meta, "outputs");
  meta >> n_out;
  for (int k = 0; k < n_out; ++k) {
    size_t elem = 0, count = 0;
    std::string kind;
    double value = 0;
    meta >> elem >> count >> kind >> value;
    run.out.emplace_back(elem * count);
    fill(run.out.back(), elem, kind, value);
  }
  if (!meta) throw std::runtime_error("meta file is malformed");
  return run;
}

uint32_t groups(uint32_t grid, uint32_t group) { return (grid + group - 1) / group; }

emu::ThreadAttrs attrs_for(const Launch& run, emu::u3 g, emu::u3 size, emu::u3 local) {
  const emu::u3 dispatch = run.group;
  emu::ThreadAttrs a{};
  a.thread_position_in_threadgroup = local;
  a.threadgroup_position_in_grid = g;
  a.thread_position_in_grid = {g.x * dispatch.x + local.x, g.y * dispatch.y + local.y,
                               g.z * dispatch.z + local.z};
  a.threads_per_threadgroup = size;
  a.dispatch_threads_per_threadgroup = dispatch;
  a.threadgroups_per_grid = {groups(run.grid.x, dispatch.x), groups(run.grid.y, dispatch.y),
                             groups(run.grid.z, dispatch.z)};
  a.threads_per_grid = run.grid;
  a.grid_size = run.grid;
  a.grid_origin = {0, 0, 0};
  const uint32_t n = size.x * size.y * size.z;
  const uint32_t index = local.x + size.x * (local.y + size.y * local.z);
  a.thread_index_in_threadgroup = index;
  a.threads_per_simdgroup = 32;
  a.thread_execution_width = 32;
  a.thread_index_in_simdgroup = index % 32;
  a.simdgroup_index_in_threadgroup = index / 32;
  a.simdgroups_per_threadgroup = (n + 31) / 32;
  a.dispatch_simdgroups_per_threadgroup = a.simdgroups_per_threadgroup;
  a.thread_index_in_quadgroup = index % 4;
  a.quadgroup_index_in_threadgroup = index / 4;
  a.quadgroups_per_threadgroup = (n + 3) / 4;
  a.dispatch_quadgroups_per_threadgroup = a.quadgroups_per_threadgroup;
  return a;
}

void run_group(const Launch& run, const emu::Buffers& buffers, emu::u3 g) {
  // Metal's dispatchThreads: the last group along a dimension may be partial.
  const emu::u3 size = {std::min(run.group.x, run.grid.x - g.x * run.group.x),
                        std::min(run.group.y, run.grid.y - g.y * run.group.y),
                        std::min(run.group.z, run.grid.z - g.z * run.group.z)};
  const size_t n = size_t(size.x) * size.y * size.z;
  std::barrier<> barrier(static_cast<std::ptrdiff_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (uint32_t z = 0; z < size.z; ++z)
    for (uint32_t y = 0; y < size.y; ++y)
      for (uint32_t x = 0; x < size.x; ++x) {
        const emu::ThreadAttrs attrs = attrs_for(run, g, size, {x, y, z});
        threads.emplace_back([&buffers, &barrier, attrs] {
          group_barrier = &barrier;
          emu_launch(&buffers, &attrs);
        });
      }
  for (auto& t : threads) t.join();
}

}  // namespace

extern "C" void emu_threadgroup_barrier() { group_barrier->arrive_and_wait(); }

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s META IN OUT\n", argv[0]);
    return 2;
  }
  try {
    Launch run = read_launch(argv[1], argv[2]);
    // MLX clamps the threadgroup to the grid before dispatching.
    run.group = {std::min(run.group.x, run.grid.x), std::min(run.group.y, run.grid.y),
                 std::min(run.group.z, run.grid.z)};
    std::vector<const void*> in_ptrs;
    std::vector<const int*> shape_ptrs;
    std::vector<const int64_t*> stride_ptrs;
    std::vector<void*> out_ptrs;
    for (size_t k = 0; k < run.in.size(); ++k) {
      in_ptrs.push_back(run.in[k].data());
      shape_ptrs.push_back(run.shapes[k].data());
      stride_ptrs.push_back(run.strides[k].data());
    }
    for (auto& o : run.out) out_ptrs.push_back(o.data());
    const emu::Buffers buffers{static_cast<int>(in_ptrs.size()), in_ptrs.data(), shape_ptrs.data(),
                               stride_ptrs.data(), run.ndims.data(), out_ptrs.data()};
    const emu::u3 n = {groups(run.grid.x, run.group.x), groups(run.grid.y, run.group.y),
                       groups(run.grid.z, run.group.z)};
    for (uint32_t z = 0; z < n.z; ++z)
      for (uint32_t y = 0; y < n.y; ++y)
        for (uint32_t x = 0; x < n.x; ++x) run_group(run, buffers, {x, y, z});
    std::ofstream out(argv[3], std::ios::binary);
    for (auto& o : run.out) out.write(o.data(), static_cast<std::streamsize>(o.size()));
    return out ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emulator: %s\n", e.what());
    return 1;
  }
}
