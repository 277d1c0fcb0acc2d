"""The few CUDA driver calls that neither torch nor CuPy expose, through ``ctypes``.

- Raw device memory outside torch's allocator (``cuMemAlloc``, ``cuMemsetD32Async``), for the
  persistent split-K buffers (:mod:`.workspace`).
- The thread's stream-capture mode (``cuThreadExchangeStreamCaptureMode``).
- Tensor maps for the Hopper tensor copy (``cuTensorMapEncodeTiled``): a pure host call that
  describes a 2-D tensor in global memory and the box one copy moves.
- Kernel launches with programmatic stream serialization (``cuLaunchKernelEx``): the launched
  grid may start while the previous kernel on the stream is still finishing, and waits for it
  in the kernel (``griddepcontrol.wait``) before it reads anything that kernel may have
  written. Hopper (sm_90) and newer; CUDA graphs captured from such launches keep the overlap
  as a programmatic edge. The same call launches thread block clusters (blocks that run at once
  and share their shared memory, sm_90+).

``libcuda.so.1`` is opened on first use: importing this module needs no GPU.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["DriverError", "lib", "check", "launch_ex", "max_active_clusters", "set_max_dynamic_shared_memory", "TENSOR_MAP_BYTES",
           "encode_tensor_map_2d"]

CUDA_ERROR_NOT_SUPPORTED = 801
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class DriverError(RuntimeError):
    """A CUDA driver call returned an error; ``code`` is the ``CUresult``."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with CUDA driver error {code}")
        self.code = code


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i32", ctypes.c_int), ("dim", _Dim3)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
_tls = threading.local()


def lib() -> ctypes.CDLL:
    """``libcuda.so.1`` with the argument types of the calls used here (opened once)."""
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                cu = ctypes.CDLL("libcuda.so.1")
                cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
                cu.cuMemsetD32Async.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
                cu.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
                cu.cuThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
                cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]  # tests read buffers back
                cu.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                cu.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_void_p]
                cu.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
                cu.cuTensorMapEncodeTiled.argtypes = [
                    ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                ]
                _lib = cu
    return _lib


def check(result: int, what: str) -> None:
    """Raise :class:`DriverError` when a driver call did not return ``CUDA_SUCCESS``."""
    if result != 0:
        raise DriverError(what, result)


def set_max_dynamic_shared_memory(func: int, nbytes: int) -> None:
    """Let ``func`` (a ``CUfunction`` handle) launch with up to ``nbytes`` of dynamic shared memory.

    A ``CUfunction`` belongs to the context (so the device) its module was loaded in; setting the
    attribute through the handle itself reaches exactly that copy of the kernel, whatever device
    is current. (CuPy's ``RawKernel`` attribute setters look the function up again for the
    *current* device, which sets the limit on another GPU's copy when that one is current.)
    """
    check(lib().cuFuncSetAttribute(func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
          f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {nbytes})")


def _config(programmatic: bool, cluster: int) -> tuple[_LaunchConfig, int]:
    # One launch configuration per thread and attribute set, its attributes filled once: a
    # launch only sets the grid, block, shared memory and stream fields.
    configs = getattr(_tls, "configs", None)
    if configs is None:
        configs = _tls.configs = {}
    key = (programmatic, cluster)
    entry = configs.get(key)
    if entry is None:
        attrs = (_LaunchAttribute * 2)()
        n = 0
        if programmatic:
            attrs[n].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[n].value.i32 = 1
            n += 1
        if cluster > 1:
            attrs[n].id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attrs[n].value.dim.x, attrs[n].value.dim.y, attrs[n].value.dim.z = cluster, 1, 1
            n += 1
        cfg = _LaunchConfig()
        cfg.gridDimY = cfg.gridDimZ = cfg.blockDimY = cfg.blockDimZ = 1
        cfg.attrs = ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute))
        cfg.numAttrs = n
        entry = configs[key] = (cfg, ctypes.addressof(cfg), attrs)
    return entry[0], entry[1]


