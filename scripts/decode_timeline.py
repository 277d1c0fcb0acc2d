"""Where a decode-kernel call's time goes: per-block phase timestamps in a CUDA-graph chain of calls.

The script compiles an instrumented copy of ``kernels/decode.cu`` (text substitutions below; the
repository's kernel is not changed): thread 0 of every block writes ``%globaltimer`` at its start,
``clock64()`` after the table build, after the dependency wait, before the first lookup, after the
first item's lookups and around the last segment's reduction, and every warp ``atomicMax``es
``%globaltimer`` after its reduction. The buffer is passed as the kernel's ``counters`` argument, so
only plans that do not split row tiles over blocks can be timed (the script asserts it). A chain of
``--calls`` launches on different random 4-bit weights (pair codes, bf16 x, M = 1) is captured in a
CUDA graph and replayed; the printed figures are medians over the middle calls, in ns:

- ``gap``: first block's start minus the previous call's last block end (negative: the call's blocks
  started early, under programmatic launch); ``wait_release``: the median block's wait release
  after the previous call's end; ``build``: start to the end of the table build; ``wait``: time in
  the dependency wait; ``sync``: wait to the first lookup (loads issued, codebook checked);
  ``first``: the first item's lookups; ``loop``: the rest of the block's items; ``reduce``: the
  last segment's in-block reduction and store.

Usage (from the repository root, GPU):

    python3 scripts/decode_timeline.py 4096x1024 2048x5120 4096x4096 4096x14336 [--json t.json]
"""

from __future__ import annotations

import argparse
import statistics as st
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402  (puts the repository on the path)
from kbit_linear import format as fmt  # noqa: E402
from kbit_linear.backends.cuda import decode, loader  # noqa: E402

# Slots of a block's 16 timeline words.
START_NS, START_CLK, BUILT_CLK, RELEASED_CLK, FIRST_LOOKUP_CLK, FIRST_ITEM_CLK, REDUCE_CLK, STORED_CLK = range(8)
SMID, RELEASED_NS, END_NS = 9, 10, 11

_HELPERS = """
namespace kbit_decode {
KBIT_DEVICE unsigned long long kbit_gt() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
KBIT_DEVICE unsigned kbit_smid() { unsigned s; asm volatile("mov.u32 %0, %smid;" : "=r"(s)); return s; }
}
"""
_NS, _CLK = "kbit_gt()", "(unsigned long long)clock64()"


def _mark(slot: int, value: str) -> str:
    return f"if (threadIdx.x == 0) {{ tl_[blockIdx.x * 16 + {slot}] = ({value}); }}"


def instrumented_source() -> str:
    """``kernels/decode.cu`` with the timeline stores (each anchor must be found once)."""
    src = loader.read_source("decode.cu").replace("namespace kbit_decode {", _HELPERS + "namespace kbit_decode {", 1)
    edits = [
        ("    allow_dependent_launch();\n    // A grouped",
         "    unsigned long long* tl_ = (unsigned long long*)counters;\n    " + _mark(START_NS, _NS) + _mark(START_CLK, _CLK)
         + _mark(SMID, "kbit_smid()") + "\n    allow_dependent_launch();\n    // A grouped"),
        ("    grid_dependency_wait();\n    if constexpr (GROUPED) {",
         "    " + _mark(BUILT_CLK, _CLK) + "\n    grid_dependency_wait();\n    " + _mark(RELEASED_CLK, _CLK) + _mark(RELEASED_NS, _NS)
         + "\n    if constexpr (GROUPED) {"),
        ("    if (n_mine == 0) return;\n    const float tscale",
         "    " + _mark(FIRST_LOOKUP_CLK, _CLK) + "\n    if (n_mine == 0) return;\n    const float tscale"),
        ("                lookup_mma<BITS, DT, MT, PAIRS>(o, bx, acc[r], lanebase, lut_win);\n            }",
         "                lookup_mma<BITS, DT, MT, PAIRS>(o, bx, acc[r], lanebase, lut_win);\n            }\n            if (j == 0) { "
         + _mark(FIRST_ITEM_CLK, _CLK) + " }"),
        ("            const int s2 = (seg & 1) * NWR + wr;", "            " + _mark(REDUCE_CLK, _CLK) + "\n            const int s2 = (seg & 1) * NWR + wr;"),
        ("            zero_acc<R, MT>(acc);\n            j_first = j + 1;",
         "            " + _mark(STORED_CLK, _CLK) + f"\n            if ((threadIdx.x & 31) == 0) atomicMax(tl_ + blockIdx.x * 16 + {END_NS}, kbit_gt());"
         "\n            zero_acc<R, MT>(acc);\n            j_first = j + 1;"),
    ]
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(f"kernels/decode.cu changed: anchor not found once: {old!r}")
        src = src.replace(old, new)
    return src


