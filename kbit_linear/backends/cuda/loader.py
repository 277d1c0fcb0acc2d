"""Run-time compilation and launch of the CUDA kernels in ``kernels/``.

The kernels ship as CUDA C++ sources. On first use of a kernel instance on a device, this module
reads its source file, inlines the ``#include "x.cuh"`` lines from the same folder, compiles it
with NVRTC through ``cupy.RawModule`` for that device's architecture and keeps the module. CuPy
also caches the compiled binary on disk (``CUPY_CACHE_DIR``, by default ``~/.cupy/kernel_cache``),
so a later process skips the compile.

Launches go straight to the driver (``cuLaunchKernel`` through ``cupy.cuda.driver``) on torch's
*current* stream of the tensor's device, fetched at every call. Nothing here allocates through
CuPy or synchronizes the host, so launches can be captured in a CUDA graph. Kernels written for
it (they wait with ``griddepcontrol.wait`` before touching memory) can be launched so that they
overlap the end of the previous kernel (programmatic dependent launch, sm_90+, through
``cuLaunchKernelEx`` in :mod:`.driver`; on by default, ``KBIT_LINEAR_PDL=0`` or
:func:`set_programmatic_launch` turns it off).

CuPy is imported lazily, on the first compile: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib.resources
import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from . import driver

__all__ = [
    "MIN_COMPUTE_CAPABILITY",
    "CudaKernel",
    "kernel_source_dir",
    "read_source",
    "get_kernel",
    "launch",
    "programmatic_launch_enabled",
    "set_programmatic_launch",
    "grid_may_overlap",
    "short_grid_may_overlap",
    "device_properties",
    "runnable_properties",
    "cupy_available",
]

MIN_COMPUTE_CAPABILITY = (8, 0)
"""Oldest GPU the kernels support (Ampere, sm_80): they use ``cp.async``, ``ldmatrix`` and bf16 ``mma.sync``."""

_BASE_OPTIONS = ("-std=c++17",)
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*(?://.*)?$')
_INSTALL_HINT = (
    'the CUDA kernels need CuPy: pip install "kbit-linear[cuda]" '
    "(or pip install cupy-cuda12x / cupy-cuda13x matching your CUDA major version)"
)

_lock = threading.Lock()
_tls = threading.local()
_kernels: dict[tuple, "CudaKernel"] = {}
_props: dict[int, "DeviceProperties"] = {}


# ---------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------


def kernel_source_dir() -> Path:
    """The folder that holds the ``.cu``/``.cuh`` sources.

    From an installed wheel this is the resource package ``kbit_linear._kernels``; from a source
    checkout it is the repository's top-level ``kernels/`` folder.
    """
    try:
        res = importlib.resources.files("kbit_linear._kernels")
        path = Path(str(res))
        if path.is_dir() and any(path.glob("*.cu")):
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    path = Path(__file__).resolve().parents[3] / "kernels"
    if path.is_dir():
        return path
    raise FileNotFoundError("cannot find the CUDA kernel sources (neither kbit_linear._kernels nor the checkout's kernels/)")


def read_source(source: str) -> str:
    """Text of ``source`` with its ``#include "x.cuh"`` lines replaced by the files themselves.

    Each header is inlined once; ``#line`` directives keep compiler messages pointing at the
    original file and line. Angle-bracket includes are left alone (the kernels use none).
    """
    if not isinstance(source, str) or "/" in source or "\\" in source or not source:
        raise ValueError(f"source must be a plain file name in the kernels folder, got {source!r}")
    folder = kernel_source_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"kernel source {name!r} not found in {folder}")
        out = [f'#line 1 "{name}"']
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            m = _INCLUDE_RE.match(line)
            if m:
                inc = m.group(1)
                if inc not in seen:
                    seen.add(inc)
                    out.append(expand(inc))
                out.append(f'#line {lineno + 1} "{name}"')
            else:
                out.append(line)
        return "\n".join(out)

    seen.add(source)
    return expand(source) + "\n"


# ---------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------


class DeviceProperties:
    """What the launch code needs to know about one GPU (read once per device)."""

    def __init__(self, index: int) -> None:
        p = torch.cuda.get_device_properties(index)
        self.index = index
        self.name: str = p.name
        self.capability: tuple[int, int] = (p.major, p.minor)
        self.sm_count: int = p.multi_processor_count
        self.arch: str = f"sm_{p.major}{p.minor}"
        # Opt-in dynamic shared memory per block (227 KiB on H100, 163 KiB on A100).
        self.max_shared_per_block: int = int(
            getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "max_shared_memory_per_block_optin", 0) or 48 * 1024
        )
        self.shared_per_sm: int = int(getattr(p, "shared_memory_per_multiprocessor", 0) or self.max_shared_per_block)
        # Programmatic dependent launch (griddepcontrol) exists from Hopper on.
        self.programmatic_launch: bool = self.capability >= (9, 0)


def device_properties(device: torch.device | int) -> DeviceProperties:
    """Cached :class:`DeviceProperties` of a CUDA device; raises if it is older than sm_80."""
    index = device if isinstance(device, int) else _device_index(device)
    props = _props.get(index)
    if props is None:
        props = DeviceProperties(index)
        if props.capability < MIN_COMPUTE_CAPABILITY:
            raise RuntimeError(
                f"GPU {index} ({props.name}) has compute capability {props.capability[0]}.{props.capability[1]}; "
                f"the kbit CUDA kernels need sm_80 or newer (Ampere, Ada, Hopper, Blackwell)"
            )
        _props[index] = props
    return props


def runnable_properties(device: torch.device | int) -> DeviceProperties | None:
    """The :class:`DeviceProperties` of a CUDA device the kernels run on (sm_80 or newer), or
    None for a device that is not CUDA or a GPU older than that: the first step of every "does
    this kernel take the device" check (the checks add their own limits to the properties)."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        device = _device_index(device)
    try:
        return device_properties(device)
    except RuntimeError:  # older than sm_80
        return None


