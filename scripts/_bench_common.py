"""Measurement helpers shared by every benchmark script (``bench_gemm.py``, ``bench_generate.py``,
``bench_decode.py``, ``kernel_bench.py``).

One place for: the facts that make a result reproducible (GPU, driver, library versions, the
exact command), the GPU's L2 size (from the device properties), the two hardware ceilings
measured in the same run (device-to-device copy bandwidth and the fp16 matmul peak), CUDA-graph
timing with weight copies rotated past L2, the wall time of eager calls, the optional peers
(bitsandbytes, gemlite) and their availability notes, and the output forms (markdown, JSON).

Timing method (``time_calls``): ``fn(i)`` is one call on weight copy ``i``. Enough copies are
made (``weight_copies``) that they do not fit in L2 together, many calls cycling through the
copies are captured in one CUDA graph, the graph is replayed several times with CUDA events
around each replay, and the median replay time divided by the number of calls is reported. A
callable that cannot be captured is timed the same way without the graph
(``method == "events"``), which includes the launch gaps and is marked as such in every table.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    # The scripts run from a checkout without an install: make the package importable.
    sys.path.insert(0, str(REPO_ROOT))

__all__ = [
    "REPO_ROOT",
    "Timing",
    "require_cuda",
    "environment",
    "l2_bytes",
    "measure_copy_bandwidth",
    "measure_matmul_peak",
    "copies_past_l2",
    "weight_copies",
    "time_calls",
    "eager_wall_us",
    "tensor_bytes",
    "random_tiles",
    "optional_import",
    "kbit_cuda_status",
    "kbit_api",
    "markdown_table",
    "replace_atomically",
    "write_text",
    "write_json",
    "write_outputs",
    "save_figure",
    "env_lines",
    "fmt",
]


# ---------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU model name (``/proc/cpuinfo`` where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def require_cuda() -> torch.device:
    """The current CUDA device; exits with a clear message when there is none."""
    if not torch.cuda.is_available():
        sys.exit("a CUDA GPU is required for the benchmarks (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """Facts that identify a run: date, GPU, driver, library versions and the exact command.

    Args:
        device: the CUDA device the run uses.

    Returns:
        A JSON-serialisable dict.
    """
    if not isinstance(device, torch.device) or device.type != "cuda":
        raise TypeError(f"device must be a CUDA torch.device, got {device!r}")
    props = torch.cuda.get_device_properties(device)
    cupy_version = None
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        cupy_version = cupy_version or _version(dist)
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "l2_bytes": l2_bytes(device),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "driver": _driver_version(),
        "cuda_runtime": torch.version.cuda,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cupy": cupy_version,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "bitsandbytes": _version("bitsandbytes"),
        "gemlite": _version("gemlite"),
        "command": command_line(sys.argv),
    }


def command_line(argv: Sequence[str]) -> str:
    """The command as run, for a results page: paths inside the repository relative to its root,
    other absolute paths (a scratch or output folder of the machine) cut to their file names."""

    def portable(arg: str) -> str:
        prefix, sep, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
        if os.path.isabs(value):
            path = Path(value)
            try:
                value = str(path.resolve().relative_to(REPO_ROOT))
            except ValueError:
                value = path.name
        return prefix + sep + value

    return "python3 " + " ".join(shlex.quote(portable(a)) for a in argv)


def l2_bytes(device: torch.device | int | None = None) -> int:
    """The L2 cache size of a CUDA device in bytes, from its device properties.

    Args:
        device: the CUDA device (default: the current one).
    """
    if device is None:
        device = torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def optional_import(name: str) -> tuple[Any | None, str]:
    """Import an optional peer library.

    Returns:
        ``(module, "")`` on success, else ``(None, reason)`` with the error in one line.
    """
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # noqa: BLE001  (any import-time failure means "not available")
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def kbit_cuda_status() -> tuple[bool, str]:
    """Whether the kbit CUDA backend is importable here (the fused kernels exist).

    Returns:
        ``(True, "")`` or ``(False, reason)``.
    """
    mod, why = optional_import("kbit_linear.backends.cuda")
    if mod is None:
        return False, f"kbit_linear.backends.cuda not importable ({why})"
    if not hasattr(mod, "gemm_path"):
        return False, "kbit_linear.backends.cuda has no gemm_path()"
    return True, ""


def kbit_api(name: str) -> Any:
    """``kbit_linear.<name>`` (``KbitLinear``, ``quantize_model``), from the package top level
    or, where the top level does not export it, from its own module."""
    import kbit_linear

    if hasattr(kbit_linear, name):
        return getattr(kbit_linear, name)
    module = {"KbitLinear": "kbit_linear.linear", "quantize_model": "kbit_linear.patch"}.get(name)
    if module is None:
        raise ValueError(f"unknown kbit_linear API name {name!r}")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------
# the two ceilings
# ---------------------------------------------------------------------------------------


def _event_ms(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Event-timed milliseconds of ``fn()``, ``repeats`` times (after the caller's warm-up)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2**31, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.

    Args:
        device: CUDA device.
        nbytes: size of the source buffer (default 2 GiB, far past any L2).
        repeats: timed copies; the median is reported.

    Returns:
        GB/s (1e9 bytes per second).
    """
    if nbytes <= 0 or repeats <= 0:
        raise ValueError(f"nbytes and repeats must be positive, got {nbytes}, {repeats}")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(_event_ms(lambda: dst.copy_(src), repeats))
    src = dst = None  # release before emptying the cache
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def measure_matmul_peak(device: torch.device, n: int = 8192, dtype: torch.dtype = torch.float16, repeats: int = 20) -> float:
    """Dense matmul rate of ``[n, n] @ [n, n]`` on random data, in TFLOP/s (median of repeats).

    Args:
        device: CUDA device.
        n: matrix size (default 8192).
        dtype: torch.float16 or torch.bfloat16.
        repeats: timed products.

    Returns:
        TFLOP/s.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float16 or bfloat16, got {dtype}")
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(20):  # ~30 ms: lets the clocks settle before timing
        torch.mm(a, b)
    ms = statistics.median(_event_ms(lambda: torch.mm(a, b), repeats))
    a = b = None  # release before emptying the cache
    torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------


@dataclass
class Timing:
    """One timed callable.

    Attributes:
        us: median microseconds per call.
        us_min: fastest repeat, per call.
        us_max: slowest repeat, per call.
        calls: calls per timed repeat (per graph replay).
        repeats: timed repeats.
        method: "graph" (CUDA-graph replay) or "events" (plain launches between CUDA events).
        note: why the graph was not used, if it was not.
    """

    us: float
    us_min: float
    us_max: float
    calls: int
    repeats: int
    method: str
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return asdict(self)


def quantize_rows(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` ``[N, K]`` (on a GPU) quantized with the normal-float codebook by the backend's
    quantize op, 4096 rows at a time (the temporaries stay small at 28672 x 8192): ``(tiled
    planes, scales, codebook, tensor scale)``."""
    from kbit_linear import format as kfmt  # the package, on the path this module set up

    codebook = kfmt.create_normal_float_codebook(bits, device=w.device)
    ts = kfmt.compute_tensor_scale(w)
    flats = [torch.ops.kbit_linear.quantize(w[r : r + 4096], codebook, ts, bits) for r in range(0, w.shape[0], 4096)]
    packed, absmax = torch.ops.kbit_linear.repack(torch.cat([f[0] for f in flats]), torch.cat([f[1] for f in flats]), bits)
    return packed, absmax, codebook, ts


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Total storage bytes of the given tensors (``None`` counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def random_tiles(k: int, n: int, bits: int, experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tiled kbit codes of an ``in_features = k``, ``out_features = n`` weight (``experts`` of
    them stacked, if given) on the GPU: pair codes where the bit width has them, as layers hold them
    there, and E4M4 scale codes of moderate size. Every bit pattern is a valid weight."""
    from kbit_linear import format as fmt

    n_pad, k_pad = fmt.padded_shape(n, k)
    lead = () if experts is None else (experts,)
    shape = lead + (k_pad // fmt.TILE_K, n_pad // fmt.TILE_N, fmt.TILE_N, 2)
    packed = torch.randint(-(2**31), 2**31 - 1, shape + (bits,), device="cuda", dtype=torch.int32)
    if fmt.has_pair_codes(bits):
        packed = fmt.to_pair_codes(packed)
    return packed, torch.randint(0x50, 0xD0, shape, device="cuda", dtype=torch.uint8)


def copies_past_l2(bytes_per_copy: int, l2: int, factor: float = 2.0, max_copies: int | None = 64) -> int:
    """How many copies of a weight make a working set of at least ``factor * l2``.

    Args:
        bytes_per_copy: bytes one call reads from its weight copy.
        l2: the GPU's L2 size in bytes (:func:`l2_bytes`).
        factor: working set over L2 (2 leaves no copy resident when the next use of it comes).
        max_copies: upper bound, or ``None`` for none (small weights then get many copies).

    Returns:
        At least 2.
    """
    if bytes_per_copy <= 0 or l2 <= 0:
        raise ValueError(f"bytes_per_copy and l2 must be positive, got {bytes_per_copy}, {l2}")
    n = max(2, math.ceil(factor * l2 / bytes_per_copy))
    return int(n if max_copies is None else min(max_copies, n))


_W = TypeVar("_W")


def _clone(weight: Any) -> Any:
    """A copy of a tensor, or of a tuple of tensors, in fresh memory."""
    if isinstance(weight, torch.Tensor):
        return weight.clone()
    if isinstance(weight, tuple):
        return tuple(_clone(t) for t in weight)
    raise TypeError(f"cannot clone a {type(weight).__name__}; pass make= to build the copies")


def weight_copies(
    first: _W,
    l2: int | None = None,
    *,
    nbytes: int | None = None,
    make: Callable[[], _W] | None = None,
    max_copies: int | None = 64,
) -> list[_W]:
    """``first`` and enough further copies of it that cycling through them reads every call's
    weight from DRAM, not from L2 (see :func:`copies_past_l2`).

    Args:
        first: one weight: a tensor, a tuple of tensors, or anything ``make`` builds.
        l2: the GPU's L2 size in bytes (default: the current device's, :func:`l2_bytes`).
        nbytes: bytes one call reads from a copy (default: the storage of ``first``'s tensors).
        make: builds one more copy (default: clones ``first``'s tensors).
        max_copies: passed to :func:`copies_past_l2`.

    Returns:
        The copies, ``first`` at index 0.
    """
    if nbytes is None:
        nbytes = tensor_bytes(*(first if isinstance(first, tuple) else (first,)))
    n = copies_past_l2(nbytes, l2_bytes() if l2 is None else l2, max_copies=max_copies)
    build = make if make is not None else (lambda: _clone(first))
    return [first] + [build() for _ in range(n - 1)]


def capture_graph(fn: Callable[[], Any], warmup: int = 1,
                  warm: Callable[[], Any] | None = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn()`` captured into a CUDA graph, after ``warmup`` calls of ``warm`` (default ``fn``) on
    a side stream, as ``torch.cuda.graphs`` requires: compilation, workspaces and library set-up
    happen outside the capture. Returns the graph and what the captured call returned (its output
    tensors, which every replay refreshes). Raises what the capture raises (a call that syncs the
    host, say), after releasing the failed graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            (warm or fn)()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = fn()
    except BaseException:
        del graph
        raise
    return graph, out


def time_calls(
    fn: Callable[[int], Any],
    n_copies: int,
    *,
    target_ms: float = 3.0,
    repeats: int = 7,
    min_calls: int = 1,
    max_calls: int = 1000,
    use_graph: bool = True,
    fallback: bool = True,
) -> Timing:
    """Median time of one call of ``fn``, replayed from a CUDA graph over rotated weight copies.

    Args:
        fn: ``fn(i)`` runs one call on weight copy ``i`` (``0 <= i < n_copies``) on the current
            stream; it must not synchronize.
        n_copies: number of weight copies ``fn`` cycles through.
        target_ms: GPU time one graph replay should take (sets the calls per graph).
        repeats: timed replays; the median is reported.
        min_calls: lower bound on calls per graph (wins over ``target_ms`` and ``max_calls``;
            ``min_calls == max_calls`` fixes the count).
        max_calls: upper bound on calls per graph.
        use_graph: False forces plain event timing.
        fallback: False raises where the calls cannot be captured in a CUDA graph, instead of
            timing them with plain events.

    Returns:
        A :class:`Timing`.
    """
    if min(n_copies, repeats, min_calls, max_calls) < 1:
        raise ValueError(f"n_copies, repeats, min_calls and max_calls must be >= 1, got "
                         f"{n_copies}, {repeats}, {min_calls}, {max_calls}")
    # Warm-up: compiles, autotunes and allocates outside the timed region.
    for i in range(min(n_copies, 3)):
        fn(i)
    torch.cuda.synchronize()
    # Rough per-call time (launch gaps included) to size the graph.
    est_calls = min(n_copies, 8)
    est = statistics.median(_event_ms(lambda: [fn(i) for i in range(est_calls)], 3)) / est_calls
    calls = max(1, math.ceil(target_ms / max(est, 1e-4)))
    calls = max(calls, n_copies)  # every copy at least once per replay
    calls = min(calls, max(1, math.ceil(4 * target_ms / max(est, 1e-4))), max_calls)
    calls = max(calls, min_calls)

    def run_all() -> None:
        for j in range(calls):
            fn(j % n_copies)

    note = ""
    if use_graph:
        try:
            graph, _ = capture_graph(run_all, warm=lambda: fn(0))
            graph.replay()
            torch.cuda.synchronize()
            per_rep = _event_ms(graph.replay, repeats)
            del graph
            return _timing(per_rep, calls, repeats, "graph", "")
        except Exception as exc:  # noqa: BLE001  (a peer that cannot be captured falls back)
            if not fallback:
                raise
            note = f"not capturable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
            torch.cuda.synchronize()
    run_all()
    torch.cuda.synchronize()
    per_rep = _event_ms(run_all, repeats)
    return _timing(per_rep, calls, repeats, "events", note)


def eager_wall_us(
    fn: Callable[[], Any], calls: int, *, warmup: int, repeats: int = 1, wait: bool = True
) -> float:
    """Wall microseconds per call of ``calls`` back-to-back eager calls of ``fn()``.

    Args:
        fn: one call; launches on the current stream.
        calls: calls per timed repeat.
        warmup: untimed calls first (then a synchronize).
        repeats: timed repeats; the median is reported.
        wait: True stops each repeat's clock after the GPU has finished (host and GPU together:
            on a launch-bound shape, the host's time per call); False stops it when the last
            call returns (the host's issue time only).

    Returns:
        Median microseconds per call.
    """
    if calls < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"calls and repeats must be >= 1 and warmup >= 0, got {calls}, {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if wait:
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(walls)


def _timing(per_rep_ms: Sequence[float], calls: int, repeats: int, method: str, note: str) -> Timing:
    per_call = [1e3 * t / calls for t in per_rep_ms]
    return Timing(statistics.median(per_call), min(per_call), max(per_call), calls, repeats, method, note)


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    """A table cell: ``-`` for missing values, else fixed-point with ``digits`` decimals."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table.

    Args:
        headers: column titles.
        rows: one sequence of cells (converted with ``str``) per row, as long as ``headers``.

    Returns:
        The table text, one line per row, no trailing newline.
    """
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row {list(r)} has {len(r)} cells, expected {len(headers)}")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def replace_atomically(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Create or rewrite the file ``path`` so that it never holds a half-written state.

    ``write(tmp)`` writes the new content to a temporary file in the same folder (same suffix,
    so writers that pick the format from the name still do), which then replaces ``path`` with
    ``os.replace``: a run killed mid-write leaves the previous complete file, not a torn one.
    The parent folder is created.

    Args:
        path: the file to write.
        write: writes the whole content to the path it is given.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # Same folder (os.replace is atomic only within one file system); the pid keeps two runs apart.
    tmp = p.with_name(f".{p.stem}.{os.getpid()}.tmp{p.suffix}")
    try:
        write(tmp)
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`replace_atomically`)."""
    replace_atomically(path, lambda tmp: tmp.write_text(text))


def write_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Write ``payload`` as indented JSON, atomically, creating the parent folder."""
    write_text(path, json.dumps(payload, indent=1, default=str) + "\n")


def env_lines(env: dict[str, Any], ceilings: dict[str, float] | None = None) -> list[str]:
    """Markdown bullet lines describing a run's environment (for the results files)."""
    lines = [
        f"- date: {env['date_utc']}",
        f"- GPU: {env['gpu']} ({env['sm_count']} SMs, L2 {env['l2_bytes'] / 2**20:.0f} MiB, "
        f"{env['gpu_memory_gib']} GiB), driver {env['driver']}, CUDA runtime {env['cuda_runtime']}",
        f"- python {env['python']}, torch {env['torch']}, CuPy {env['cupy']}, triton {env['triton']}, "
        f"transformers {env['transformers']}, bitsandbytes {env['bitsandbytes']}, gemlite {env['gemlite']}",
        f"- command: `{env['command']}`",
    ]
    if ceilings:
        lines.append(
            f"- measured in the same run: device-to-device copy {ceilings['copy_gbps']:.0f} GB/s (read + write), "
            f"fp16 matmul 8192^3 {ceilings['matmul_tflops']:.0f} TFLOP/s"
        )
    return lines


def write_outputs(args: Any, payload: dict[str, Any], text: str, plot: Callable[[dict[str, Any], str], None]) -> None:
    """Write the JSON (``args.json``), markdown (``args.md``) and PNG (``args.plot``) files asked for.

    Every file is replaced atomically (the plot through :func:`save_figure`), so the function
    can be called again after each new result: the files then always hold a complete snapshot.
    """
    if args.json:
        write_json(args.json, payload)
    if args.md:
        write_text(args.md, text + "\n")
    if args.plot:
        plot(payload, args.plot)


def save_figure(fig: Any, path: str) -> None:
    """Save a matplotlib figure as PNG, atomically (creating the parent folder), and close it."""
    import matplotlib.pyplot as plt

    p = Path(path)
    if not p.suffix:
        p = p.with_suffix(".png")  # what savefig itself does with a bare name
    try:
        # The temporary file keeps the suffix, so the format is still picked from the name.
        replace_atomically(p, lambda tmp: fig.savefig(tmp, dpi=110))
    finally:
        plt.close(fig)
