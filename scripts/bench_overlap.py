"""Benchmark (not a test): one microbatch's forward beside another's backward (runtime/overlap.py) against the
same two passes one after the other, on an MoE model with expert parallelism 2 (two gloo ranks, one thread each).

    python scripts/bench_overlap.py [--repeat 12] [--output docs/bench_overlap.md]

Per size: a GPT of 2 layers whose MLPs are 8 experts (top-2, alltoall dispatcher, SwiGLU-free FFN of the hidden
size), micro-batch 2; each repetition times F1 then B0, and F1 beside B0 (``run_pair``), from a barrier, on
the same weights and data; the table gives the medians (the first two repetitions are warm-up) of both
ranks. Only the all-to-all can overlap: the two sides take turns computing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

SIZES = ((256, 256), (512, 512))  # (hidden, sequence length)


def case(hidden: int, seq: int, repeat: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_zb.process_groups import destroy_model_parallel
    from megatron_zb.runtime import linear_split, overlap
    from megatron_zb.runtime.wgrad import WeightGradStore
    from megatron_zb.testing.moe import moe_config

    torch.set_num_threads(1)
    destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    linear_split.install()
    config = moe_config(
        num_layers=2,
        hidden_size=hidden,
        num_attention_heads=8,
        num_moe_experts=8,
        moe_ffn_hidden_size=hidden,
        moe_aux_loss_coeff=1e-2,
    )
    torch.manual_seed(0)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=seq)
    generator = torch.Generator().manual_seed(dist.get_rank())

    def batch() -> dict:
        tokens = torch.randint(0, 128, (2, seq), generator=generator)
        return {"input_ids": tokens, "position_ids": torch.arange(seq).repeat(2, 1), "attention_mask": None}

    def forward(data: dict) -> torch.Tensor:
        return model(**data).float().mean()

    groups = [
        None,
        parallel_state.get_expert_model_parallel_group(),
        parallel_state.get_expert_tensor_and_model_parallel_group(),
        parallel_state.get_tensor_and_context_parallel_group(),
        parallel_state.get_tensor_model_parallel_group(),
    ]
    twins, pair, store = overlap.Twins.create(groups), overlap.PairCollectives(), WeightGradStore()
    pair.start()
    plain, paired = [], []
    try:
        for _ in range(repeat):
            for times, together in ((plain, False), (paired, True)):
                first_data, second_data = batch(), batch()
                with store.recording():
                    first = forward(first_data)

                def backward(first=first) -> None:
                    with store.deferring((0, 0)):
                        first.backward()

                dist.barrier()
                started = time.perf_counter()
                with store.recording():
                    if together:
                        second, _ = overlap.run_pair(lambda data=second_data: forward(data), backward, twins, pair)
                    else:
                        second = forward(second_data)
                        backward()
                times.append(time.perf_counter() - started)
                store.run((0, 0))
                with store.deferring((0, 1)):
                    second.backward()
                store.run((0, 1))
                model.zero_grad(set_to_none=True)
    finally:
        pair.stop()
        linear_split.uninstall()
    return {"plain_ms": 1e3 * statistics.median(plain[2:]), "paired_ms": 1e3 * statistics.median(paired[2:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=12)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    from megatron_zb.testing.pool import WorkerPool

    rows, load = [], os.getloadavg()[0]
    pool = WorkerPool(2)
    try:
        for hidden, seq in SIZES:
            ranks = pool.run(case, hidden=hidden, seq=seq, repeat=args.repeat)
            for rank, found in enumerate(ranks):
                plain, paired = found["plain_ms"], found["paired_ms"]
                rows.append(f"| {hidden} | {seq} | {rank} | {plain:.1f} | {paired:.1f} | {paired / plain:.3f} |")
                print(rows[-1], flush=True)
    finally:
        pool.close()
    text = "\n".join(
        [
            "# F beside B (overlapped passes) against F then B",
            "",
            f"Made by `python scripts/bench_overlap.py --repeat {args.repeat}` (see its docstring), "
            f"{platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} at the start, "
            f"Python {platform.python_version()}. Medians of both ranks' times; ratio above 1: the pair is slower.",
            "",
            "Only the all-to-all can overlap (the sides take turns computing), and on one CPU box gloo's loopback",
            "all-to-all is a small share of a pass and runs on the same cores as the other side's compute: the",
            "thread hand-offs cost more than it hides. Where the all-to-all crosses a network (GPUs, NCCL) the",
            "balance differs; this table says nothing of it.",
            "",
            "| hidden | seq | rank | F then B (ms) | F beside B (ms) | ratio |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    if args.output:
        args.output.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