def _device_index(device: torch.device) -> int:
    if not isinstance(device, torch.device) or device.type != "cuda":
        raise ValueError(f"device must be a CUDA torch.device, got {device!r}")
    return device.index if device.index is not None else torch.cuda.current_device()


def cupy_available() -> bool:
    """Whether CuPy can be imported (the CUDA kernels need it)."""
    try:
        _import_cupy()
    except ImportError:
        return False
    return True


def _import_cupy() -> Any:
    try:
        import cupy  # noqa: PLC0415  (lazy on purpose: the package imports without CuPy)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(_INSTALL_HINT) from e
    return cupy


# ---------------------------------------------------------------------------------------
# compile
# ---------------------------------------------------------------------------------------


class CudaKernel:
    """One compiled kernel instance on one device.

    Attributes:
        name: the C++ name expression, e.g. ``"kbit_gemm<4, 1, 0>"``.
        device_index: the GPU it was loaded on.
        raw: the ``cupy.RawKernel`` (keeps the module alive).
        func_ptr: the ``CUfunction`` handle, as an int.
        num_regs: registers per thread reported by the driver.
        pdl_capable: whether the device supports programmatic dependent launch (whether a
            launch uses it is the caller's choice: only kernels that wait may).
    """

    __slots__ = ("name", "device_index", "raw", "func_ptr", "num_regs", "pdl_capable", "_max_dynamic_smem", "_lock", "_clusters")

    def __init__(self, name: str, device_index: int, raw: Any) -> None:
        self.name = name
        self.device_index = device_index
        self.raw = raw
        self.func_ptr: int = int(raw.kernel.ptr)
        self.num_regs: int = int(raw.num_regs)
        self.pdl_capable: bool = device_properties(device_index).programmatic_launch
        self._max_dynamic_smem = 48 * 1024
        self._lock = threading.Lock()
        self._clusters: dict[tuple[int, int, int], int] = {}

    def ensure_shared_memory(self, nbytes: int) -> None:
        """Raise the kernel's dynamic shared memory limit once when a launch needs more than 48 KB.

        The limit is set on this device's copy of the kernel, whichever device is current."""
        if nbytes > self._max_dynamic_smem:
            with self._lock:
                if nbytes > self._max_dynamic_smem:
                    limit = device_properties(self.device_index).max_shared_per_block
                    if nbytes > limit:
                        raise ValueError(f"{self.name} needs {nbytes} bytes of shared memory; the GPU allows {limit}")
                    # Through this device's own function handle, with its context current: the
                    # limit is a property of one device's copy of the kernel.
                    with _context_of(self.device_index):
                        driver.set_max_dynamic_shared_memory(self.func_ptr, nbytes)
                    self._max_dynamic_smem = nbytes

    def max_active_clusters(self, cluster: int, threads: int, shared_mem: int) -> int:
        """How many thread block clusters of ``cluster`` blocks (``threads`` threads and
        ``shared_mem`` bytes of dynamic shared memory each) this device runs at once, from the
        driver: a cluster's blocks share one GPC, so this can be less than the resident blocks
        divided by ``cluster``. Kept per arguments."""
        key = (cluster, threads, shared_mem)
        n = self._clusters.get(key)
        if n is None:
            self.ensure_shared_memory(shared_mem)
            with _context_of(self.device_index):
                n = self._clusters[key] = driver.max_active_clusters(self.func_ptr, cluster, threads, shared_mem)
        return n

    def __repr__(self) -> str:
        return f"CudaKernel({self.name!r}, cuda:{self.device_index}, regs={self.num_regs})"


