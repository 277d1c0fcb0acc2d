"""Tensor parallelism: a kbit model split over the ranks of a ``torchrun`` job.

    torchrun --nproc_per_node 2 examples/tensor_parallel.py                 # tiny random Llama
    torchrun --nproc_per_node 2 examples/tensor_parallel.py --model PATH    # a model folder or hub id

Each rank loads and quantizes the whole model on its own device (GPU ``LOCAL_RANK`` with nccl, or
the CPU with gloo), generates once whole, keeps its shard with
``kbit_linear.shard_for_tensor_parallel`` (the model's own tensor-parallel plan), generates again,
and prints whether the tokens match and how many bytes of weights it now holds.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import kbit_linear


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def main() -> None:
    """Load, quantize, generate whole, shard, generate sharded, report per rank."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder or hub id (default: a tiny random Llama)")
    parser.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5))
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    rank = dist.get_rank()
    dtype = torch.bfloat16 if use_cuda else torch.float32

    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=kbit_linear.KbitConfig(bits=args.bits),
                                                     dtype=dtype, device_map={"": device})
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(device)
    else:
        tokenizer = None
        torch.manual_seed(0)  # every rank builds the same weights
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=32)
        model = LlamaForCausalLM(config).to(dtype)
        kbit_linear.quantize_model(model, bits=args.bits, progress=rank == 0)
        model.to(device)
        ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    model.eval()
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)

    with torch.no_grad():
        whole = model.generate(ids, **gen)
    whole_bytes = _weight_bytes(model)
    styles = kbit_linear.shard_for_tensor_parallel(model)
    if use_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        sharded = model.generate(ids, **gen)

    lines = [f"rank {rank}/{world} on {device}: {len(styles)} modules sharded",
             f"  weights and buffers: {whole_bytes:,} bytes whole -> {_weight_bytes(model):,} bytes on this rank"]
    if use_cuda:
        lines.append(f"  GPU memory: {torch.cuda.memory_allocated(device):,} bytes allocated, "
                     f"{torch.cuda.max_memory_allocated(device):,} peak while generating")
    lines.append(f"  tokens identical to the whole model: {torch.equal(whole, sharded)}")
    if rank == 0:
        text = tokenizer.decode(sharded[0, ids.shape[1]:]) if tokenizer else sharded[0, ids.shape[1]:].tolist()
        lines.append(f"  generated: {text}")
    # print rank by rank, in order
    for r in range(world):
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