def launch_ex(func: int, grid: int, threads: int, shared_mem: int, stream: int, params: int, programmatic: bool = True,
              cluster: int = 1) -> None:
    """Launch a one-dimensional grid with ``cuLaunchKernelEx``'s attributes.

    Args:
        func: the ``CUfunction`` handle.
        grid: blocks (a multiple of ``cluster``).
        threads: threads per block.
        shared_mem: dynamic shared memory per block (bytes).
        stream: the raw ``CUstream``.
        params: address of the kernel's parameter-pointer array.
        programmatic: the grid may start while the previous kernel on ``stream`` finishes; the
            kernel must execute ``griddepcontrol.wait`` before it reads or writes memory that
            kernel may touch.
        cluster: blocks per thread block cluster (consecutive block indices; 1: no clusters).

    The caller makes the function's context current.

    Raises:
        DriverError: the launch failed (``code`` ``CUDA_ERROR_NOT_SUPPORTED`` where the GPU or
            driver lacks a feature asked for).
    """
    cfg, addr = _config(programmatic, cluster)
    cfg.gridDimX = grid
    cfg.blockDimX = threads
    cfg.sharedMemBytes = shared_mem
    cfg.hStream = stream
    check(lib().cuLaunchKernelEx(addr, func, params, None), "cuLaunchKernelEx")


def max_active_clusters(func: int, cluster: int, threads: int, shared_mem: int) -> int:
    """How many clusters of ``cluster`` blocks of ``func`` (``threads`` threads and ``shared_mem``
    bytes of dynamic shared memory each) the GPU runs at once (``cuOccupancyMaxActiveClusters``:
    a cluster's blocks share one GPC, so this can be less than the resident blocks / ``cluster``).
    The function's dynamic shared-memory limit must already allow ``shared_mem``; the caller makes
    its context current."""
    cfg, addr = _config(False, cluster)  # the launch configuration with the cluster attribute
    cfg.gridDimX = cluster
    cfg.blockDimX = threads
    cfg.sharedMemBytes = shared_mem
    # The configuration is shared with launches, which leave their stream in it; the driver reads
    # a stream here too, and one of another GPU's context fails the query (CUDA_ERROR_INVALID_HANDLE).
    cfg.hStream = None
    n = ctypes.c_int(0)
    check(lib().cuOccupancyMaxActiveClusters(ctypes.byref(n), func, addr),
          f"cuOccupancyMaxActiveClusters(cluster {cluster}, {threads} threads, {shared_mem} bytes)")
    return n.value


TENSOR_MAP_BYTES = 128
"""Size of a ``CUtensorMap`` (the driver wants it 64-byte aligned)."""

_CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1
_CU_TENSOR_MAP_INTERLEAVE_NONE = 0
_CU_TENSOR_MAP_SWIZZLE_128B = 3
_CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
_CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # elements outside the tensor read as zero


def encode_tensor_map_2d(out_address: int, base: int, rows: int, cols: int, box_rows: int, box_cols: int) -> None:
    """Write the tensor map of a row-major ``[rows, cols]`` tensor of 16-bit elements at ``base``
    to the 128 bytes at ``out_address`` (64-byte aligned host memory).

    One copy through the map moves a box of ``box_rows x box_cols`` elements (``box_cols * 2``
    must be 128: one row of the 128-byte swizzle), swizzled with the 128-byte pattern; elements
    outside the tensor read as zero. ``base`` must be 16-byte aligned and ``cols * 2`` a multiple
    of 16 (the driver's rules).
    """
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols * 2)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    check(lib().cuTensorMapEncodeTiled(out_address, _CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, base, dims, strides, box, elem,
                                       _CU_TENSOR_MAP_INTERLEAVE_NONE, _CU_TENSOR_MAP_SWIZZLE_128B,
                                       _CU_TENSOR_MAP_L2_PROMOTION_L2_256B, _CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
          f"cuTensorMapEncodeTiled([{rows}, {cols}], box [{box_rows}, {box_cols}])")
