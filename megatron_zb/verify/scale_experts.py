"""verify's scaled copy of an MoE line: expert parallelism to what the processes hold, fewer experts, their FFNs
and the dense/MoE layer pattern scaled like the rest of the model, every change with its reason."""

from __future__ import annotations

import argparse
import dataclasses

from ..megatron.args import virtual_chunks
from .scaler import Limits, Scaler

MOST_EXPERTS = 8  # experts per MoE layer in the scaled copy, at most (each runs its own GEMMs on CPU)


def expert_data_parallel(args: argparse.Namespace, limits: Limits) -> Limits:
    """Two data-parallel copies for a line with expert parallelism and no tensor parallelism to carve it from."""
    if not getattr(args, "num_experts", None) or getattr(args, "expert_model_parallel_size", 1) < 2:
        return limits
    if limits.data_parallel > 1 or args.tensor_model_parallel_size > 1:
        return limits
    if (virtual_chunks(args) or 1) > 1 and args.pipeline_model_parallel_size > 2:
        return limits  # interleaved: keeps pipeline size 4 (megatron-core's, without P2P overlap, needs > 2)
    return dataclasses.replace(limits, data_parallel=2)


def experts(scaler: Scaler, tp: int, dp: int, raised: bool, hidden: int, layers: int) -> None:
    """MoE layers: expert parallelism to what the processes hold, fewer experts, their FFNs scaled like the FFN."""
    args = scaler.args
    experts = getattr(args, "num_experts", None)
    if not experts:
        return
    ep_given = args.expert_model_parallel_size
    etp_given = args.expert_tensor_parallel_size  # None: the tensor-parallel size
    etp_was = tp if etp_given is None else etp_given
    etp = min(etp_was, tp)
    topk = args.moe_router_topk
    groups, group_topk = getattr(args, "moe_router_num_groups", None), getattr(args, "moe_router_group_topk", None)

    def most_ep(etp: int) -> int:  # expert parallelism and expert TP are carved from tp x dp (the scaled copy: cp 1)
        return max(ep for ep in range(1, ep_given + 1) if (tp * dp) % (ep * etp) == 0 and experts % ep == 0)

    ep = most_ep(etp)
    carved = f"the {tp} tensor-parallel x {dp} data-parallel processes of a stage" + (
        " (verify runs two data-parallel copies to carve expert parallelism from)" if raised else ""
    )
    if etp > 1 and most_ep(1) > ep:  # expert parallelism is the MoE line's point: it goes first
        etp, ep = 1, most_ep(1)
    if etp != etp_was:
        why = (
            f"the expert-tensor-parallel size fits the scaled tensor-parallel size ({tp})"
            if etp == min(etp_was, tp)
            else f"so that expert parallelism {ep} fits {carved}"
        )
        scaler.set("--expert-tensor-parallel-size", [str(etp)], why)
    count = _expert_count(experts, ep, topk, groups, group_topk)
    if ep != ep_given:
        scaler.set(
            "--expert-model-parallel-size",
            [str(ep)],
            f"expert x expert-tensor parallelism ({ep} x {etp}) fits {carved}, and divides your {experts} experts",
        )
    if count != experts:
        scaler.set(
            "--num-experts",
            [str(count)],
            f"the fewest from {min(experts, MOST_EXPERTS)} up (on CPU each expert runs its own GEMMs) that expert "
            f"parallelism {ep}"
            + (f", the {groups} router groups with group top-{group_topk}" if groups else "")
            + f" and top-{topk} routing take",
        )
    for dest, option, split, name in (
        ("moe_ffn_hidden_size", "--moe-ffn-hidden-size", etp, "expert FFN"),
        ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", tp, "shared expert's FFN"),
    ):
        size = getattr(args, dest, None)
        if size is None:
            continue
        ratio = size / args.hidden_size
        scaled = max(2 * split, round(ratio * hidden / (2 * split)) * 2 * split)
        scaler.set(option, [str(scaled)], f"keeps the {name}-to-hidden ratio of {ratio:.3g}")
    _layer_frequency(scaler, layers)


def _expert_count(experts: int, ep: int, topk: int, groups: int | None, group_topk: int | None) -> int:
    """The fewest experts from min(experts, MOST_EXPERTS) up that expert parallelism, the router's groups and its
    top-k take; the line's count when none does."""
    for count in range(min(experts, MOST_EXPERTS), experts + 1):
        if count % ep or count < topk:
            continue
        if groups and (count % groups or topk > (group_topk or groups) * (count // groups)):
            continue
        return count
    return experts


def resampled(pattern: list[int], layers: int) -> list[int]:
    """A pattern of dense (0) and MoE (1) layers at another layer count: dense layers first stay first, and
    both kinds stay when both were there."""
    if len(pattern) == layers:
        return list(pattern)
    scaled = [pattern[i * len(pattern) // layers] for i in range(layers)]
    if 1 not in scaled:
        scaled[-1] = 1
    if 0 in pattern and 0 not in scaled and layers > 1:
        scaled[0 if pattern[0] == 0 else -1] = 0
    return scaled


def moe_layers(args: argparse.Namespace, layers: int) -> list[bool]:
    """Which of the scaled copy's ``layers`` are MoE layers (none without --num-experts)."""
    if not getattr(args, "num_experts", None):
        return [False] * layers
    pattern = getattr(args, "moe_layer_freq", 1)
    if isinstance(pattern, list):
        return [value == 1 for value in resampled(pattern, layers)]
    return [layer % pattern == 0 for layer in range(layers)]


def _layer_frequency(scaler: Scaler, layers: int) -> None:
    """A pattern of dense and MoE layers, resampled to the scaled layer count."""
    pattern = scaler.value("moe_layer_freq")
    if not isinstance(pattern, list) or len(pattern) == layers:
        return  # a 1-in-N frequency means the same at any layer count
    scaled = resampled(pattern, layers)
    dense = sum(1 for value in pattern if value == 0)
    scaler.set(
        "--moe-layer-freq",
        [str(scaled).replace(" ", "")],
        f"your pattern ({dense} dense, {len(pattern) - dense} MoE layers) resampled to the {layers} scaled layers",
    )
