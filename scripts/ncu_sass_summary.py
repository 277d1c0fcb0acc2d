"""Summarize one kernel's per-instruction profile from Nsight Compute's source page.

Input: the CSV that ``ncu --section SourceCounters --section WarpStateStats --page source
--print-source sass --csv <app>`` prints for one profiled launch (one row per SASS instruction
with its executed count, stall samples and memory counters). Output: where the executed
instructions and the stall samples go, by opcode, by how many times an instruction ran (a proxy
for the code region: once per block, per warp, per loop trip), by stall reason (overall and per
region), and the instructions with the most shared-memory bank-conflict wavefronts, global excess
sectors and stall samples.

    ncu -k regex:kbit_kv_decode --launch-skip 3 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats --page source --print-source sass --csv \\
        python3 scripts/bench_kv_attention.py --context 32768 --batch 1 --mixes 4 > sass.csv
    python3 scripts/ncu_sass_summary.py sass.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import math
from pathlib import Path

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
SHARED_EXCESS = "L1 Wavefronts Shared Excessive"
SHARED_IDEAL = "L1 Wavefronts Shared Ideal"
GLOBAL_EXCESS = "L2 Theoretical Sectors Global Excessive"
GLOBAL_TOTAL = "L2 Theoretical Sectors Global"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path: Path) -> list[dict[str, str]]:
    """The instruction rows of the first kernel in the file (ncu prints log lines before the CSV)."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError(f"{path}: no source-page CSV header (run ncu with --page source --print-source sass --csv)")
    rows = []
    for row in csv.DictReader(lines[start:]):
        if not (row.get("Address") or "").startswith("0x"):
            break  # the next kernel's block, or the end
        rows.append(row)
    return rows


def opcode(source: str) -> str:
    """``@!P1 IMAD.U32 R5, ...`` -> ``IMAD``."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def summarize(rows: list[dict[str, str]], top: int) -> None:
    executed = sum(_number(r[EXECUTED]) for r in rows)
    samples = sum(_number(r[SAMPLES]) for r in rows) or 1.0
    print(f"{len(rows)} instructions; {executed:.0f} warp instructions executed; {samples:.0f} stall samples")

    by_op, op_samples = collections.Counter(), collections.Counter()
    by_runs, run_samples = collections.Counter(), collections.Counter()
    for r in rows:
        e, s = _number(r[EXECUTED]), _number(r[SAMPLES])
        by_op[opcode(r["Source"])] += e
        op_samples[opcode(r["Source"])] += s
        if e > 0:
            runs = 2 ** round(math.log2(e))
            by_runs[runs] += e
            run_samples[runs] += s
    print("\nopcode       executed  samples")
    for op, e in by_op.most_common(top):
        print(f"  {op:10s} {100 * e / executed:6.1f}%  {100 * op_samples[op] / samples:6.1f}%")
    print("\nruns per instruction (nearest power of two): executed, samples")
    for runs in sorted(by_runs):
        if by_runs[runs] > 0.005 * executed or run_samples[runs] > 0.005 * samples:
            print(f"  ~{runs:8d}  {100 * by_runs[runs] / executed:6.1f}%  {100 * run_samples[runs] / samples:6.1f}%")
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    print("\nstall reasons (share of samples)")
    for k in sorted(reasons, key=lambda k: -sum(_number(r[k]) for r in rows)):
        share = sum(_number(r[k]) for r in rows) / samples
        if share >= 0.01:
            print(f"  {k[6:]:18s} {100 * share:6.1f}%")

    # The stall reasons of each region (runs class) with a large share of the samples: e.g. whether
    # the once-per-warp prologue waits on memory, on barriers or on instruction fetch (no_instruction).
    print("\nstall reasons by runs per instruction (classes with >= 5 % of the samples; top 4 reasons)")
    for runs in sorted(by_runs):
        if run_samples[runs] < 0.05 * samples:
            continue
        members = [r for r in rows if _number(r[EXECUTED]) > 0 and 2 ** round(math.log2(_number(r[EXECUTED]))) == runs]
        shares = {k[6:]: sum(_number(r[k]) for r in members) / run_samples[runs] for k in reasons}
        best = sorted(shares.items(), key=lambda kv: -kv[1])[:4]
        print(f"  ~{runs:8d}  " + ", ".join(f"{name} {100 * share:.0f}%" for name, share in best))

    def table(title: str, key: str, extra: str, labels: tuple[str, str]) -> None:
        print(f"\n{title}")
        for r in sorted(rows, key=lambda r: -_number(r[key]))[:top // 2]:
            if _number(r[key]) == 0:
                break
            print(f"  {r['Address'][-5:]}  {r['Source'].strip()[:58]:58s} runs {_number(r[EXECUTED]):8.0f}  "
                  f"{labels[0]} {_number(r[key]):8.0f}  {labels[1]} {_number(r[extra]):8.0f}")

    if SHARED_EXCESS in rows[0]:
        table("shared-memory excess wavefronts (bank conflicts)", SHARED_EXCESS, SHARED_IDEAL, ("excess", "ideal"))
    if GLOBAL_EXCESS in rows[0]:
        table("global excess sectors", GLOBAL_EXCESS, GLOBAL_TOTAL, ("excess", "of"))
    if SHARED_EXCESS in rows[0]:
        table("stall samples", SAMPLES, SHARED_EXCESS, ("samples", "shared excess"))
    else:
        table("stall samples", SAMPLES, EXECUTED, ("samples", "runs"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="ncu --page source --print-source sass --csv output")
    parser.add_argument("--top", type=int, default=24, help="rows per table")
    args = parser.parse_args()
    if args.top < 2:
        parser.error("--top must be at least 2")
    summarize(read_rows(args.csv), args.top)


if __name__ == "__main__":
    main()