def get_kernel(source: str, name_expression: str, device: torch.device, options: Sequence[str] = ()) -> CudaKernel:
    """Compile (once) and return a kernel instance for ``device``.

    Args:
        source: file name in :func:`kernel_source_dir`, e.g. ``"gemm.cu"``.
        name_expression: the C++ name of the ``__global__`` function or template instance,
            e.g. ``"kbit_gemm<4, 1, 0>"``.
        device: a CUDA ``torch.device`` (sm_80 or newer).
        options: extra NVRTC options (``-D...``); ``-std`` is set here, ``-arch`` by CuPy for
            the device.

    Returns:
        The cached :class:`CudaKernel` for (device, arch, source, name_expression, options).

    Raises:
        ImportError: CuPy is not installed (the message says what to install).
        RuntimeError: the GPU is older than sm_80.
        cupy.cuda.compiler.CompileException: the source does not compile (with the log).
    """
    if not isinstance(name_expression, str) or not name_expression:
        raise ValueError(f"name_expression must be a non-empty string, got {name_expression!r}")
    index = _device_index(device)
    props = device_properties(index)
    opts = tuple(options)
    key = (index, props.arch, source, name_expression, opts)
    kern = _kernels.get(key)
    if kern is not None:
        return kern
    with _lock:
        kern = _kernels.get(key)
        if kern is None:
            cupy = _import_cupy()
            code = read_source(source)
            # CuPy adds -arch for the current device itself (sm_XY, or compute_XY PTX when the
            # GPU is newer than its NVRTC), so only the device is set here.
            all_opts = _BASE_OPTIONS + opts
            with cupy.cuda.Device(index):
                module = cupy.RawModule(code=code, options=all_opts, name_expressions=[name_expression])
                raw = module.get_function(name_expression)
                kern = CudaKernel(name_expression, index, raw)
            _kernels[key] = kern
    return kern


# ---------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------


def _raw_stream_getter():
    # torch._C._cuda_getCurrentRawStream(index) returns the cudaStream_t as an int without building
    # a torch.cuda.Stream object (inductor's generated code uses it); fall back to the public API.
    fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fn is not None:
        return fn
    return lambda index: torch.cuda.current_stream(index).cuda_stream


_current_raw_stream = _raw_stream_getter()
_cupy_launch: Any = None


def _get_driver_launch():
    global _cupy_launch
    if _cupy_launch is None:
        _cupy_launch = _import_cupy().cuda.driver.launchKernel
    return _cupy_launch


