"""Every message fragment that docs/user-guide.md quotes under Troubleshooting is what the code prints.

CASES pairs each quoted fragment with a way to trigger it: launcher flags (``megatron-zb
train``: argparse, then derive_and_check), a Megatron-LM namespace for schedule_settings, the
planner CLI, or a direct call. The doc may quote only fragments listed here, and every
fragment here must be quoted in the doc.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_zb import cli
from megatron_zb.megatron.args import schedule_settings
from megatron_zb.training.arguments import build_parser, derive_and_check

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "user-guide.md"

# A launcher command line that runs (pp=4, 16 layers, 8 microbatches); each case adds flags.
TRAIN = (
    "--cpu --pipeline-model-parallel-size 4 --num-layers 16 --hidden-size 64 --num-attention-heads 4 "
    "--seq-length 32 --vocab-size 256 --mock-data --micro-batch-size 1 --global-batch-size 8 --train-iters 10 "
    "--lr 1e-3"
)
# What Megatron-LM's parsed arguments hold, for the checks the launcher cannot reach.
MEGATRON = dict(
    pipeline_model_parallel_size=4,
    num_layers=16,
    micro_batch_size=1,
    global_batch_size=8,
    data_parallel_size=1,
    zero_bubble_pipeline_timers_start_iter=100,
    zero_bubble_pipeline_timers_end_iter=110,
    zero_bubble_v_schedule_mem_setup="zb",
    enable_zero_bubble=True,
)


def train(extra: str) -> str:
    """The error `megatron-zb train <TRAIN> <extra>` prints (argparse's or derive_and_check's)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            derive_and_check(build_parser().parse_args(shlex.split(f"{TRAIN} {extra}")))
    except SystemExit:
        return err.getvalue()
    except ValueError as error:
        return str(error)
    raise AssertionError(f"not refused: {extra}")


def megatron(**fields) -> str:
    try:
        schedule_settings(argparse.Namespace(**{**MEGATRON, **fields}))
    except ValueError as error:
        return str(error)
    raise AssertionError(f"not refused: {fields}")


