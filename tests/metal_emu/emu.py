"""Run `mx.fast.metal_kernel` sources on a CPU: a C++ emulation for machines without Metal.

`metal_kernel(...)` takes the arguments of `mx.fast.metal_kernel` and returns an object
with the call signature of MLX's kernel object. A call writes the complete kernel source
exactly as MLX does (header, generated signature, body, template instantiation; see
`kernel_source`, which mirrors `write_signature` in mlx/backend/common/metal_kernel.cpp),
compiles it with g++ against metal_shim.h, and runs the dispatch with runtime.cpp: every
threadgroup's threads as std::threads meeting at std::barrier. Binaries are cached per
source text for the life of the process.

float16 / bfloat16 inputs travel as float32 holding the exact half/bf16 values (the shim
stores these types as float), so every load in the kernel sees the GPU's value.
"""

from __future__ import annotations

import atexit
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
CXX_FLAGS = ("-O1", "-pthread", "-Wall", "-Wno-attributes", "-Wno-unused-variable")
KERNEL_STD = "-std=c++14"  # the Metal Shading Language is C++14-based: no later features slip in
RUNTIME_STD = "-std=c++20"  # std::barrier
RUN_TIMEOUT_S = 120  # a barrier reached by only part of a group deadlocks; fail instead

# MLX's get_type_string, and how the shim stores each type.
TYPE_STRINGS = {
    mx.float32: ("float", np.float32), mx.float16: ("float16_t", np.float32),
    mx.bfloat16: ("bfloat16_t", np.float32), mx.int32: ("int32_t", np.int32),
    mx.uint32: ("uint32_t", np.uint32), mx.int64: ("int64_t", np.int64), mx.uint64: ("uint64_t", np.uint64),
    mx.int16: ("int16_t", np.int16), mx.uint16: ("uint16_t", np.uint16), mx.int8: ("int8_t", np.int8),
    mx.uint8: ("uint8_t", np.uint8), mx.bool_: ("bool", np.bool_),
}
# The attributes MLX declares when their name occurs in the body, in MLX's order.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
)
MAX_CONSTANT_ARRAY_SIZE = 8  # smaller inputs go to the `constant` address space


def type_string(dtype) -> str:
    if dtype not in TYPE_STRINGS:
        raise ValueError(f"the emulator does not handle dtype {dtype}")
    return TYPE_STRINGS[dtype][0]


def _template_value(value) -> str:
    if isinstance(value, bool):  # before int: bool is an int in Python
        return str(int(value))  # MLX streams a bool without std::boolalpha
    if isinstance(value, int):
        return str(value)
    return type_string(value)


def _template_kind(value) -> str:
    return "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "typename"


def kernel_name(name: str, template, inputs, output_dtypes) -> str:
    """MLX's name: custom_kernel_<name>[_<template hash>] + input and output type tags."""
    out = f"custom_kernel_{name}"
    if template:
        args = ", ".join(_template_value(v) for _, v in template)
        out += "_" + f"_{args}_".replace(", ", "_")[:-1]
    for arr in inputs:
        out += "_" + type_string(arr.dtype) + ("s" if arr.ndim == 0
                                               else "c" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "")
    for dtype in output_dtypes:
        out += "_" + type_string(dtype)
    return out


def shape_infos(source: str, input_names) -> list[tuple[bool, bool, bool]]:
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def attributes(source: str) -> list[tuple[str, str]]:
    return [(attr, kind) for attr, kind in METAL_ATTRIBUTES if attr in source]


def kernel_source(func: str, header: str, source: str, input_names, inputs, output_names, output_dtypes,
                  template) -> str:
    """The text MLX compiles: header + generated signature + body (+ template instantiation)."""
    text = header
    if template:
        text += "template <" + ", ".join(f"{_template_kind(v)} {n}" for n, v in template) + ">\n"
    text += f"[[kernel]] void {func}(\n"
    index = 0
    infos = shape_infos(source, input_names)
    for name, arr, (shape, strides, ndim) in zip(input_names, inputs, infos):
        location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        text += f"  const {location} {type_string(arr.dtype)}{ref} {name} [[buffer({index})]],\n"
        index += 1
        if arr.ndim > 0:
            for used, decl in ((shape, f"const constant int* {name}_shape"),
                               (strides, f"const constant int64_t* {name}_strides"),
                               (ndim, f"const constant int& {name}_ndim")):
                if used:
                    text += f"  {decl} [[buffer({index})]],\n"
                    index += 1
    attrs = attributes(source)
    for k, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        text += f"  device {type_string(dtype)}* {name} [[buffer({index})]]"
        last = k == len(output_names) - 1 and not attrs
        text += ") {\n" if last else ",\n"
        index += 1
    for k, (attr, kind) in enumerate(attrs):
        text += f"  {kind} {attr} [[{attr}]]" + (") {\n" if k == len(attrs) - 1 else ",\n")
    text += source + "\n}\n"
    if template:
        inst = func + "<" + ", ".join(_template_value(v) for _, v in template) + ">"
        text += f'\ntemplate [[host_name("{func}")]] [[kernel]] decltype({inst}) {inst};\n'
    return text