class ArgPack:
    """Reusable kernel-parameter storage for one kernel signature, with the parameters' names.

    ``cuLaunchKernel`` takes an array of pointers, one per parameter, and copies the values at
    the call; building that array costs microseconds in Python, so it is built once here. Each
    parameter gets an 8-byte slot: pointers fill it, 32-bit ints use the low half (little-endian),
    floats are stored as their 32-bit pattern.

    Call sites name the values (``pack.Values(x=..., packed=..., ...)``, a named tuple in the
    kernel's parameter order), and ``tests/test_kernels_compile.py`` checks every pack's names
    and kinds against the kernel's parameter list in its ``.cu`` source.

    Args:
        kernel: the ``__global__`` function's name in its source (``"kbit_gemm"``).
        params: the parameters in order, ``"name:kind"`` separated by spaces, kind ``p``
            (pointer: tensor, int address or None), ``i`` (32-bit int), ``f`` (32-bit float) or
            ``m`` (a 128-byte tensor map passed by value: the value is the address of host
            memory holding it, which the launch copies), e.g. ``"x:p packed:p M:i"``.
    """

    def __init__(self, kernel: str, params: str) -> None:
        pairs = [p.split(":") for p in params.split()] if isinstance(params, str) else []
        if not pairs or any(len(p) != 2 or not p[0].isidentifier() or p[1] not in ("p", "i", "f", "m") for p in pairs):
            raise ValueError(f"params must be 'name:kind' pairs (kind p, i, f or m) separated by spaces, got {params!r}")
        self.kernel = kernel
        self.names: tuple[str, ...] = tuple(p[0] for p in pairs)
        self.kinds = "".join(p[1] for p in pairs)
        self._by_address = tuple(i for i, k in enumerate(self.kinds) if k == "m")
        self.Values = collections.namedtuple(f"{kernel}_args", self.names)  # type: ignore[misc]
        self._local = threading.local()

    def _storage(self) -> Any:
        loc = self._local
        if getattr(loc, "slots", None) is None:
            n = len(self.kinds)
            loc.slots = (ctypes.c_uint64 * n)()
            base = ctypes.addressof(loc.slots)
            loc.ptrs = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
            loc.ptrs_addr = ctypes.addressof(loc.ptrs)
        return loc

    def launch(self, kernel: "CudaKernel", grid: int, shared_mem: int, stream: int, values: Sequence[int], threads: int = 256,
               programmatic: bool = False, cluster: int = 1) -> None:
        """Fast launch for hot paths: ``values`` are already plain non-negative ints (pointers as
        ``data_ptr()``), ``grid``/``threads`` one-dimensional, ``stream`` the raw ``cudaStream_t``
        of the kernel's device. The caller guarantees the kinds and the device; this skips the
        checks of :func:`launch`.

        ``programmatic=True`` (for kernels that call ``griddepcontrol.wait`` before touching
        memory) lets the grid start while the previous kernel on the stream finishes, where the
        GPU supports it and :func:`set_programmatic_launch` has not turned it off. ``cluster``:
        blocks per thread block cluster (sm_90+; ``grid`` a multiple of it)."""
        loc = self._storage()
        loc.slots[:] = values
        for i in self._by_address:  # passed by value from the host memory the value points at
            loc.ptrs[i] = values[i]
        if shared_mem > kernel._max_dynamic_smem:
            kernel.ensure_shared_memory(shared_mem)
        index = kernel.device_index
        overlap = programmatic and _programmatic_on and kernel.pdl_capable
        bound = getattr(_tls, "bound", None)
        if bound is not None and index in bound and torch._C._cuda_getDevice() == index:
            if overlap or cluster > 1:
                _launch_ex(kernel, grid, threads, shared_mem, stream, loc.ptrs_addr, overlap, cluster)
            else:
                _cupy_launch(kernel.func_ptr, grid, 1, 1, threads, 1, 1, shared_mem, stream, loc.ptrs_addr, 0)
        else:
            _launch_binding(kernel, (grid, 1, 1), (threads, 1, 1), shared_mem, stream, loc.ptrs_addr, overlap, cluster)

    def pointers(self, values: Sequence[Any]) -> int:
        """Store ``values`` in this thread's slots and return the address of the pointer array."""
        loc = self._storage()
        slots = loc.slots
        if len(values) != len(self.kinds):
            raise ValueError(f"expected {len(self.kinds)} kernel arguments, got {len(values)}")
        for i, (k, v) in enumerate(zip(self.kinds, values)):
            if k == "p":
                slots[i] = 0 if v is None else (v.data_ptr() if isinstance(v, torch.Tensor) else int(v))
            elif k == "i":
                slots[i] = int(v) & 0xFFFFFFFF
            elif k == "m":
                loc.ptrs[i] = int(v)
            else:
                slots[i] = _f32_bits(float(v))
        return loc.ptrs_addr


