"""Launching a `triton.jit` kernel from JAX: through `jax_triton` on a GPU, through Triton's
interpreter on any other host.

On ROCm and CUDA, `jax_triton.triton_call` compiles the kernel for the device and places it in the
XLA program as a custom call. Elsewhere (a CPU host: the tests, a laptop) the same kernel source
runs under Triton's interpreter, on CPU torch tensors, inside a `jax.pure_callback`: slow, but the
very kernel the GPU runs, so its results are checked against the XLA references anywhere. Both
imports are lazy: a CPU-only install without `jax_triton` (or torch) imports this module.

A kernel's parameters are its input arrays, its scalars, its output arrays, then its
`tl.constexpr` parameters (jax_triton's order: the outputs follow every argument); `call` takes
the inputs and scalars in that order, the constexprs by name. A kernel with an `INTERPRETED`
constexpr is told whether the interpreter runs it (`call` sets it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import launch


def on_gpu(backend: str | None = None) -> bool:
    """Whether JAX's default backend (or `backend`) is a GPU that `jax_triton` launches on."""
    return (backend or jax.default_backend()) in ("gpu", "cuda", "rocm")


def interpreted() -> bool:
    """Whether a kernel launched now runs in Triton's interpreter: on a CPU host, unless the trace
    is for a GPU named by `launch.for_arch` (the compile gate, the memory planner)."""
    return not on_gpu() and not launch.is_overridden()