def launcher_source(func: str, source: str, input_names, inputs, output_dtypes, template) -> str:
    """`emu_launch`: calls the kernel for one thread with the runtime's buffers and attributes."""
    callee = func + ("<" + ", ".join(_template_value(v) for _, v in template) + ">" if template else "")
    args = []
    for k, (arr, (shape, strides, ndim)) in enumerate(zip(inputs, shape_infos(source, input_names))):
        ctype = type_string(arr.dtype)
        if arr.ndim == 0:
            args.append(f"*static_cast<const {ctype}*>(b->in[{k}])")
            continue
        args.append(f"static_cast<const {ctype}*>(b->in[{k}])")
        args += [expr for used, expr in ((shape, f"b->in_shape[{k}]"), (strides, f"b->in_strides[{k}]"),
                                         (ndim, f"b->in_ndim[{k}]")) if used]
    args += [f"static_cast<{type_string(d)}*>(b->out[{k}])" for k, d in enumerate(output_dtypes)]
    for attr, kind in attributes(source):
        args.append(f"uint3{{a->{attr}.x, a->{attr}.y, a->{attr}.z}}" if kind == "uint3" else f"a->{attr}")
    body = ",\n      ".join(args)
    return (f'\nextern "C" void emu_launch(const emu::Buffers* b, const emu::ThreadAttrs* a) {{\n'
            f"  {callee}(\n      {body});\n}}\n")


class _Builder:
    """Compiles runtime.cpp once and each distinct kernel text once per process."""

    def __init__(self):
        self.dir: Path | None = None
        self.binaries: dict[str, Path] = {}

    def _workdir(self) -> Path:
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix="dflash2-metal-emu-"))
            atexit.register(shutil.rmtree, self.dir, True)
        return self.dir

    def _compile(self, args: list[str]) -> None:
        proc = subprocess.run(["g++", *CXX_FLAGS, f"-I{HERE}", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed ({' '.join(args[-3:])}):\n{proc.stderr[-4000:]}")

    def runtime(self) -> Path:
        obj = self._workdir() / "runtime.o"
        if not obj.exists():
            self._compile([RUNTIME_STD, "-c", str(HERE / "runtime.cpp"), "-o", str(obj)])
        return obj

    def binary(self, unit: str) -> Path:
        key = hashlib.sha256(unit.encode()).hexdigest()[:16]
        if key not in self.binaries:
            src, exe = self._workdir() / f"k{key}.cpp", self._workdir() / f"k{key}"
            src.write_text(unit)
            obj = src.with_suffix(".o")
            self._compile([KERNEL_STD, "-c", str(src), "-o", str(obj)])
            self._compile([str(obj), str(self.runtime()), "-o", str(exe)])
            self.binaries[key] = exe
        return self.binaries[key]


BUILDER = _Builder()


def _host(arr: mx.array) -> np.ndarray:
    storage = TYPE_STRINGS[arr.dtype][1]
    if arr.dtype in (mx.float16, mx.bfloat16):
        arr = arr.astype(mx.float32)  # exact: every half / bf16 value is a float
    return np.ascontiguousarray(np.asarray(arr)).astype(storage, copy=False)


class EmulatedKernel:
    """Drop-in for the object `mx.fast.metal_kernel` returns; `launches` counts calls."""

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None):
        if atomic_outputs:
            raise NotImplementedError("the emulator has no atomics")
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.launches = 0
        self.last_source = ""

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None):
        if len(inputs) != len(self.input_names) or len(output_shapes) != len(self.output_names):
            raise ValueError(f"{self.name}: expected {len(self.input_names)} inputs and "
                             f"{len(self.output_names)} outputs, got {len(inputs)} and {len(output_shapes)}")
        inputs = [mx.array(x) if not isinstance(x, mx.array) else x for x in inputs]
        func = kernel_name(self.name, template, inputs, output_dtypes)
        text = kernel_source(func, self.header, self.source, self.input_names, inputs, self.output_names,
                             output_dtypes, template)
        self.last_source = text
        if verbose:
            print(text)
        unit = '#include "metal_shim.h"\n' + text + launcher_source(
            func, self.source, self.input_names, inputs, output_dtypes, template)
        exe = BUILDER.binary(unit)
        self.launches += 1
        return self._run(exe, inputs, output_shapes, output_dtypes, grid, threadgroup, init_value)

    def _run(self, exe, inputs, output_shapes, output_dtypes, grid, threadgroup, init_value):
        hosts = [_host(x) for x in inputs]
        outs = [(np.dtype(TYPE_STRINGS[d][1]), int(np.prod(s, dtype=np.int64)))
                for s, d in zip(output_shapes, output_dtypes)]
        fill = "poison 0" if init_value is None else None
        lines = [f"grid {grid[0]} {grid[1]} {grid[2]}",
                 f"threadgroup {threadgroup[0]} {threadgroup[1]} {threadgroup[2]}", f"inputs {len(hosts)}"]
        lines += [f"{h.itemsize} {h.ndim} " + " ".join(str(d) for d in h.shape) for h in hosts]
        lines.append(f"outputs {len(outs)}")
        for dt, count in outs:
            kind = fill or (f"float {float(init_value)!r}" if dt.kind == "f" else f"int {int(init_value)}")
            lines.append(f"{dt.itemsize} {count} {kind}")
        with tempfile.TemporaryDirectory(dir=BUILDER._workdir()) as tmp:
            tmp = Path(tmp)
            (tmp / "meta").write_text("\n".join(lines) + "\n")
            (tmp / "in").write_bytes(b"".join(h.tobytes() for h in hosts))
            proc = subprocess.run([str(exe), str(tmp / "meta"), str(tmp / "in"), str(tmp / "out")],
                                  capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"emulated kernel {self.name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
            raw = (tmp / "out").read_bytes()
        results, offset = [], 0
        for (dt, count), shape, dtype in zip(outs, output_shapes, output_dtypes):
            host = np.frombuffer(raw, dtype=dt, count=count, offset=offset).reshape(tuple(shape))
            offset += dt.itemsize * count
            results.append(mx.array(host).astype(dtype))
        return results


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None) -> EmulatedKernel:
    """Same arguments as `mx.fast.metal_kernel`."""
    return EmulatedKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                          atomic_outputs, compile_options)