def in_place_sgd() -> str:
    import torch

    from megatron_zb.optimizer.rollback import check_invertible

    sub = SimpleNamespace(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    return raised(lambda: check_invertible(sub))


def planner(*argv: str) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(list(argv)) == 2
    return err.getvalue()


def planner_with_costs(*argv: str, valid: bool = True):
    """``planner`` run in a fresh directory holding costs.json (a saved pp=4 profile, or not one of ours)."""

    def trigger(monkeypatch) -> str:
        import tempfile

        from megatron_zb.schedule import CostModel
        from megatron_zb.schedule.costs_file import MeasuredCosts, save_costs

        folder = tempfile.mkdtemp()
        monkeypatch.chdir(folder)
        if valid:
            save_costs("costs.json", MeasuredCosts(CostModel(4), schedule="zb-1p", microbatches=8))
        else:
            Path("costs.json").write_text("{}")
        return planner("plan", "--costs-from", "costs.json", *argv)

    return trigger


def raised(call) -> str:
    try:
        call()
    except (Exception, SystemExit) as error:  # any refusal counts; the message is what is checked
        return str(error)
    raise AssertionError("not refused")


def _no_cpu(extra: str) -> str:
    """The launcher without --cpu (a GPU launch), plus ``extra``."""
    try:
        derive_and_check(build_parser().parse_args(shlex.split(f"{TRAIN.replace('--cpu ', '')} {extra}")))
    except ValueError as error:
        return str(error)
    raise AssertionError(f"not refused: {extra}")


def _without(flag: str) -> str:
    try:
        derive_and_check(build_parser().parse_args(shlex.split(TRAIN.replace(flag, ""))))
    except ValueError as error:
        return str(error)
    raise AssertionError(f"not refused without {flag}")


def cuda_visible(monkeypatch) -> str:
    torch = pytest.importorskip("torch")
    from megatron_zb import cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return raised(cpu.enable)


def checkpoint_layout(_monkeypatch) -> str:
    from megatron_zb.training.checkpoint import Layout, _check_layout

    saved, current = Layout(1, 2, 1, 2, False), Layout(1, 4, 1, 2, False)
    return raised(lambda: _check_layout(saved, current, Path("ckpt/iter_0000010")))


def v_on_megatron_lm(**fields):
    def trigger(_monkeypatch) -> str:
        from megatron_zb.megatron_lm.validation import _checked

        validate = _checked(lambda args: args)
        given = {**MEGATRON, "enable_zero_bubble": False, "zero_bubble_v_schedule": True, **fields}
        return raised(lambda: validate(argparse.Namespace(**given)))

    return trigger


def no_megatron_lm(monkeypatch) -> str:
    from megatron_zb.megatron_lm import checkout

    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    monkeypatch.setattr(checkout.importlib, "import_module", missing)
    return raised(checkout.pretrain_gpt_module)


def surface(with_megatron_lm: bool) -> str:
    """The launcher's refusal of a Megatron-LM flag its loop lacks: with Megatron-LM's parser, and without."""
    from megatron_zb.training import flag_surface

    if with_megatron_lm:  # the message flag_surface.check gives where Megatron-LM's parser knows the flag
        return flag_surface.TO_MEGATRON_LM.format(listed="--reset-attention-mask", them="it")
    return raised(lambda: flag_surface._without_megatron_lm(["--reset-attention-mask"], build_parser()))


def unknown_to(version: str, *argv: str) -> str:
    """refuse_unknown's message for a line read by a parser that lacks the flag (Megatron-LM's, named by version)."""
    from megatron_zb.flags.megatron_lm_parser import given_flags, refuse_unknown

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--hidden-size", type=int)
    flags, stray = given_flags(parser, list(argv) or ["--fooo"])
    return refuse_unknown(flags, stray, f"Megatron-LM {version}'s pretrain_gpt")


def gpu_only_on_cpu() -> str:
    from megatron_zb.flags.megatron_lm_parser import Given
    from megatron_zb.megatron_lm.preflight import _gpu_only

    return _gpu_only("fp8", [Given("--fp8-format", ("hybrid",), argparse.Action(["--fp8-format"], "fp8"))])


def a2a_overlap_mapped(**given) -> str:
    from megatron_zb.megatron.megatron_mapping import moe_overlap_as_pairs

    args = SimpleNamespace(overlap_moe_expert_parallel_comm=True, **given)
    return raised(lambda: moe_overlap_as_pairs(args, True))


def a2a_too_few() -> str:
    """verify's scaled run with too few iterations for the re-plan that places the pairs."""
    from megatron_zb.verify.scale import _moe_overlap

    return raised(lambda: _moe_overlap(SimpleNamespace(has=lambda dest: True), SimpleNamespace(iterations=2)))


def unset_eval_interval(monkeypatch) -> str:
    from megatron_zb.megatron_lm import preflight

    monkeypatch.setattr(preflight, "megatron_lm_version", lambda: "0.19.2")
    args = SimpleNamespace(eval_interval=None, skip_train=False, full_validation=False)
    return raised(lambda: preflight._refuse_unset_eval_interval(args))


def megatron_lm_refuses_the_line() -> str:
    """verify's prefix for what Megatron-LM's validate_args (or our checks) refuse in the line as given."""
    import megatron_zb.verify as verify

    return verify.LINE_REFUSED.format(error="Megatron-LM 0.19.2's validate_args refuses it: ...")


def moe_flex() -> None:
    from megatron_zb.verify.scale import refuse

    refuse(SimpleNamespace(num_experts=8, moe_token_dispatcher_type="flex"))


def check_tolerance(value: float) -> None:
    from megatron_zb.verify.verdict import check_tolerance as check

    check(value)


def all_skipped() -> str:
    from megatron_zb.verify.verdict import Run, compare, report

    run = Run(losses={1: 5.0, 2: 5.0}, grad_norms={1: 1.0, 2: 1.0}, skipped={1: True, 2: True})
    return report(compare(run, run, 1e-5), run, run, "zb-v", 1e-5)


def manifest_refusal(what: str, value) -> str:
    """check_before_spawn on a checkpoint written as save_checkpoint writes it, with one thing changed."""
    import tempfile

    from megatron_zb.testing.checkpoint_folder import RANK_FILE, run_args, save
    from megatron_zb.training.manifest import check_before_spawn

    folder = Path(tempfile.mkdtemp())
    written = save(folder, run_args(folder))
    if what == "flip":
        (written / RANK_FILE).write_bytes(b"x" + (written / RANK_FILE).read_bytes()[1:])
        return raised(lambda: check_before_spawn(run_args(folder)))
    if what == "load":
        (folder / "model.pt").write_bytes(b"x")
        value = str(folder / "model.pt")
    return raised(lambda: check_before_spawn(run_args(folder, **{what: value})))


def planner_json_pp(pp: int) -> str:
    import json
    import tempfile

    path = Path(tempfile.mkdtemp()) / "two.json"
    orders = [[{"pass": "F", "stage": stage, "microbatch": 0}] for stage in (0, 1)]
    path.write_text(json.dumps({"pp": pp, "ranks": orders}))
    return planner("plan", "--from-file", str(path))


def wrong_chunk_count(_monkeypatch) -> str:
    pytest.importorskip("torch")
    from megatron_zb.runtime.forward_backward import ForwardBackward

    groups = SimpleNamespace(pp=SimpleNamespace(size=lambda: 4))
    return raised(lambda: ForwardBackward("zb-v")._schedule_for_models(groups, 8, [object()]))


def runtime_config(**config):
    def trigger(_monkeypatch) -> str:
        pytest.importorskip("torch")
        from megatron_zb.runtime.megatron_contract import refuse_unsupported

        return raised(lambda: refuse_unsupported(SimpleNamespace(**config)))

    return trigger


def p2p_timeout(_monkeypatch) -> str:
    pytest.importorskip("torch")
    from megatron_zb.runtime import p2p

    class TimedOut:
        def wait(self, timeout):
            raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")

    transfer = p2p.Transfer(peer=0, what="activation for F s1 mb2", send=False)
    return raised(lambda: p2p.wait_work(TimedOut(), 2.0, transfer.describe(1)))


# (fragment quoted in docs/user-guide.md, how to trigger it)
CASES = [
    # schedule flags
    (
        "--enable-optimizer-post-validation needs a megatron-zb schedule",
        lambda _: train("--enable-optimizer-post-validation"),
    ),
    (
        "--enable-optimizer-post-validation does not support --log-num-zeros-in-grad",
        lambda _: megatron(enable_optimizer_post_validation=True, log_num_zeros_in_grad=True),
    ),
    (
        "--enable-optimizer-post-validation does not support --overlap-param-gather",
        lambda _: megatron(enable_optimizer_post_validation=True, overlap_param_gather=True),
    ),
    ("in-place rollback inverts the Adam update; this optimizer is SGD", lambda _: in_place_sgd()),
    (
        "'auto' (a limit adapted to free GPU memory) is not supported",
        lambda _: train("--enable-zero-bubble --zero-bubble-max-pending-backward auto"),
    ),
    (
        "--zero-bubble-memory-limit and --zero-bubble-max-pending-backward both set a memory limit",
        lambda _: train(
            "--pipeline-schedule zb-auto --zero-bubble-memory-limit 4 --zero-bubble-max-pending-backward 2"
        ),
    ),
    (
        "--zero-bubble-memory-limit applies to the automatic schedules (auto, bitpipe-zb, v-auto, zb-auto), "
        "not to zb-1p",
        lambda _: train("--enable-zero-bubble --zero-bubble-memory-limit 6"),
    ),
    (
        "--zero-bubble-memory-limit needs --pipeline-schedule auto, bitpipe-zb, v-auto or zb-auto",
        lambda _: train("--zero-bubble-memory-limit 6"),
    ),
    (
        "--zero-bubble-max-pending-backward needs --enable-zero-bubble",
        lambda _: train("--zero-bubble-max-pending-backward 4"),
    ),
    (
        "--zero-bubble-v-schedule-mem-setup needs --zero-bubble-v-schedule",
        lambda _: train("--zero-bubble-v-schedule-mem-setup half"),
    ),
    (
        "--pipeline-schedule zb-v conflicts with the reference flags, which select zb-1p",
        lambda _: train("--enable-zero-bubble --pipeline-schedule zb-v"),
    ),
    ("argument --pipeline-schedule: invalid choice: 'zb-3p'", lambda _: train("--pipeline-schedule zb-3p")),
    (
        "zb-v runs two chunks per rank (the V), got --virtual-pipeline-model-parallel-size 3",
        lambda _: train("--pipeline-schedule zb-v --virtual-pipeline-model-parallel-size 3"),
    ),
    (
        "zb-auto needs --zero-bubble-memory-limit >= 1",
        lambda _: train("--pipeline-schedule zb-auto --zero-bubble-memory-limit 0.5"),
    ),
    (
        "--zero-bubble-pipeline-timers-end-iter (5) is before --zero-bubble-pipeline-timers-start-iter (10)",
        lambda _: train(
            "--enable-zero-bubble --zero-bubble-pipeline-timers-start-iter 10 --zero-bubble-pipeline-timers-end-iter 5"
        ),
    ),
    (
        "--zero-bubble-pipeline-timers-start-iter must be at least 1",
        lambda _: train("--enable-zero-bubble --zero-bubble-pipeline-timers-start-iter 0"),
    ),
    ("--zero-bubble-save-costs needs a zero-bubble schedule", lambda _: train("--zero-bubble-save-costs c.json")),
    (
        "--zero-bubble-save-costs saves the costs measured for re-planning",
        lambda _: train("--enable-zero-bubble --no-zero-bubble-replan --zero-bubble-save-costs c.json"),
    ),
    (
        "megatron-zb schedules do not support --context-parallel-size > 1 yet",
        lambda _: megatron(context_parallel_size=2),
    ),
    (
        "--pipeline-schedule bitpipe-zb runs 2 pipes, each with its own copy of the loss block",
        lambda _: megatron(mtp_num_layers=1, pipeline_schedule="bitpipe-zb", enable_zero_bubble=False),
    ),
    (
        "encoder-decoder models (--encoder-num-layers with --decoder-num-layers, as T5) are not supported",
        lambda _: megatron(encoder_num_layers=2, decoder_num_layers=2),
    ),
    # model and batch shape
    ("--num-layers 18 does not split evenly into 4 layer blocks", lambda _: train("--num-layers 18")),
    (
        "(the v placement needs a multiple of 2 layers per pipeline stage)",
        lambda _: train("--zero-bubble-v-schedule --num-layers 12"),
    ),
    (
        "as --allow-padding-num-layers is on",
        lambda _: train("--zero-bubble-v-schedule --num-layers 13 --allow-padding-num-layers"),
    ),
    (
        "--global-batch-size 9 is not a multiple of --micro-batch-size 1 x data-parallel size 2 = 2",
        lambda _: train("--cpu-procs 8 --global-batch-size 9 --enable-zero-bubble"),
    ),
    (
        "--num-layers-per-virtual-pipeline-stage 3 does not split --num-layers 16",
        lambda _: train("--pipeline-schedule interleaved-1f1b --num-layers-per-virtual-pipeline-stage 3"),
    ),
    # megatron-zb train only
    ("megatron-zb's own training loop does not implement --reset-attention-mask", lambda _: surface(True)),
    ("that megatron-zb's launcher does not know: --reset-attention-mask", lambda _: surface(False)),
    ("flag that Megatron-LM 0.19.2's pretrain_gpt does not know: --fooo", lambda _: unknown_to("0.19.2")),
    (
        "6 processes do not split into tensor (1) x pipeline (4) groups; use a multiple of 4",
        lambda _: train("--cpu-procs 6"),
    ),
    (
        "--distributed-timeout-minutes must be a finite number of minutes from 1 second to a day",
        lambda _: train("--distributed-timeout-minutes 1e-9"),
    ),
    (
        "s is longer than --distributed-timeout-minutes",
        lambda _: train("--pipeline-schedule zb-1p --distributed-timeout-minutes 1 --zero-bubble-p2p-timeout 90"),
    ),
    (
        "--optimizer-post-validation-rollback in-place undoes a step by running Adam's update backwards",
        lambda _: train(
            "--pipeline-schedule zb-1p --enable-optimizer-post-validation --optimizer-post-validation-rollback "
            "in-place --optimizer sgd"
        ),
    ),
    ("--cpu-procs needs --cpu", lambda _: _no_cpu("--cpu-procs 4")),
    ("--cpu-procs must be at least 1", lambda _: train("--cpu-procs -4")),
    ("--data-path and --mock-data are exclusive", lambda _: train("--data-path corpus_text_document")),
    (
        "--data-path needs --tokenizer-type",
        lambda _: raised(
            lambda: derive_and_check(build_parser().parse_args(TRAIN.replace("--mock-data", "--data-path c").split()))
        ),
    ),
    ("--tokenizer-type GPT2BPETokenizer needs --vocab-file", lambda _: train("--tokenizer-type GPT2BPETokenizer")),
    ("give --mock-data (synthetic sequences)", lambda _: _without("--mock-data")),
    ("--mock-data needs --vocab-size", lambda _: _without("--vocab-size 256")),
    (
        "--num-experts 8 does not divide by --expert-model-parallel-size 3",
        lambda _: train("--num-experts 8 --expert-model-parallel-size 3"),
    ),
    ("--context-parallel-size > 1 is not supported by this launcher yet", lambda _: train("--context-parallel-size 2")),
    ("--trace-file traces megatron-zb's passes: choose a schedule", lambda _: train("--trace-file out/t.json")),
    ("--fp16 and --bf16 are exclusive", lambda _: train("--fp16 --bf16")),
    (
        "--num-attention-heads 6 does not divide by --tensor-model-parallel-size 4",
        lambda _: train("--num-attention-heads 6 --tensor-model-parallel-size 4 --cpu-procs 16"),
    ),
    ("--sequence-parallel needs --tensor-model-parallel-size > 1", lambda _: train("--sequence-parallel")),
    ("--save-interval needs --save DIRECTORY", lambda _: train("--save-interval 5")),
    ("--trace-iteration needs --trace-file FILE", lambda _: train("--trace-iteration 3")),
    (
        "--trace-iteration must be between 1 and --train-iters 10",
        lambda _: train("--pipeline-schedule 1f1b --trace-file out/t.json --trace-iteration 30"),
    ),
    ("megatron_zb.cpu.enable() is for CPU-only runs; CUDA is available here", cuda_visible),
    ("resume with the same parallel sizes, chunk count and optimizer kind", checkpoint_layout),
    ("holds a model of another shape", lambda _: manifest_refusal("hidden_size", 64)),
    ("holds the state of --optimizer adam", lambda _: manifest_refusal("optimizer", "sgd")),
    ("is a file; give the checkpoint folder", lambda _: manifest_refusal("load", "file")),
    ("does not match its sha256 in manifest.json", lambda _: manifest_refusal("flip", None)),
    ("this run needs at least", lambda _: train("--vocab-size 1000000000000")),
    # --megatron-lm
    (
        "zb-v places its layer blocks itself (v placement: rank 0 holds layer blocks 0 and 7 of 8)",
        v_on_megatron_lm(pipeline_model_parallel_layout="E|(t|)*14,t|tL"),
    ),
    (
        "zb-v on Megatron-LM needs --num-layers divisible by 8",
        v_on_megatron_lm(num_layers=14, allow_padding_num_layers=True),
    ),
    ("--megatron-lm needs a Megatron-LM checkout", no_megatron_lm),
    ("--fp8-format hybrid cannot run on CPU: fp8 needs Transformer Engine", lambda _: gpu_only_on_cpu()),
    ("--eval-interval: Megatron-LM 0.19.2 leaves it unset by default", unset_eval_interval),
    (
        "--overlap-moe-expert-parallel-comm hides the all-to-all of megatron-core's alltoall and flex dispatchers; "
        "--moe-token-dispatcher-type allgather has none",
        lambda _: a2a_overlap_mapped(moe_token_dispatcher_type="allgather"),
    ),
    # verify
    ("values that follow no flag", lambda _: unknown_to("0.19.2", "--hidden-size", "64", "128")),
    (
        "--overlap-moe-expert-parallel-comm with a megatron-zb schedule runs overlapped F&B pairs",
        lambda _: a2a_too_few(),
    ),
    ("your line, before any scaling: Megatron-LM", lambda _: megatron_lm_refuses_the_line()),
    ("--moe-token-dispatcher-type flex: the flex dispatcher is DeepEP's or HybridEP's", lambda _: raised(moe_flex)),
    (
        "--verify-tolerance nan: give a finite relative difference of 0 or more",
        lambda _: raised(lambda: check_tolerance(float("nan"))),
    ),
    ("INCONCLUSIVE: every iteration skipped the optimizer step", lambda _: all_skipped()),
    # planning
    (
        "zb-h2 needs --memory-limit >= 7 for pp=4, microbatches=8, got 4",
        lambda _: planner("plan", "--schedule", "zb-h2", "--pp", "4", "--microbatches", "8", "--memory-limit", "4"),
    ),
    ("--costs-from costs.json: not a megatron-zb costs file", planner_with_costs(valid=False)),
    ("--pp 8: --costs-from costs.json was measured at pipeline size 4", planner_with_costs("--pp", "8")),
    ("--cost-f and --costs-from costs.json both give times", planner_with_costs("--cost-f", "2")),
    (
        "plan and compare take at most 786,432",
        lambda _: planner("plan", "--schedule", "zb-v", "--pp", "4096", "--microbatches", "8192"),
    ),
    ('"pp" is 3 but "ranks" holds the orders of 2 ranks', lambda _: planner_json_pp(3)),
    # runtime
    ("schedule zb-v runs 2 model chunk(s) per rank, got 1", wrong_chunk_count),
    (
        "do not support variable sequence lengths between microbatches",
        runtime_config(variable_seq_lengths=True),
    ),
    ("do not support --defer-embedding-wgrad-compute", runtime_config(defer_embedding_wgrad_compute=True)),
    (
        "do not support --num-microbatches-with-partial-activation-checkpoints",
        runtime_config(num_microbatches_with_partial_activation_checkpoints=2),
    ),
    ("pipeline rank 1 receiving activation for F s1 mb2 from pipeline rank 0: timed out after", p2p_timeout),
]


def troubleshooting_fragments() -> list[str]:
    """The code spans of the first column of every table under '## Troubleshooting'."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text[text.index("\n## Troubleshooting\n") :]
    following = section.find("\n## ", 1)
    section = section if following < 0 else section[:following]
    fragments = []
    for line in section.splitlines():
        found = re.match(r"\| `([^`]+)` \|", line)
        if found:
            fragments.append(found.group(1))
    return fragments


def test_doc_quotes_exactly_the_checked_fragments():
    quoted = troubleshooting_fragments()
    checked = [fragment for fragment, _ in CASES]
    assert len(quoted) == len(set(quoted)), "a fragment is quoted twice"
    assert sorted(quoted) == sorted(checked), (
        f"quoted but not checked here: {sorted(set(quoted) - set(checked))}; "
        f"checked but not quoted: {sorted(set(checked) - set(quoted))}"
    )


@pytest.mark.parametrize("fragment, trigger", CASES, ids=[fragment[:50] for fragment, _ in CASES])
def test_quoted_message_is_produced(fragment, trigger, monkeypatch):
    message = trigger(monkeypatch)
    assert fragment in message, f"docs/user-guide.md quotes {fragment!r}, the code says: {message}"
