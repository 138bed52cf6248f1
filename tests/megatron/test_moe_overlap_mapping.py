"""Megatron-LM's --overlap-moe-expert-parallel-comm under a megatron-zb schedule: our overlapped F&B pairs.

``megatron_mapping.moe_overlap_as_pairs`` runs before Megatron-LM's validate_args (in every rank and in the
launcher's preflight): megatron-core's flag off, ours on; without a megatron-zb schedule the line is left as it is.
"""

from __future__ import annotations

import argparse

import pytest

from megatron_zb.megatron.args import enabled, schedule_settings
from megatron_zb.megatron.megatron_mapping import MOE_OVERLAP_NOTE, moe_overlap_as_pairs
from megatron_zb.megatron_lm.preflight import mapped_flags
from megatron_zb.verify.megatron_lm_route import replan_outcome


def mapped(args: argparse.Namespace) -> str | None:
    return moe_overlap_as_pairs(args, enabled(args))


def line(**given: object) -> argparse.Namespace:
    """A pp 2, EP 2 MoE line as Megatron-LM parses it, with ``given`` on top."""
    fields = dict(
        pipeline_model_parallel_size=2,
        tensor_model_parallel_size=1,
        context_parallel_size=1,
        data_parallel_size=2,
        num_layers=4,
        micro_batch_size=1,
        global_batch_size=8,
        num_experts=4,
        expert_model_parallel_size=2,
        moe_token_dispatcher_type="alltoall",
        overlap_moe_expert_parallel_comm=True,
        zero_bubble_overlap_f_b=False,
        zero_bubble_pipeline_timers_start_iter=2,
        zero_bubble_pipeline_timers_end_iter=3,
        enable_zero_bubble=False,
        pipeline_schedule=None,
    )
    return argparse.Namespace(**{**fields, **given})


def test_under_a_megatron_zb_schedule_the_flag_becomes_our_pairs() -> None:
    args = line(pipeline_schedule="1f1b")
    assert mapped_flags(args) == ("overlap_moe_expert_parallel_comm",)
    assert moe_overlap_as_pairs(args, enabled(args)) == MOE_OVERLAP_NOTE
    assert not args.overlap_moe_expert_parallel_comm and args.zero_bubble_overlap_f_b
    assert schedule_settings(args).overlap_f_b  # our checks take it as --zero-bubble-overlap-f-b
    assert (
        moe_overlap_as_pairs(args, enabled(args)) is None
    )  # mapped once: a second call (validate_args again) says nothing


def test_without_a_megatron_zb_schedule_the_flag_stays_megatron_cores() -> None:
    args = line()
    assert mapped_flags(args) == ()
    assert moe_overlap_as_pairs(args, enabled(args)) is None
    assert args.overlap_moe_expert_parallel_comm and not args.zero_bubble_overlap_f_b


def test_a_dispatcher_without_an_all_to_all_is_refused() -> None:
    with pytest.raises(ValueError, match="--moe-token-dispatcher-type allgather has none: give alltoall"):
        mapped(line(enable_zero_bubble=True, moe_token_dispatcher_type="allgather"))


def test_our_refusals_keep_their_messages() -> None:
    """megatron-core's own conditions (EP of 2 or more, no full recomputation) are --zero-bubble-overlap-f-b's."""
    args = line(enable_zero_bubble=True, expert_model_parallel_size=1)
    moe_overlap_as_pairs(args, enabled(args))
    with pytest.raises(ValueError, match="--expert-model-parallel-size of 2 or more"):
        schedule_settings(args)
    args = line(enable_zero_bubble=True, recompute_granularity="full")
    moe_overlap_as_pairs(args, enabled(args))
    with pytest.raises(ValueError, match="drop --recompute-granularity full"):
        schedule_settings(args)


@pytest.mark.parametrize("said, outcome", [
    ("re-planned 1f1b -> 1f1b with 3 overlapped F&B pairs from the passes timed in iterations 1-2: T_F [4.1] ms",
     "re-planned 1f1b -> 1f1b with 3 overlapped F&B pairs"),
    ("re-planned zb-1p -> zb-1p from the passes timed in iterations 1-2: T_F [43.1] ms",
     "re-planned zb-1p -> zb-1p, no overlapped F&B pair shortening its iteration"),
    ("kept zb-1p after the passes timed in iterations 2-3: T_F [34.6], all-to-all [15.1] ms in T_B: planning with "
     "them predicts 19.2% bubble, not below the current plan's 19.2%",
     "the re-plan kept zb-1p, without overlapped F&B pairs (planning with them predicts 19.2% bubble, not below the "
     "current plan's 19.2%)"),
])  # fmt: skip
def test_verify_says_what_the_re_plan_did(tmp_path, said: str, outcome: str) -> None:
    """verify's verdict line ends with it: a line with the flag says whether pairs ran."""
    log = tmp_path / "zero-bubble.log"
    log.write_text(f"  no_zero_bubble_replan ... False\nINFO:megatron_zb.replan:{said}\n")
    assert replan_outcome(log) == outcome
    log.write_text("  no_zero_bubble_replan ... False\n")
    assert replan_outcome(log) is None


@pytest.mark.parametrize(
    "sizes, processes, refused",
    [
        (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=None), 4, True),
        (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1), 4, False),
        (dict(tensor_model_parallel_size=1, expert_model_parallel_size=2, expert_tensor_parallel_size=None), 4, False),
        (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=None), 8, False),
    ],
)
def test_an_expert_layout_that_does_not_divide_the_processes_is_refused_before_spawn(sizes, processes, refused):
    from megatron_zb.megatron_lm.preflight import refuse_expert_layout

    args = argparse.Namespace(num_experts=8, pipeline_model_parallel_size=2, **sizes)
    if not refused:
        refuse_expert_layout(args, processes)
        return
    with pytest.raises(ValueError, match=r"= 8 does not divide the 4 processes.*--expert-tensor-parallel-size 1"):
        refuse_expert_layout(args, processes)