def _phases(d, i: int) -> dict[str, float]:
    """Call i's figures (ns) from the timeline words d [calls, blocks, 16]."""
    b = d[i]
    start, end = b[:, START_NS].min(), b[:, END_NS].max()
    prev_end = d[i - 1][:, END_NS].max()
    # the SM clock, from each block's cycles and nanoseconds between its start and its release
    ghz = st.median([(r[RELEASED_CLK] - r[START_CLK]) / (r[RELEASED_NS] - r[START_NS]) for r in b if r[RELEASED_NS] - r[START_NS] > 500] or [1.9])

    def span(a: int, c: int) -> float:
        return st.median([(r[c] - r[a]) / ghz for r in b])

    figures = dict(gap=start - prev_end, wait_release=st.median(b[:, RELEASED_NS]) - prev_end,
                   start_spread=b[:, START_NS].max() - start, end_spread=end - b[:, END_NS].min(),
                   build=span(START_CLK, BUILT_CLK), wait=span(BUILT_CLK, RELEASED_CLK), sync=span(RELEASED_CLK, FIRST_LOOKUP_CLK),
                   first=span(FIRST_LOOKUP_CLK, FIRST_ITEM_CLK), loop=span(FIRST_ITEM_CLK, REDUCE_CLK),
                   reduce=span(REDUCE_CLK, STORED_CLK), ghz=ghz)
    return {key: float(v) for key, v in figures.items()}


def run(shape: str, calls: int) -> dict:
    """Time one chain of ``calls`` launches of the shape's plan; print and return the medians."""
    k, n = map(int, shape.split("x"))
    bits, dtype, dev = 4, torch.bfloat16, torch.device("cuda")
    cb = fmt.create_normal_float_codebook(bits, "cuda")
    weights = [bc.random_tiles(k, n, bits) for _ in range(calls)]  # pair codes at 4 bits
    x = torch.randn(1, k, device=dev, dtype=dtype)
    out = torch.empty(1, n, device=dev, dtype=dtype)
    scale = torch.tensor([2.0 ** -6], device=dev)
    plan = decode.decode_plan(1, bits, dtype, n, weights[0][0].shape[0], dev, pairs=True)
    if plan.split:
        raise SystemExit(f"{shape}: the plan splits row tiles over blocks (its counters are in use); pick another shape")
    words = torch.zeros(calls, plan.grid, 16, dtype=torch.int64, device=dev)

    def chain() -> None:
        stream = loader._current_raw_stream(torch.cuda.current_device())
        for i, (packed, absmax) in enumerate(weights):
            values = decode._ARGS.Values(x=x.data_ptr(), packed=packed.data_ptr(), absmax=absmax.data_ptr(), codebook=cb.data_ptr(),
                                         tensor_scale=scale.data_ptr(), out=out.data_ptr(), ws=0, counters=words[i].data_ptr(), M=1,
                                         N=n, K=k, k_tiles=packed.shape[0], n_tiles=packed.shape[1], align=plan.align)
            decode._ARGS.launch(plan.kernel, plan.grid, plan.smem, stream, values, threads=plan.config.warps * 32,
                                programmatic=plan.programmatic)

    chain()  # compile and warm up
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        chain()
    for _ in range(3):
        graph.replay()
    per_call = st.median(bc._event_ms(graph.replay, 5)) * 1000 / calls
    words.zero_()  # the figures come from one more replay of its own
    graph.replay()
    d = words.cpu().numpy()
    if (d[:, :, END_NS] == 0).any():
        raise SystemExit(f"{shape}: a block of the plan has no items (no end stamp); pick another shape")
    rows = [_phases(d, i) for i in range(4, calls - 2)]
    med = {key: st.median(r[key] for r in rows) for key in rows[0]}
    print(f"{shape}: plan {tuple(vars(plan.config).values())} {plan.schedule} grid {plan.grid}, {per_call:.2f} us a call in the graph;"
          " medians (ns): " + ", ".join(f"{key} {v:.2f}" if key == "ghz" else f"{key} {v:.0f}" for key, v in med.items()), flush=True)
    return dict(shape=shape, per_call_us=per_call, config=list(vars(plan.config).values()), schedule=plan.schedule, grid=plan.grid, **med)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", help="in_features x out_features, e.g. 4096x4096")
    parser.add_argument("--calls", type=int, default=24, help="launches in the chain (different weights each)")
    parser.add_argument("--json", help="write the medians here")
    args = parser.parse_args()
    if args.calls < 8:
        parser.error("--calls must be at least 8 (the figures are medians over the middle calls)")
    bc.require_cuda()
    source, plain = instrumented_source(), loader.read_source
    loader.read_source = lambda name: source if name == "decode.cu" else plain(name)
    rows = [run(shape, args.calls) for shape in args.shapes]
    if args.json:
        bc.write_json(args.json, {"environment": bc.environment(torch.device("cuda")), "rows": rows})


if __name__ == "__main__":
    main()
