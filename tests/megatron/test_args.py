"""The zero-bubble flags: what each combination selects, and the message of every refusal."""

from __future__ import annotations

import argparse

import pytest

from megatron_zb.megatron.args import add_args, schedule_settings
from megatron_zb.training.arguments import build_parser, derive_and_check, parse

BASE = (
    "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 16 --train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 --cpu "
    "--pipeline-model-parallel-size 4"
).split()


def settings(extra: str):
    args = build_parser().parse_args(BASE + extra.split())
    derive_and_check(args)
    return args


def refusal(extra: str) -> str:
    with pytest.raises(ValueError) as error:
        settings(extra)
    return str(error.value)


@pytest.mark.parametrize(
    "extra, schedule, limit, kind",
    [
        ("--enable-zero-bubble", "zb-1p", None, "linear"),
        ("--enable-zero-bubble --zero-bubble-max-pending-backward 4", "zb-1p", None, "linear"),
        ("--enable-zero-bubble --zero-bubble-max-pending-backward 8", "zb-2p", None, "linear"),
        ("--enable-zero-bubble --zero-bubble-max-pending-backward 6", "zb-auto", 6.0, "linear"),
        ("--zero-bubble-v-schedule", "zb-v", None, "v"),
        ("--zero-bubble-v-schedule --enable-zero-bubble", "zb-v", None, "v"),
        ("--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup half", "v-half", None, "v"),
        ("--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup min", "v-min", None, "v"),
        ("--pipeline-schedule zb-h1", "zb-h1", None, "linear"),
        ("--pipeline-schedule zb-v --zero-bubble-v-schedule", "zb-v", None, "v"),
        ("--pipeline-schedule v-auto --zero-bubble-memory-limit 3", "v-auto", 3.0, "v"),
        (
            "--pipeline-schedule interleaved-1f1b --virtual-pipeline-model-parallel-size 2",
            "interleaved-1f1b",
            None,
            "interleaved",
        ),
        (
            "--pipeline-schedule interleaved-1f1b --num-layers-per-virtual-pipeline-stage 1",
            "interleaved-1f1b",
            None,
            "interleaved",
        ),
        ("--enable-zero-bubble --virtual-pipeline-model-parallel-size 2", "zb-1p", None, "interleaved"),
        ("--pipeline-schedule zb-2p --num-layers-per-virtual-pipeline-stage 1", "zb-2p", None, "interleaved"),
        (
            "--pipeline-schedule zb-auto --zero-bubble-memory-limit 5 --virtual-pipeline-model-parallel-size 2",
            "zb-auto",
            5.0,
            "interleaved",
        ),
    ],
)
def test_flags_select_the_schedule(extra: str, schedule: str, limit, kind: str) -> None:
    args = settings(extra)
    assert args.zero_bubble.schedule == schedule
    assert args.zero_bubble.memory_limit == limit
    assert args.zero_bubble.microbatches == 8
    assert args.placement.kind == kind


@pytest.mark.parametrize("layers, chunks", [(16, 4), (8, 2), (4, 1)])
def test_auto_builds_only_chunk_counts_that_split_the_layers(layers: int, chunks: int) -> None:
    """auto weighs 1, 2 and 4 chunks; the model is built with its pick, so the layers must split into them."""
    args = build_parser().parse_args(BASE + ["--pipeline-schedule", "auto", "--zero-bubble-memory-limit", "4"])
    args.num_layers = layers
    derive_and_check(args)
    assert args.zero_bubble.layers == layers
    assert args.placement.chunks == chunks, args.zero_bubble
    assert layers % args.placement.num_stages == 0


def test_interleaved_takes_any_number_of_microbatches() -> None:
    args = settings(
        "--pipeline-schedule interleaved-1f1b --virtual-pipeline-model-parallel-size 2 --global-batch-size 10"
    )
    assert (args.zero_bubble.microbatches, args.zero_bubble.chunks, args.placement.kind) == (5, 2, "interleaved")


def test_disabled_selects_nothing_and_keeps_megatron_placement() -> None:
    args = settings("")
    assert args.zero_bubble is None
    assert args.placement.kind == "linear"
    assert settings("--virtual-pipeline-model-parallel-size 2").placement.kind == "interleaved"