def strides(x) -> tuple[int, ...]:
    """Element strides of a row-major array (or ShapeDtypeStruct): what a kernel's pointer arithmetic uses."""
    out, step = [], 1
    for n in reversed(x.shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


@dataclasses.dataclass(frozen=True)
class JitLaunch:
    """One launch of a `triton.jit` kernel as `call` saw it, for compiling it on any host (isa.py):
    its Triton signature ({parameter: type}) and constexprs, launch parameters and grid, and the
    values of its scalar arguments ({parameter: value}; jax_triton bakes them into the kernel it
    compiles and specialises on them: `isa.jax_triton_specialization`)."""

    kernel: Any
    name: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int
    grid: tuple[int, ...]
    scalars: tuple[tuple[str, Any], ...] = ()


_CAPTURES: list[list[JitLaunch]] = []


@contextlib.contextmanager
def capturing(into: list):
    """Within it, `call` launches nothing: it adds a `JitLaunch` to `into` and returns zeros (so a
    deviceless trace goes on)."""
    _CAPTURES.append(into)
    try:
        yield into
    finally:
        _CAPTURES.pop()


_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int32": "i32",
                 "int64": "i64", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def _signature(kernel, arrays, scalars, out_shapes, constexprs) -> tuple[tuple[str, str], ...]:
    types = [f"*{_TRITON_TYPES[str(jnp.dtype(a.dtype))]}" for a in arrays]
    types += ["fp32" if isinstance(v, float) else "i1" if isinstance(v, bool) else "i32" if -2**31 <= v < 2**31
              else "i64" for v in scalars]
    types += [f"*{_TRITON_TYPES[str(jnp.dtype(s.dtype))]}" for s in out_shapes]
    names = kernel.arg_names
    if len(types) + len(constexprs) != len(names):
        raise TypeError(f"{kernel.__name__} takes {len(names)} parameters; the call gives "
                        f"{len(types)} arrays and scalars and {len(constexprs)} constexprs")
    return tuple(zip(names, types + ["constexpr"] * len(constexprs)))


def call(kernel, out_shapes: Sequence[jax.ShapeDtypeStruct], *args: Any, grid: tuple[int, ...],
         num_warps: int, num_stages: int, interpret: bool | None = None, name: str = "",
         **constexprs: Any) -> list[jax.Array]:
    """Run `kernel` over `grid` on `args` (arrays, then ints / floats) writing `out_shapes`;
    returns the outputs. `interpret` None: on a GPU through jax_triton, else interpreted.

    Where nothing can launch it, the kernel stands in as an opaque op of its exact outputs
    (`launch.stand_in`): under the memory planner's `launch.shape_only()`, and when tracing for a
    GPU this host does not have (`launch.for_arch`: a deviceless trace), since jax_triton
    compiles a kernel for the device it lowers on. `capturing` records it instead."""
    deviceless = launch.is_overridden() and not on_gpu()
    if interpret is None:
        interpret = interpreted()
    interpret = interpret and not _CAPTURES
    if "INTERPRETED" in kernel.arg_names:
        constexprs = {**constexprs, "INTERPRETED": bool(interpret)}
    first_scalar = next((i for i, a in enumerate(args) if isinstance(a, (bool, int, float, np.number))), len(args))
    arrays, scalars = args[:first_scalar], args[first_scalar:]
    if _CAPTURES:
        signature = _signature(kernel, arrays, scalars, out_shapes, constexprs)
        scalar_names = [n for n, _ in signature[len(arrays):len(arrays) + len(scalars)]]
        _CAPTURES[-1].append(JitLaunch(kernel, name or kernel.__name__, signature, tuple(constexprs.items()),
                                       num_warps, num_stages, tuple(grid), tuple(zip(scalar_names, scalars))))
        return [jnp.zeros(s.shape, s.dtype) for s in out_shapes]
    if launch.is_shape_only() or (deviceless and not interpret):
        return list(launch.stand_in(list(out_shapes), arrays))
    if not interpret:
        import jax_triton as jt

        out = jt.triton_call(*args, kernel=kernel, out_shape=list(out_shapes), grid=grid, num_warps=num_warps,
                             num_stages=num_stages, name=name, **constexprs)
        return list(out) if isinstance(out, (list, tuple)) else [out]
    host = functools.partial(_interpret, kernel, tuple(out_shapes), tuple(scalars), tuple(grid), constexprs,
                             name or kernel.__name__)
    out = jax.pure_callback(host, list(out_shapes), *arrays)
    return list(out)


def _to_torch(array: np.ndarray):
    import torch

    array = np.array(array, order="C")  # a writable copy: the kernel may write its arrays
    if array.dtype == jnp.bfloat16:  # crosses as its 16 bits (numpy has no bfloat16 torch reads)
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _to_numpy(tensor, dtype) -> np.ndarray:
    import torch

    if str(jnp.dtype(dtype)) == "bfloat16":
        return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
    return tensor.numpy()


@contextlib.contextmanager
def _interpreting(kernel):
    """Triton's interpreter for the length of a call: the `triton.jit` functions of triton.language
    and of the kernel's module swapped for interpreted twins, as TRITON_INTERPRET=1 would have made
    them at import (the interpreter runs only functions it wraps), and put back after, so the same
    process still compiles the kernels (the compile gate)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for later in _IMPORTED_BY_THE_INTERPRETER:  # imported now: they check the functions are not swapped
        with contextlib.suppress(ImportError):
            importlib.import_module(later)
    names = [n for n in list(sys.modules) if n == "triton.language" or n.startswith("triton.language.")]
    swapped = []
    with _INTERPRETER_LOCK, _language_restored():
        try:
            for module in [sys.modules[n] for n in names] + [sys.modules[kernel.fn.__module__]]:
                for name, value in list(vars(module).items()):
                    if isinstance(value, JITFunction):
                        swapped.append((module, name, value))
                        setattr(module, name, _twin(value, InterpretedFunction))
            yield InterpretedFunction(kernel.fn)
        finally:
            for module, name, value in reversed(swapped):
                setattr(module, name, value)


_MISSING = object()


@contextlib.contextmanager
def _language_restored():
    """Every attribute of triton.language the interpreter patches during the block, put back as it
    was before it. The interpreter restores what a kernel's launch patched, but a device function
    the kernel calls patches the language again and leaves it so (triton 3.9): builtins bound to the
    interpreter's semantics, which a later compile of any kernel in the process then fails on."""
    from triton.runtime import interpreter

    scope = getattr(interpreter, "_LangPatchScope", None)
    if scope is None:  # a Triton without the patch scope: nothing to wrap
        yield
        return
    originals: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    set_attr = scope.set_attr

    def recording(self, obj, name, value):
        originals.setdefault((id(obj), name), (obj, name, vars(obj).get(name, _MISSING)))  # own, not inherited
        set_attr(self, obj, name, value)

    scope.set_attr = recording
    try:
        yield
    finally:
        scope.set_attr = set_attr
        for obj, name, value in originals.values():
            if value is _MISSING:
                if name in vars(obj):
                    delattr(obj, name)
            else:
                setattr(obj, name, value)


_INTERPRETER_LOCK = threading.RLock()
_IMPORTED_BY_THE_INTERPRETER = ("triton.experimental.gluon.language",)
_TWINS: dict = {}


def _twin(function, interpreted):
    # by identity: hashing a JITFunction walks its source and what it names (swapped, mid-call)
    if id(function) not in _TWINS:
        _TWINS[id(function)] = (function, interpreted(function.fn))
    return _TWINS[id(function)][1]


def _interpret(kernel, out_shapes, scalars, grid, constexprs, name, *arrays) -> list[np.ndarray]:
    import torch

    from pallas_kernels import traffic

    inputs = [_to_torch(np.asarray(a)) for a in arrays]
    outputs = [torch.zeros(s.shape, dtype=getattr(torch, str(jnp.dtype(s.dtype)))) for s in out_shapes]
    params = kernel.arg_names
    buffers = list(zip(params, inputs)) + list(zip(params[len(inputs) + len(scalars):], outputs))
    with _interpreting(kernel) as interpreted, traffic.recording(name, grid, buffers):  # counted in traffic.counting()
        interpreted[grid](*inputs, *scalars, *outputs, **constexprs)
    return [_to_numpy(t, s.dtype) for t, s in zip(outputs, out_shapes)]
