"""Where a chunked prefill into ``KbitKVCache`` spends its time: wall seconds and a ``cProfile`` table.

A Llama-3-8B-shaped model with random weights (``bench_generate.py``'s builder), its linear layers
at kbit K = 4, is fed ``--context`` random tokens in forward calls of ``--chunk`` tokens into a
``KbitKVCache(kv_bits=--kv-bits)``, once to warm up (kernels compiled) and once timed under
``cProfile``; the table lists the functions by their own time (``--sort tottime``) or their
cumulative time. The cache's allocator (``KbitKVLayer.reallocate``) and attention
(``KbitKVLayer.attend``) show up by name.

With ``--decode N`` the same cache then takes N single-token decode steps, profiled apart (the
first, which re-codes the prompt tokens stored since the allocator last ran, timed but not
profiled).

Usage::

    python3 scripts/profile_kv_prefill.py --context 32768 --chunk 2048 --decode 129
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as bc  # noqa: E402
import bench_generate as bg  # noqa: E402

from kbit_linear.kv_cache import cache_keyword  # noqa: E402  (the repository is on the path after _bench_common)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, prefill twice, print the timed run's seconds and profile."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=2048, help="tokens per forward call")
    ap.add_argument("--kv-bits", type=float, default=4.0)
    ap.add_argument("--prefill-interval", type=int, default=None,
                    help="KbitKVCache's prefill_interval (default: the library's; 1 allocates before every chunk)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--decode", type=int, default=0,
                    help="after the timed prefill, also profile this many single-token decode steps")
    ap.add_argument("--rows", type=int, default=25, help="profile rows printed")
    ap.add_argument("--sort", choices=["tottime", "cumulative"], default="tottime")
    args = ap.parse_args(argv)
    if args.context < 1 or args.chunk < 1 or args.decode < 0 or args.decode == 1:
        ap.error("--context and --chunk must be >= 1, --decode 0 or >= 2 (the first step is not profiled)")
    dev = bc.require_cuda()
    bc.kbit_cuda_status()
    import kbit_linear

    config = bg.llama3_8b_config(args.layers)
    config.max_position_embeddings = max(config.max_position_embeddings, args.context + 64)
    model = bg.build_variant("kbit4", config, dev, {})
    ids = torch.randint(0, config.vocab_size, (1, args.context), device=dev, generator=torch.Generator(device=dev).manual_seed(0))

    kw = cache_keyword(model)  # once, outside the timed prefill

    def prefill() -> Any:
        extra = {} if args.prefill_interval is None else {"prefill_interval": args.prefill_interval}
        cache = kbit_linear.KbitKVCache(model.config, kv_bits=args.kv_bits, **extra)
        with torch.no_grad():
            for i in range(0, args.context, args.chunk):
                model(input_ids=ids[:, i:i + args.chunk], **{kw: cache}, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        return cache

    prefill()  # warm-up: kernels compiled, allocator caches filled
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    cache = prefill()
    prof.disable()
    print(f"# {bc.environment(dev)['gpu']}: prefill of {args.context} tokens in chunks of {args.chunk}: "
          f"{time.perf_counter() - t0:.2f} s (under cProfile)", flush=True)
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.rows)
    if args.decode:
        decode(model, cache, ids[:, -1:], args)


def decode(model: Any, cache: Any, token: torch.Tensor, args: argparse.Namespace) -> None:
    """Profile ``args.decode`` greedy single-token steps on the prefilled ``cache``; print ms per step."""
    steps: list[float] = []
    prof = cProfile.Profile()
    kw = cache_keyword(model)
    with torch.no_grad():
        for i in range(args.decode):
            t0 = time.perf_counter()
            if i:  # the first step re-codes the prompt tokens stored since the last allocation: timed apart
                prof.enable()
            logits = model(input_ids=token, **{kw: cache}, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            prof.disable()
            steps.append((time.perf_counter() - t0) * 1e3)
    rest = sorted(steps[1:])  # --decode is 0 or at least 2
    print(f"# decode: first step {steps[0]:.1f} ms; steps 2..{len(steps)}: mean {sum(rest) / len(rest):.1f} ms, "
          f"median {rest[len(rest) // 2]:.1f} ms, max {rest[-1]:.1f} ms (under cProfile)", flush=True)
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.rows)


if __name__ == "__main__":
    main()