def test_microbatches_come_from_batch_sizes_and_data_parallel() -> None:
    args = settings("--pipeline-schedule zb-h1 --cpu-procs 8 --global-batch-size 32")
    assert (args.data_parallel_size, args.zero_bubble.microbatches) == (2, 8)


def test_replanning_window_is_on_by_default_and_can_be_turned_off() -> None:
    """As in the reference implementation: iterations 100-110 are timed, then the schedule is re-planned."""
    assert settings("--enable-zero-bubble").zero_bubble.timers == (100, 110)
    chosen = settings(
        "--enable-zero-bubble --zero-bubble-pipeline-timers-start-iter 3 --zero-bubble-pipeline-timers-end-iter 3 "
        "--zero-bubble-save-costs c.json"
    ).zero_bubble
    assert (chosen.timers, chosen.costs_file) == ((3, 3), "c.json")
    assert settings("--enable-zero-bubble --no-zero-bubble-replan").zero_bubble.timers is None


def test_post_validation_flags() -> None:
    chosen = settings("--zero-bubble-v-schedule --enable-optimizer-post-validation").zero_bubble
    assert (chosen.post_validation, chosen.post_validation_rollback) == (True, "exact")
    chosen = settings(
        "--enable-zero-bubble --enable-optimizer-post-validation --optimizer-post-validation-rollback in-place"
    ).zero_bubble
    assert (chosen.post_validation, chosen.post_validation_rollback) == (True, "in-place")
    assert settings("--enable-zero-bubble").zero_bubble.post_validation is False


def test_padding_gives_the_embedding_and_loss_blocks_one_layer_fewer() -> None:
    args = settings("--zero-bubble-v-schedule --num-layers 14 --allow-padding-num-layers")
    assert args.zero_bubble.pad_layers and args.placement.kind == "v"


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            "--pipeline-schedule zb-v --num-layers 12",
            ["zb-v: --num-layers 12", "8 layer blocks", "a multiple of 2 layers per pipeline stage", "8 or 16"],
        ),
        (
            "--enable-zero-bubble --num-layers 6",
            ["--num-layers 6", "4 layer blocks", "4 or 8", "--allow-padding-num-layers", "fits this count"],
        ),
        (
            "--zero-bubble-v-schedule --num-layers 6 --allow-padding-num-layers",
            ["--allow-padding-num-layers is on", "at least one layer each", "--num-layers 14"],
        ),
        (
            "--pipeline-schedule zb-v --virtual-pipeline-model-parallel-size 4",
            ["two chunks", "--virtual-pipeline-model-parallel-size 4"],
        ),
        ("--pipeline-schedule zb-h2 --zero-bubble-memory-limit 3", ["--zero-bubble-memory-limit", "zb-h2"]),
        ("--pipeline-schedule zb-auto --zero-bubble-memory-limit 0.5", ["--zero-bubble-memory-limit", "0.5"]),
        ("--enable-zero-bubble --pipeline-schedule zb-v", ["conflicts", "zb-1p"]),
        ("--zero-bubble-max-pending-backward 8", ["needs --enable-zero-bubble"]),
        ("--zero-bubble-v-schedule-mem-setup half", ["needs --zero-bubble-v-schedule"]),
        ("--enable-zero-bubble --context-parallel-size 2", ["--context-parallel-size"]),
        ("--enable-optimizer-post-validation", ["--enable-optimizer-post-validation needs a megatron-zb schedule"]),
        ("--enable-zero-bubble --global-batch-size 15", ["--global-batch-size 15", "multiple"]),
        (
            "--enable-zero-bubble --zero-bubble-pipeline-timers-start-iter 5 --zero-bubble-pipeline-timers-end-iter 3",
            ["--zero-bubble-pipeline-timers-end-iter (3)"],
        ),
        (
            "--enable-zero-bubble --zero-bubble-pipeline-timers-start-iter 0",
            ["--zero-bubble-pipeline-timers-start-iter must be at least 1", "--no-zero-bubble-replan"],
        ),
        ("--zero-bubble-save-costs c.json", ["--zero-bubble-save-costs needs a zero-bubble schedule"]),
        (
            "--enable-zero-bubble --no-zero-bubble-replan --zero-bubble-save-costs c.json",
            ["--zero-bubble-save-costs saves the costs measured for re-planning", "--no-zero-bubble-replan"],
        ),
        ("--enable-zero-bubble --tensor-model-parallel-size 2 --cpu-procs 6", ["6 processes", "multiple of 8"]),
        ("--enable-zero-bubble --tensor-model-parallel-size 3 --cpu-procs 12", ["--num-attention-heads 4"]),
        ("--enable-zero-bubble --fp16 --bf16", ["--fp16 and --bf16"]),
        ("--enable-zero-bubble --data-path /data/x", ["--data-path", "--mock-data"]),
        ("--trace-iteration 3", ["--trace-file"]),
        ("--trace-file t.json", ["--trace-file", "--pipeline-schedule 1f1b"]),
        ("--num-experts 4 --moe-router-topk 6", ["--moe-router-topk 6", "--num-experts 4"]),
        ("--context-parallel-size 2 --cpu-procs 8", ["--context-parallel-size"]),
        ("--zero-bubble-memory-limit 3", ["needs --pipeline-schedule auto, bitpipe-zb, v-auto or zb-auto"]),
        ("--save-interval 5", ["--save"]),
    ],
)
def test_refusals_name_the_flags_and_what_works(extra: str, words: list[str]) -> None:
    message = refusal(extra)
    for word in words:
        assert word in message, message


