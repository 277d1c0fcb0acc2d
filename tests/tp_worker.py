"""One rank of the tensor-parallel tests (``tests/test_parallel.py``), launched by ``torchrun``.

Every rank builds the same tiny random Llama models, quantizes them with
``kbit_linear.quantize_model``, runs them whole (the single-process result), shards them with
``kbit_linear.shard_for_tensor_parallel`` and runs them again; rank ``r`` writes what it saw to
``<out>/rank<r>.json`` for the test to check. Two models: one with storage-tile-aligned splits
(out_features per rank a multiple of 128, untied head), one where every split cuts storage tiles
(re-tiled shards), with biases on every projection and the head tied to the embedding.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import kbit_linear

MODELS = {
    "aligned": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    vocab_size=256, tie_word_embeddings=False),
    "retiled_bias_tied": dict(hidden_size=192, intermediate_size=320, num_attention_heads=6, num_key_value_heads=2,
                              head_dim=32, vocab_size=200, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
}


def _kbit_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def run(name: str, device: torch.device, dtype: torch.dtype, bits: int, new_tokens: int) -> dict:
    """Whole vs sharded results of model ``name`` on this rank."""
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, **MODELS[name])
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # a random head gives near-ties; a larger scale keeps greedy choices clear
        model.lm_head.weight.mul_(4.0)
    kbit_linear.quantize_model(model, bits=bits, progress=False)
    model.to(device).eval()
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)
    gen = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        whole_logits = model(ids).logits.float()
        whole_tokens = model.generate(ids, **gen)
    whole_bytes = _kbit_bytes(model)
    styles = kbit_linear.shard_for_tensor_parallel(model)
    with torch.no_grad():
        tp_logits = model(ids).logits.float()
        tp_tokens = model.generate(ids, **gen)
    top2 = whole_logits.topk(2, dim=-1).values
    return {
        "styles": sorted(set(styles.values())),
        "sharded_layers": len(styles),
        "logits_max_abs_diff": float((tp_logits - whole_logits).abs().max()),
        "logits_max_abs": float(whole_logits.abs().max()),
        "min_top2_margin": float((top2[..., 0] - top2[..., 1]).min()),
        "whole_tokens": whole_tokens.tolist(),
        "tp_tokens": tp_tokens.tolist(),
        "whole_bytes": whole_bytes,
        "tp_bytes": _kbit_bytes(model),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "q_proj": repr(model.model.layers[0].self_attn.q_proj),
    }


def main() -> None:
    """Parse the arguments, run every model, write ``rank<r>.json``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # two ranks share the CPU
    dist.init_process_group(args.backend, device_id=device if device.type == "cuda" else None)
    try:
        results = {name: run(name, device, getattr(torch, args.dtype), args.bits, args.new_tokens) for name in MODELS}
        results["world_size"] = dist.get_world_size()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
