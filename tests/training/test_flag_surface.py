"""The launcher reads a pretrain_gpt line on Megatron-LM's flag surface: each flag taken, or refused by name.

Where Megatron-LM's parser is importable (megatron-core 0.19.2 in CI), every launcher flag must mean what
Megatron-LM's flag of that name means: same destination, default, type and choices (a subset of them), except
the differences its row states (``differs``, gathered in ``flag_surface.DIFFERENCES``). A Megatron-LM flag the
launcher does not implement is refused with all of them named; without Megatron-LM, unknown flags are refused with
all of them named and a pointer.
"""

from __future__ import annotations

import pytest

from megatron_zb.flags.megatron_lm_parser import megatron_lm_parser
from megatron_zb.megatron.args import add_args
from megatron_zb.training import flag_surface
from megatron_zb.training.arguments import build_parser

MEGATRON_LM = megatron_lm_parser(add_args)
needs_megatron_lm = pytest.mark.skipif(MEGATRON_LM is None, reason="needs Megatron-LM's megatron.training")
BASE = (
    "--cpu --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 --mock-data "
    "--micro-batch-size 1 --train-iters 2 --lr 1e-3 --pipeline-model-parallel-size 2"
).split()


def _name(value):
    return getattr(value, "name", value)


@needs_megatron_lm
def test_every_launcher_flag_means_what_megatron_lms_flag_means() -> None:
    ours = build_parser()
    compared = 0
    for option in flag_surface.honoured(ours):
        theirs = MEGATRON_LM._option_string_actions.get(option)
        assert theirs is not None, f"{option}: not Megatron-LM's; its row: honoured=LAUNCHER"
        mine = ours._option_string_actions[option]
        assert mine.dest == theirs.dest, option
        assert mine.nargs == theirs.nargs, option
        if option in flag_surface.DIFFERENCES:
            continue
        assert mine.default == _name(theirs.default), f"{option}: default {mine.default!r} vs {theirs.default!r}"
        assert mine.type in (theirs.type, None) or theirs.type is None, option
        if mine.choices is not None:
            assert {str(c) for c in mine.choices} <= {str(_name(c)) for c in theirs.choices}, option
        compared += 1
    assert compared > 80  # the launcher's share of pretrain_gpt's flags


@needs_megatron_lm
def test_megatron_lm_flags_the_launcher_lacks_are_all_named() -> None:
    argv = [*BASE, "--tensorboard-dir", "tb", "--rampup-batch-size", "1", "1", "10", "--use-mcore-models"]
    with pytest.raises(ValueError) as refused:
        flag_surface.check(argv, build_parser())
    message = str(refused.value)
    assert "does not implement --tensorboard-dir tb, --rampup-batch-size 1 1 10;" in message
    assert "--megatron-lm" in message and "--use-mcore-models" not in message


@needs_megatron_lm
def test_unknown_flags_are_told_apart_from_megatron_lm_flags() -> None:
    with pytest.raises(ValueError, match=r"2 flags that Megatron-LM .*'s pretrain_gpt does not know: --foo 1, --bar"):
        flag_surface.check([*BASE, "--foo", "1", "--bar", "--tensorboard-dir", "tb"], build_parser())


def test_a_flag_without_effect_is_taken_with_a_note() -> None:
    notes = flag_surface.check([*BASE, "--use-mcore-models"], build_parser())
    assert notes == ["--use-mcore-models: no effect here: the launcher always builds megatron-core's GPTModel"]
    kept = flag_surface.without_no_effect_flags([*BASE, "--use-mcore-models"], build_parser())
    assert "--use-mcore-models" not in kept and kept == BASE


@pytest.mark.skipif(MEGATRON_LM is not None, reason="without Megatron-LM only")
def test_without_megatron_lm_every_unknown_flag_is_named_with_the_way_out() -> None:
    with pytest.raises(ValueError) as refused:
        flag_surface.check([*BASE, "--tensorboard-dir", "tb", "--swiglu", "--foo"], build_parser())
    message = str(refused.value)
    assert "2 flags that megatron-zb's launcher does not know: --tensorboard-dir tb, --foo" in message
    assert "megatron-core >= 0.17" in message and "--megatron-lm PATH" in message