def test_pending_backward_auto_is_refused_by_the_parser(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(BASE + ["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "auto"])
    assert "'auto'" in capsys.readouterr().err


def test_refusal_exits_with_one_short_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(BASE + ["--pipeline-schedule", "zb-v", "--num-layers", "12"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-zb train: error: zb-v: --num-layers 12") and "usage" not in err


def test_add_args_works_as_an_extra_args_provider_on_its_own() -> None:
    """Megatron-LM's parse_args hands its parser to extra_args_provider; the names must be the reference's."""
    parser = add_args(argparse.ArgumentParser())
    args = parser.parse_args(["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "8"])
    args.pipeline_model_parallel_size, args.num_layers = 4, 8
    args.micro_batch_size, args.global_batch_size, args.data_parallel_size = 1, 8, 1
    assert schedule_settings(args).schedule == "zb-2p"


def test_the_reference_implementations_flags_are_taken_with_a_note() -> None:
    """Its V scripts give --zero-bubble-max-pending-backward and --enable-zb-runtime: they run, and say so."""
    from megatron_zb.megatron.args import zero_bubble_notes

    args = settings("--zero-bubble-v-schedule --zero-bubble-max-pending-backward 8 --enable-zb-runtime")
    assert args.zero_bubble.schedule == "zb-v"
    notes = zero_bubble_notes(args)
    assert notes[0].startswith("--enable-zb-runtime has no effect")
    assert notes[1].startswith("--zero-bubble-max-pending-backward has no effect on V schedules")
    assert zero_bubble_notes(settings("--enable-zero-bubble --zero-bubble-max-pending-backward 8")) == []


def test_overlapped_pairs_are_asked_for_and_refused_with_recomputed_moe_layers() -> None:
    args = settings(
        "--num-experts 8 --expert-model-parallel-size 2 --cpu-procs 8 --enable-zero-bubble --zero-bubble-overlap-f-b"
    )
    assert args.zero_bubble.overlap_f_b and not settings("--enable-zero-bubble").zero_bubble.overlap_f_b
    for field, value in (("recompute_granularity", "full"), ("recompute_modules", ["core_attn", "moe"])):
        recomputed = argparse.Namespace(**{**vars(args), field: value})
        with pytest.raises(ValueError, match="recomputation of whole layers or MoE layers"):
            schedule_settings(recomputed)
    selective = argparse.Namespace(**{**vars(args), "recompute_granularity": "selective"})
    assert schedule_settings(selective).overlap_f_b
