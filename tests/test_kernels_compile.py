"""Build check for every CUDA kernel instance, with nvcc, for sm_80 and sm_90 (no GPU needed).

At run time the kernels are compiled by NVRTC, one template instance at a time; here every
instance the backend can launch is instantiated in one translation unit per source file (the
text the loader hands NVRTC, headers inlined) and built for both architectures, so a change that breaks any of them fails in CI. The ptxas
resource report (registers, spills, stack) is printed as a table. Skipped when nvcc is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kbit_linear.backends import cuda as kcuda
from kbit_linear.backends import decode as kdecode
from kbit_linear.backends.loader import read_source

NVCC = shutil.which("nvcc")
ARCHS = ("80", "90")
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _demangle(sym: str) -> str:
    """``_Z9kbit_gemmILi4ELi1ELi0EE...`` -> ``kbit_gemm<4, 1, 0>`` (integer template arguments only)."""
    m = re.match(r"_Z(\d+)", sym)
    if not m:
        return sym
    n = int(m.group(1))
    name = sym[m.end(): m.end() + n]
    args = re.findall(r"Li(-?\d+)E", sym[m.end() + n:].split("EE", 1)[0] + "E")
    return f"{name}<{', '.join(args)}>" if args else name


def _translation_unit(source: str, instances: list[str]) -> str:
    # Taking each instance's address instantiates it; NVRTC does the same through name expressions.
    refs = ",\n".join(f"    (const void*)&{name}" for name in instances)
    return f'#include "{source}"\nconst void* kbit_instances[] = {{\n{refs}\n}};\n'


def _build(source: str, instances: list[str], workdir: Path) -> subprocess.CompletedProcess:
    # The source exactly as NVRTC gets it (headers inlined by the loader) and no include path,
    # so an include the loader does not resolve fails here too.
    expanded = workdir / f"expanded_{Path(source).stem}.cu"
    expanded.write_text(read_source(source))
    tu = workdir / f"inst_{Path(source).stem}.cu"
    tu.write_text(_translation_unit(expanded.name, instances))
    cmd = [NVCC, "-std=c++17", "-c", str(tu), "-o", str(tu.with_suffix(".o")), "-Xptxas", "-v", "--threads", "2"]
    for a in ARCHS:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


def _resource_table(log: str) -> list[tuple[str, str, int, int, int]]:
    rows, current = [], None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = [_demangle(m.group(1)), m.group(2), 0, 0, 0]
        elif current is not None and (m := _SPILL.search(line)):
            current[3], current[4] = int(m.group(2)), int(m.group(1))
        elif current is not None and (m := _REGS.search(line)):
            current[2] = int(m.group(1))
            rows.append(tuple(current))
            current = None
    return rows


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: kernel build check skipped")
def test_every_kernel_instance_builds_for_sm80_and_sm90():
    jobs = {"gemm.cu": kcuda.gemm_instances(), "quantize.cu": kcuda.format_instances(), "decode.cu": kdecode.decode_instances()}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        results = dict(zip(jobs, pool.map(lambda kv: _build(kv[0], kv[1], Path(tmp)), jobs.items())))
    failures = [f"{src}:\n{r.stderr[-6000:]}" for src, r in results.items() if r.returncode != 0]
    assert not failures, "kernel build failed:\n" + "\n".join(failures)
    rows = [row for r in results.values() for row in _resource_table(r.stderr + r.stdout)]
    print("\n| kernel | arch | registers | spill bytes (st) | stack bytes |")
    print("|---|---|---|---|---|")
    for name, arch, regs, spill, stack in sorted(rows):
        print(f"| {name} | sm_{arch} | {regs} | {spill} | {stack} |")
    expected = sum(len(v) for v in jobs.values()) * len(ARCHS)
    assert len(rows) == expected, f"ptxas reported {len(rows)} entry points, expected {expected}"
