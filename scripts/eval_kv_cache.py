"""KL of a model's next-token distribution with KbitKVCache against the full-precision cache.

Each window is prefilled (``--prefill`` tokens) and then decoded teacher-forced for ``--steps``
tokens, once with transformers' DynamicCache and once per setting; the KL(dense || setting) of
the decode steps' next-token distributions is averaged. Settings: average 8 / 4 / 3 / 2.5 bits
(window 64 and 4 sinks at 8 bits) and uniform 2 bits (no window, no sinks), plus transformers'
QuantizedCache (quanto, HQQ) at 4 and 2 bits where those packages are installed.

    python scripts/eval_kv_cache.py                       # SmolLM2-135M-Instruct (embedded)
    python scripts/eval_kv_cache.py --model gemma-3-270m --windows 2 --prefill 1024 --steps 64
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, QuantizedCache

from kbit_linear import KbitKVCache
from kbit_linear.kv_cache import MASS_INTERVAL, cache_keyword
from kbit_linear.tools.evaluation import token_windows
from kbit_linear.tools.models import resolve_model


_ALLOCATION_LABEL = {None: "", True: ", by tile", False: ", by token"}


def settings(config, mass_intervals: tuple[int, ...] = (MASS_INTERVAL,), by_tile: tuple[bool | None, ...] = (None,)) -> list[tuple[str, callable]]:
    """(label, cache factory) pairs to compare against the dense cache; the kbit settings once per
    ``mass_interval`` (labelled with it when it is not the library's default) and per
    ``allocate_by_tile`` value in ``by_tile`` (None, the default, unlabelled; True "by tile";
    False "by token")."""
    out = []
    for m in mass_intervals:
        tag = "" if m == MASS_INTERVAL else f", mass_interval {m}"
        for t in by_tile:
            out += [(f"kbit avg {b} bits{tag}{_ALLOCATION_LABEL[t]}",
                     lambda b=b, m=m, t=t: KbitKVCache(config, kv_bits=b, mass_interval=m, allocate_by_tile=t)) for b in (8, 4, 3, 2.5)]
        out.append((f"kbit uniform 2 bits{tag}", lambda m=m: KbitKVCache(config, kv_bits=2, window=0, sink_tokens=0, mass_interval=m)))
    for backend, package in (("quanto", "optimum.quanto"), ("hqq", "hqq")):
        try:
            found = importlib.util.find_spec(package) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            out += [(f"QuantizedCache {backend} {b} bits", lambda b=b, be=backend: QuantizedCache(be, config, nbits=b)) for b in (4, 2)]
    return out


def quantized_cache_bits(cache: QuantizedCache) -> float:
    """Mean stored bits per K/V element of a QuantizedCache at the end of a window: its quantized
    tokens at ``nbits`` plus a 16-bit scale and zero point per group, the tokens of its residual
    window (up to ``residual_length``, kept unquantized) at 16."""
    layer = cache.layers[0]
    residual = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
    quantized = layer.cumulative_length - residual
    per_quantized = layer.nbits + 2 * 16 / layer.q_group_size
    return (quantized * per_quantized + residual * 16) / layer.cumulative_length


def decode_kl(model, ids: torch.Tensor, prefill: int, make_cache) -> tuple[float, object]:
    """Mean KL over teacher-forced decode steps of the cache from ``make_cache`` vs DynamicCache."""
    caches = [DynamicCache(config=model.config), make_cache()]
    kw = cache_keyword(model)
    kls = []
    with torch.inference_mode():
        logits = [model(ids[:, :prefill], **{kw: c}).logits[:, -1] for c in caches]
        for t in range(prefill, ids.shape[1]):  # logits predict token t
            p, q = (F.log_softmax(x.float(), -1) for x in logits)
            kls.append(float((p.exp() * (p - q)).sum(-1).mean()))
            if t + 1 < ids.shape[1]:  # the last step's logits are never scored
                logits = [model(ids[:, t:t + 1], **{kw: c}).logits[:, -1] for c in caches]
    return sum(kls) / len(kls), caches[1]


def main() -> None:
    """Parse arguments, run every setting, print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="'default' (SmolLM2), 'gemma-3-270m', a folder or a hub id")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--only", default=None, help="run only the settings whose label contains this text")
    ap.add_argument("--mass-interval", type=int, nargs="+", default=[MASS_INTERVAL],
                    help="KbitKVCache's mass_interval, each kbit setting once per value (default: the library's)")
    ap.add_argument("--by-tile", action="store_true",
                    help="the average-width settings with allocate_by_tile=False and True instead of the default (None)")
    args = ap.parse_args()
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    windows = token_windows(tok, args.prefill + args.steps, args.windows)
    print(f"{datetime.date.today()} {path.rstrip('/').split('/')[-1]}, {args.windows} window(s): prefill {args.prefill}, "
          f"{args.steps} teacher-forced decode steps; float32 weights, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| cache | KL vs dense cache (nats/token) | mean stored bits | bytes vs bf16 | s |")
    print("|---|---|---|---|---|")
    for label, make in settings(model.config, tuple(args.mass_interval), (False, True) if args.by_tile else (None,)):
        if args.only is not None and args.only not in label:
            continue
        start = time.perf_counter()
        kl, bits, ratio = 0.0, None, None
        try:
            make()
        except ValueError as e:  # e.g. transformers' QuantizedCache refuses sliding-window layers
            print(f"| {label} | not run: {str(e).splitlines()[0][:140]} | - | - | - |", flush=True)
            continue
        for w in windows:
            k, cache = decode_kl(model, w.unsqueeze(0), args.prefill, make)
            kl += k / len(windows)
        if isinstance(cache, KbitKVCache):
            layer = cache.layers[0]
            bf16 = 2 * layer.heads * layer.head_dim * 2 * cache.get_seq_length() * len(cache.layers)
            bits, ratio = f"{cache.average_bits():.2f}", f"{cache.nbytes / bf16:.3f}x"
        elif isinstance(cache, QuantizedCache):
            bits = f"{quantized_cache_bits(cache):.2f}"
        print(f"| {label} | {kl:.5f} | {bits or '-'} | {ratio or '-'} | {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
