"""The benchmark scripts' shared helpers that need no GPU (``scripts/_bench_common.py``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench_common():
    spec = importlib.util.spec_from_file_location("_bench_common", ROOT / "scripts" / "_bench_common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_bench_common", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_command_line_names_no_machine_path() -> None:
    bc = _bench_common()
    argv = [str(ROOT / "scripts" / "bench_gemm.py"), "--md", "/somewhere/out/gemm.md", "--json=/tmp/run 1/gemm.json",
            "--m", "64", "bench/results/x.md"]
    line = bc.command_line(argv)
    assert line == "python3 scripts/bench_gemm.py --md gemm.md --json=gemm.json --m 64 bench/results/x.md"
    assert "/somewhere" not in line and "/tmp" not in line and str(ROOT) not in line