def _f32_bits(x: float) -> int:
    return ctypes.c_uint32.from_buffer_copy(ctypes.c_float(x)).value


def launch(
    kernel: CudaKernel,
    grid: int | tuple[int, ...],
    block: int | tuple[int, ...],
    args: Sequence[Any],
    shared_mem: int,
    device: torch.device,
    *,
    pack: ArgPack | None = None,
    stream: int | None = None,
) -> None:
    """Launch ``kernel`` on torch's current stream of ``device``.

    Args:
        kernel: from :func:`get_kernel` for the same device.
        grid: blocks, an int or up to three ints.
        block: threads per block, an int or up to three ints.
        args: the kernel's parameters in order: torch tensors (their ``data_ptr()`` is passed),
            ``None`` (a null pointer), Python/NumPy ints and floats. Without ``pack``, ints are
            passed as 32-bit ``int`` and floats as 32-bit ``float``; a kernel that takes 64-bit
            values needs an explicit ``pack``.
        shared_mem: dynamic shared memory in bytes (the limit is raised once when over 48 KB).
        device: the CUDA device the tensors live on; it is made current for the launch.
        pack: a reusable :class:`ArgPack` describing the parameter kinds (faster; built from the
            argument types when omitted).
        stream: the raw ``cudaStream_t`` to use, if the caller already fetched torch's current
            stream of ``device`` for this call (default: fetched here).
    """
    index = _device_index(device)
    if kernel.device_index != index:
        raise ValueError(f"{kernel.name} was compiled for cuda:{kernel.device_index}, launched on cuda:{index}")
    if shared_mem > 48 * 1024:
        kernel.ensure_shared_memory(shared_mem)
    if pack is None:
        pack = ArgPack(kernel.name.split("<")[0], " ".join(f"a{i}:{_kind_of(a)}" for i, a in enumerate(args)))
    gx, gy, gz = _dims(grid, "grid")
    bx, by, bz = _dims(block, "block")
    params = pack.pointers(args)
    if stream is None:
        stream = _current_raw_stream(index)
    bound = getattr(_tls, "bound", None)
    if bound is not None and index in bound and torch._C._cuda_getDevice() == index:
        _cupy_launch(kernel.func_ptr, gx, gy, gz, bx, by, bz, shared_mem, stream, params, 0)
    else:
        _launch_binding(kernel, (gx, gy, gz), (bx, by, bz), shared_mem, stream, params)


@contextlib.contextmanager
def _context_of(index: int) -> Iterator[None]:
    """Make device ``index`` current for torch and its primary context current for the driver
    calls inside (cudaSetDevice does the latter); torch restores the previous device after."""
    with torch.cuda.device(index):
        _import_cupy().cuda.runtime.setDevice(index)
        yield


def _launch_binding(kernel: CudaKernel, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, stream: int, params: int,
                    programmatic: bool = False, cluster: int = 1) -> None:
    """Launch with ``kernel``'s device made current (slow path: first launch on a thread, or
    another device current): the driver-level launch needs the device's context current."""
    index = kernel.device_index
    fn = _get_driver_launch()
    with _context_of(index):
        one_dimensional = grid[1] == grid[2] == block[1] == block[2] == 1
        if cluster > 1 and not one_dimensional:
            raise ValueError(f"cluster launches take a one-dimensional grid and block, got {grid} and {block}")
        if (programmatic or cluster > 1) and one_dimensional:
            _launch_ex(kernel, grid[0], block[0], shared_mem, stream, params, programmatic, cluster)
        else:
            fn(kernel.func_ptr, *grid, *block, shared_mem, stream, params, 0)
    if torch._C._cuda_getDevice() == index:
        bound = getattr(_tls, "bound", None)
        if bound is None:
            bound = _tls.bound = set()
        bound.add(index)


