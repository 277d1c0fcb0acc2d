"""Generate with a mixed-precision KV cache (KbitKVCache) on CPU and show what it holds.

    python examples/kv_cache.py            # the embedded SmolLM2-135M-Instruct
    python examples/kv_cache.py --kv-bits 3
    python examples/kv_cache.py --graph     # also decode with KbitDecodeGraph (CUDA graphs on a GPU)
    python examples/kv_cache.py --graph --compile-layers   # ... with the decoder layers compiled
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kbit_linear
from kbit_linear.kv_cache import cache_keyword
from kbit_linear.tools.models import resolve_model


def main() -> None:
    """Generate the same prompt with a dense cache and with KbitKVCache; print both and the cache's bytes."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="'default' (SmolLM2), a folder or a hub id")
    ap.add_argument("--kv-bits", type=float, default=4.0)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--graph", action="store_true",
                    help="also decode greedily with KbitDecodeGraph: a replayable cache, one CUDA graph per allocator epoch "
                         "(on a CPU the same schedule runs without graphs)")
    ap.add_argument("--compile-layers", action="store_true",
                    help="with --graph: compile the decoder layers while KbitDecodeGraph decodes (torch.compile)")
    args = ap.parse_args()
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Explain what a key-value cache is in a transformer."}],
                                     tokenize=False, add_generation_prompt=True)
    inputs = tok(prompt, return_tensors="pt")
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False)
    cache_kw = cache_keyword(model)  # "cache" from transformers 5.24, "past_key_values" before
    dense = model.generate(**inputs, **{cache_kw: DynamicCache(config=model.config)}, **kw)
    # window/block smaller than the defaults so that a short chat already moves tokens below 8 bits
    cache = kbit_linear.KbitKVCache(model.config, kv_bits=args.kv_bits, window=16, block_size=16)
    out = model.generate(**inputs, **{cache_kw: cache}, **kw)
    n = inputs["input_ids"].shape[1]
    print("dense cache:", tok.decode(dense[0, n:], skip_special_tokens=True), "\n")
    print(f"KbitKVCache(kv_bits={args.kv_bits}):", tok.decode(out[0, n:], skip_special_tokens=True), "\n")
    if args.graph:
        graph_cache = kbit_linear.KbitKVCache(model.config, kv_bits=args.kv_bits, window=16, block_size=16, replayable=True)
        with torch.no_grad():
            logits = model(**inputs, **{cache_kw: graph_cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
        first = logits.argmax(-1, keepdim=True)
        decoder = kbit_linear.KbitDecodeGraph(model, graph_cache, use_graph=model.device.type == "cuda",
                                              compile_layers=args.compile_layers)
        # stops at end-of-text as model.generate does
        eos = model.generation_config.eos_token_id
        tokens = torch.cat([first, decoder.generate(first, args.new_tokens - 1, eos_token_id=eos)], 1)
        print(f"KbitDecodeGraph ({decoder.captures} graphs captured, {decoder.replays} of {tokens.shape[1]} tokens from "
              f"{'replays' if decoder.use_graph else 'frozen eager steps'}):", tok.decode(tokens[0], skip_special_tokens=True), "\n")
    layer = cache.layers[0]
    bf16 = 2 * layer.heads * layer.head_dim * 2 * cache.get_seq_length() * len(cache.layers)
    print(f"{cache.get_seq_length()} tokens; tokens per width (all layers): {cache.tier_counts()}; "
          f"mean width {cache.average_bits():.2f} bits; {cache.nbytes} bytes = {cache.nbytes / bf16:.3f}x a bf16 cache "
          f"({cache.nbytes_by_kind()})")


if __name__ == "__main__":
    main()
