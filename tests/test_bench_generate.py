"""``scripts/bench_generate.py``'s profile summaries, which need no GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench_generate():
    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "scripts" / "bench_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_critical_path_charges_each_kernel_only_past_the_previous_end() -> None:
    """A kernel that starts before the previous one ends (a programmatic launch) is charged from
    that end; a gap between kernels is idle time; two steps are averaged."""
    bg = _bench_generate()
    step = [("kbit_decode_gemm", 0.0, 10.0), ("triton_poi_norm", 12.0, 15.0), ("kbit_token_gate_up", 13.0, 20.0)]
    spans = step + [(name, start + 100.0, end + 100.0) for name, start, end in step]
    text = bg.summarize_critical_path(spans, 2)
    # wall: 0 .. 120 over two steps; idle: 2 us in each step before the norm and 80 between the steps
    assert "wall time per step 0.060 ms" in text and "0.042 ms with no kernel running" in text
    lines = {line.split()[-1]: float(line.split()[0]) for line in text.splitlines() if line.strip().endswith(("gemm", "norm", "gate_up"))}
    assert lines == {"kbit_decode_gemm": 0.010, "triton_poi_norm": 0.003, "kbit_token_gate_up": 0.005}


def test_critical_path_of_no_kernels_is_empty() -> None:
    text = _bench_generate().summarize_critical_path([], 1)
    assert "wall time per step 0.000 ms" in text