# ---------------------------------------------------------------------------------------
# programmatic dependent launch
# ---------------------------------------------------------------------------------------

_programmatic_on: bool = os.environ.get("KBIT_LINEAR_PDL", "1").strip().lower() not in ("0", "false", "off", "no")


def programmatic_launch_enabled() -> bool:
    """Whether kernels that support it are launched with programmatic dependent launch.

    On by default (where the GPU supports it, sm_90+); the environment variable
    ``KBIT_LINEAR_PDL=0`` starts a process with it off.
    """
    return _programmatic_on


def set_programmatic_launch(enabled: bool) -> bool:
    """Turn programmatic dependent launch on or off for later launches; returns the old setting.

    Graphs captured earlier keep the launches they recorded.
    """
    global _programmatic_on
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    old, _programmatic_on = _programmatic_on, enabled
    return old


def grid_may_overlap(grid: int, blocks_per_sm: int, sm_count: int) -> bool:
    """Whether a grid should be launched so that it may start while the previous kernel finishes.

    Only where its blocks cannot pile up on a few SMs: at most one block per SM, or a grid that
    takes every block slot. A smaller grid of several blocks per SM would put its first blocks
    two or more to an SM on the SMs the previous kernel leaves idle, and those SMs then finish
    last (decode, 14336->4096 at K = 3 on an H100: 25 us instead of 19.5).
    """
    return blocks_per_sm <= 1 or grid >= blocks_per_sm * sm_count


def short_grid_may_overlap(grid: int, sm_count: int) -> bool:
    """:func:`grid_may_overlap` for a grid of short blocks (a few microseconds of work each: the
    MoE router, the KV-cache combine), whatever their number per SM: where there are no more
    blocks than SMs. Blocks piling up on the SMs the previous kernel leaves idle cost little when
    each is this short (``router-h200.md``'s timings include it)."""
    return grid <= sm_count


def _launch_ex(kernel: CudaKernel, grid: int, threads: int, shared_mem: int, stream: int, params: int, programmatic: bool,
               cluster: int) -> None:
    global _programmatic_on
    try:
        driver.launch_ex(kernel.func_ptr, grid, threads, shared_mem, stream, params, programmatic, cluster)
    except driver.DriverError as e:
        if e.code != driver.CUDA_ERROR_NOT_SUPPORTED or not programmatic:
            raise
        # A driver or setup without programmatic launch (the retry without it raises where
        # clusters were the missing feature): say so once and launch without it from now on.
        if cluster > 1:
            driver.launch_ex(kernel.func_ptr, grid, threads, shared_mem, stream, params, False, cluster)
        else:
            _get_driver_launch()(kernel.func_ptr, grid, 1, 1, threads, 1, 1, shared_mem, stream, params, 0)
        _programmatic_on = False
        warnings.warn(f"programmatic dependent launch is unavailable ({e}); kernels launch without it", RuntimeWarning, stacklevel=3)


def _kind_of(a: Any) -> str:
    if a is None or isinstance(a, torch.Tensor):
        return "p"
    if isinstance(a, bool):
        return "i"
    if isinstance(a, int) or (hasattr(a, "dtype") and getattr(a.dtype, "kind", "") in "iu"):
        return "i"
    if isinstance(a, float) or (hasattr(a, "dtype") and getattr(a.dtype, "kind", "") == "f"):
        return "f"
    raise TypeError(f"unsupported kernel argument type {type(a).__name__}")


def _dims(d: int | tuple[int, ...], name: str) -> tuple[int, int, int]:
    if isinstance(d, int):
        d = (d,)
    if not 1 <= len(d) <= 3 or any((not isinstance(v, int)) or v < 1 for v in d):
        raise ValueError(f"{name} must be 1 to 3 positive ints, got {d!r}")
    return (tuple(d) + (1, 1))[:3]  # type: ignore[return-value]
