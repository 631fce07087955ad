"""Workers that bench/multinode.py launches with torchrun next to pretrain_bert.py:

    allreduce N   times dist.all_reduce of N fp32 elements (what one step's DP reduction sends)
    ddp MODEL     BertForPreTraining of the bench's shape under PyTorch DDP, its buckets of the
                  size megabert's run gets (bucket_cap_mb); MODEL `transformers` (its model
                  computes MLM logits at every position) or `megabert` (megabert's model, the
                  compute of megabert's own run: only the reduction differs)

Each prints one JSON line (rank 0): {"median_s": ..., "times": [...]}.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _report(times: list[float]) -> None:
    if dist.get_rank() == 0:
        print(json.dumps({"median_s": statistics.median(times), "times": times}), flush=True)


def allreduce(n: int, rounds: int = 7) -> None:
    t = torch.ones(n)
    dist.all_reduce(t)  # connect and warm up
    times = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    _report(times)


def _model(kind: str, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "megabert":
        import megabert
        from megabert.parallel import ParallelState

        config = megabert.ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                      vocab_size=vocab, max_position_embeddings=max(512, seq))
        ps = ParallelState.build(1, 1, device=torch.device("cpu"), backend="gloo",  # DP over all ranks: DDP's
                                 timeout=datetime.timedelta(minutes=10))
        return megabert.BertForPreTraining(config, ps).train()
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=4 * hidden,
                                     max_position_embeddings=max(512, seq))
    return transformers.BertForPreTraining(config).train()


def ddp(kind: str, layers: int, hidden: int, heads: int, vocab: int, seq: int, micro: int, steps: int,
        bucket_elements: int) -> None:
    model = torch.nn.parallel.DistributedDataParallel(_model(kind, layers, hidden, heads, vocab, seq),
                                                      bucket_cap_mb=bucket_elements * 4 / 2**20)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    # BERT's masking: 15% of the positions carry a label (megabert's model computes MLM
    # logits there only, transformers' at every position).
    labels = torch.randint(5, vocab, (micro, seq), generator=g)
    labels[torch.rand(micro, seq, generator=g) >= 0.15] = -100
    batch = {"input_ids": torch.randint(5, vocab, (micro, seq), generator=g),
             "token_type_ids": torch.zeros(micro, seq, dtype=torch.long),
             "attention_mask": torch.ones(micro, seq, dtype=torch.long),
             "labels": labels, "next_sentence_label": torch.zeros(micro, dtype=torch.long)}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    _report(times[2:])  # the first steps build DDP's buckets and warm the allocator


def main() -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    try:
        if sys.argv[1] == "allreduce":
            allreduce(int(sys.argv[2]))
        else:
            ddp(sys.argv[2], *map(int, sys.argv[3:11]))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
