"""The decode plan's cost model against the committed timings of every launch shape x schedule
(``bench/results/decode-plan-fit-h100.json`` and ``decode-plan-fit-k{2,3,4,5}-h200.json``,
``scripts/tune_decode_plan.py``): no GPU needed. Each GPU's plans are made as on that GPU (its
SMs, shared memory and name, which picks ``tuning.DECODE_CONFIGS_BY_GPU``).

A change to the launch shapes or to the cost constants that makes the plans slower on the cases
measured fails here, before any GPU run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FITS = {"h100": ["decode-plan-fit-h100.json"], "h200": [f"decode-plan-fit-k{b}-h200.json" for b in (2, 3, 4, 5)]}


def _script():
    spec = importlib.util.spec_from_file_location("tune_decode_plan", ROOT / "scripts" / "tune_decode_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=sorted(FITS))
def fit(request):
    script = _script()
    files = [json.loads((RESULTS / name).read_text()) for name in FITS[request.param]]
    props = script.gpu_properties(files[0])
    assert all(script.gpu_properties(d) == props for d in files), "one GPU per fixture"
    return script, [c for d in files for c in d["cases"]], props


def test_every_plan_is_a_measured_choice(fit):
    """The planner only picks (launch shape, schedule) pairs the fit file timed: the file covers
    the tuned shapes, so its figures describe the plans the code makes."""
    script, cases, props = fit
    missing = [script._label(c) for c, us in script._picks(cases, props) if us is None]
    assert not missing, f"plans without a timing: {missing[:5]}"


def test_plans_stay_close_to_the_fastest_choice(fit):
    """Per bit width, the plans are within 2.5 % of the fastest measured choice on average
    (geometric mean over the cases) and never 20 % off; and no worse (within 0.5 %) than the
    plans of the constants the timings were collected with, timed in the same runs."""
    script, cases, props = fit
    now = script._summary(script._picks(cases, props))
    collected = script._summary(script.collected_picks(cases))
    for bits, (geo, worst, where) in now.items():
        assert geo <= 1.025, f"K = {bits}: plans {geo:.3f}x the fastest on average"
        assert worst <= 1.2, f"K = {bits}: {where} {worst:.3f}x the fastest"
        assert geo <= collected[bits][0] * 1.005, f"K = {bits}: {geo:.3f} against {collected[bits][0]:.3f} before"
