"""Every bad launcher setting is refused before a process starts: exit 2, one line naming the flag, no traceback.

The catalogue is issue 20's: 19 settings that spawned ranks and then crashed, and 8 that ran
though they should not have (or not as asked). A hypothesis-generated set of bad values adds
the rest of the numeric flags. ``megatron_zb.pretrain_gpt.main`` runs in this process with the
spawner and the torchrun path replaced by functions that fail the test, so nothing here starts
torch.distributed; each case takes milliseconds.
"""

from __future__ import annotations

import contextlib
import io
import math
import multiprocessing
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zb import pretrain_gpt
from megatron_zb.megatron.args import schedule_settings
from megatron_zb.training.arguments import parse

P2P_RANGE = "--zero-bubble-p2p-timeout must be a finite number of seconds in [1, 86400], got "
# A setting that runs: pp=2 on two --cpu processes, 4 microbatches of 2 samples.
BASE = (
    "--cpu --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--vocab-size 64 --mock-data --micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 3e-3 "
    "--log-interval 5"
).split()
UNWRITABLE = "/proc/megatron-zb-test/checkpoints"  # not even root can create files in /proc


class Spawned(Exception):
    """Raised by the patched spawner: the launcher got past its checks."""


@pytest.fixture
def launcher(monkeypatch, capsys):
    """``run(argv)``: (exit code, stderr) of ``megatron-zb train BASE argv``; the test fails if a process starts."""

    def spawn(args):
        pytest.fail(f"processes were spawned for a bad setting: world size {args.world_size}")

    monkeypatch.setattr(pretrain_gpt, "_spawn_cpu", spawn)
    monkeypatch.setattr(pretrain_gpt, "_run_under_launcher", spawn)

    def run(argv: list[str]) -> tuple[int, str]:
        before = set(multiprocessing.active_children())  # the session's pooled workers of other modules
        with pytest.raises(SystemExit) as stopped:
            pretrain_gpt.main(BASE + argv)
        err = capsys.readouterr().err
        assert set(multiprocessing.active_children()) == before
        return stopped.value.code, err

    return run


def refused(run, argv: list[str], *fragments: str) -> str:
    code, err = run(argv)
    assert code == 2, err
    assert err.startswith("megatron-zb train: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"
    return err


def test_the_base_setting_reaches_the_spawner(monkeypatch) -> None:
    """The catalogue's cases differ from a setting that runs only by what they name."""
    started = []
    monkeypatch.setattr(pretrain_gpt, "_spawn_cpu", lambda args: started.append(args.world_size) or 0)
    assert pretrain_gpt.main(BASE) == 0
    assert started == [2]


# Issue 20: settings that spawned processes and then crashed with a traceback.
CRASHED = {
    "micro-batch-size 0": (
        "--micro-batch-size 0",
        "--micro-batch-size must be at least 1 (samples per microbatch), got 0",
    ),
    "cpu-threads 0": ("--cpu-threads 0", "--cpu-threads must be at least 1 (torch threads per --cpu process), got 0"),
    "cpu-threads -1": (
        "--cpu-threads -1",
        "--cpu-threads must be at least 1 (torch threads per --cpu process), got -1",
    ),
    "train-iters 0": ("--train-iters 0", "--train-iters must be at least 1 (iterations to train), got 0"),
    "train-iters -1": ("--train-iters -1", "--train-iters must be at least 1 (iterations to train), got -1"),
    "log-interval 0": ("--log-interval 0", "--log-interval must be at least 1 (iterations between log lines), got 0"),
    "seq-length 0": ("--seq-length 0", "--seq-length must be at least 1, got 0"),
    "vocab-size 0": ("--vocab-size 0", "--vocab-size must be at least 1, got 0"),
    "positions below sequence": (
        "--max-position-embeddings 8",
        "--max-position-embeddings 8 is below --seq-length 16: positions past it have no embedding; give at least 16",
    ),
    "lr nan": ("--lr nan", "--lr must be a finite number >= 0 (0 keeps the weights fixed), got nan"),
    "lr -1": ("--lr -1", "--lr must be a finite number >= 0 (0 keeps the weights fixed), got -1.0"),
    "hidden-dropout 1.5": (
        "--hidden-dropout 1.5",
        "--hidden-dropout must be a finite number in [0, 1) (0 turns dropout off), got 1.5",
    ),
    "p2p-timeout 0": (
        "--pipeline-schedule zb-1p --zero-bubble-p2p-timeout 0",
        P2P_RANGE + "0.0",
    ),
    "p2p-timeout -5": (
        "--pipeline-schedule zb-1p --zero-bubble-p2p-timeout -5",
        P2P_RANGE + "-5.0",
    ),
    "p2p-timeout nan": (
        "--pipeline-schedule zb-1p --zero-bubble-p2p-timeout nan",
        P2P_RANGE + "nan",
    ),
    "p2p-timeout 1e-9": ("--pipeline-schedule zb-1p --zero-bubble-p2p-timeout 1e-9", P2P_RANGE + "1e-09"),
    "p2p-timeout 1e20": ("--pipeline-schedule zb-1p --zero-bubble-p2p-timeout 1e20", P2P_RANGE + "1e+20"),
    "p2p-timeout past the distributed timeout": (
        "--pipeline-schedule zb-1p --distributed-timeout-minutes 1 --zero-bubble-p2p-timeout 90",
        "--zero-bubble-p2p-timeout 90 s is longer than --distributed-timeout-minutes 1 (60 s), which bounds every "
        "wait: it may only shorten it",
    ),
    "distributed timeout 1e-9": (
        "--distributed-timeout-minutes 1e-9",
        "--distributed-timeout-minutes must be a finite number of minutes from 1 second to a day",
    ),
    "distributed timeout of a year": (
        "--distributed-timeout-minutes 525600",
        "--distributed-timeout-minutes must be a finite number of minutes from 1 second to a day (0.01667 to 1440), "
        "got 525600.0",
    ),
    "distributed timeout nan": ("--distributed-timeout-minutes nan", "got nan: it bounds every wait"),
    "in-place rollback with sgd": (
        "--pipeline-schedule zb-1p --enable-optimizer-post-validation --optimizer-post-validation-rollback in-place "
        "--optimizer sgd",
        "--optimizer-post-validation-rollback in-place undoes a step by running Adam's update backwards; "
        "--optimizer sgd has no such inverse: use --optimizer-post-validation-rollback exact",
    ),
    "virtual stages that do not split the layers": (
        "--num-layers 4 --num-layers-per-virtual-pipeline-stage 3",
        "--num-layers-per-virtual-pipeline-stage 3 does not split --num-layers 4 into pipeline size 2 x chunks",
    ),
    "zb-v at pp 1": (
        "--pipeline-model-parallel-size 1 --pipeline-schedule zb-v",
        "--pipeline-schedule zb-v runs several model chunks on each pipeline rank and needs "
        "--pipeline-model-parallel-size 2 or more",
    ),
    "V reference flag at pp 1": (
        "--pipeline-model-parallel-size 1 --zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup half",
        "--zero-bubble-v-schedule (v-half) runs several model chunks on each pipeline rank",
    ),
}

# Issue 20: settings that ran although they should not have, or not as asked.
RAN = {
    "global batch not a multiple": (
        "--global-batch-size 7",
        "--global-batch-size 7 is not a multiple of --micro-batch-size 2 x data-parallel size 1 = 2 (the samples "
        "left over would be dropped); use a multiple such as 8",
    ),
    "global-batch-size 0": ("--global-batch-size 0", "--global-batch-size must be at least 1 (or leave it out"),
    "cpu-procs 0": ("--cpu-procs 0", "--cpu-procs must be at least 1 (--cpu processes), got 0"),
    "log-interval -1": (
        "--log-interval -1",
        "--log-interval must be at least 1 (iterations between log lines), got -1",
    ),
    "p2p-timeout without a schedule": (
        "--zero-bubble-p2p-timeout 30",
        "--zero-bubble-p2p-timeout applies to megatron-zb schedules only and would have no effect here",
    ),
}


@pytest.mark.parametrize("argv, message", CRASHED.values(), ids=CRASHED.keys())
def test_settings_that_crashed_are_refused_before_spawning(launcher, argv: str, message: str) -> None:
    refused(launcher, argv.split(), message)


@pytest.mark.parametrize("argv, message", RAN.values(), ids=RAN.keys())
def test_settings_that_ran_wrongly_are_refused_before_spawning(launcher, argv: str, message: str) -> None:
    refused(launcher, argv.split(), message)


def test_save_interval_0_is_refused(launcher, tmp_path: Path) -> None:
    refused(
        launcher,
        ["--save", str(tmp_path / "ckpt"), "--save-interval", "0"],
        "--save-interval must be at least 1 (iterations between checkpoints; leave it out to save only at the end)",
    )


def test_load_of_a_missing_folder_is_refused_with_exit_on_missing_checkpoint(launcher, tmp_path: Path) -> None:
    """The last of the issue's 8: Megatron-LM's flag makes a --load with nothing there an error (manifest.py)."""
    missing = tmp_path / "no-such-run"
    refused(
        launcher,
        ["--load", str(missing), "--exit-on-missing-checkpoint"],
        f"--load {missing}: no checkpoint in {missing}",
        "--exit-on-missing-checkpoint makes that an error",
    )


def test_save_under_a_regular_file_is_refused(launcher, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("a file, not a folder\n")
    target = tmp_path / "notes.txt" / "ckpt"
    refused(launcher, ["--save", str(target)], f"--save {target} is under the file {tmp_path / 'notes.txt'}")
    assert (tmp_path / "notes.txt").read_text() == "a file, not a folder\n"


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")
def test_save_where_nothing_can_be_written_is_refused(launcher) -> None:
    refused(launcher, ["--save", UNWRITABLE], f"--save {UNWRITABLE}: cannot write in /proc")


def test_outputs_into_missing_folders_are_created_before_spawning(monkeypatch, tmp_path: Path) -> None:
    """--metrics-file, --trace-file and --zero-bubble-save-costs get their folders before any rank starts."""
    metrics, trace, costs = (tmp_path / name / "out.json" for name in ("metrics", "trace", "costs"))
    seen = []
    paths = (metrics, trace, costs)
    monkeypatch.setattr(pretrain_gpt, "_spawn_cpu", lambda args: seen.append([p.parent.is_dir() for p in paths]) or 0)
    argv = [
        *("--pipeline-schedule", "zb-1p", "--metrics-file", str(metrics), "--trace-file", str(trace)),
        *("--zero-bubble-save-costs", str(costs), "--zero-bubble-pipeline-timers-start-iter", "2"),
        *("--zero-bubble-pipeline-timers-end-iter", "3"),
    ]
    assert pretrain_gpt.main(BASE + argv) == 0
    assert seen == [[True, True, True]]
    assert not any(path.exists() for path in paths), "only the folders: a failed run leaves no empty files"


@pytest.mark.parametrize("flag", ["--metrics-file", "--trace-file", "--zero-bubble-save-costs"])
def test_outputs_that_cannot_be_written_are_refused(launcher, tmp_path: Path, flag: str) -> None:
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "out.json"
    schedule = "--pipeline-schedule zb-1p --zero-bubble-pipeline-timers-start-iter 2 "
    schedule += "--zero-bubble-pipeline-timers-end-iter 3"
    refused(launcher, [*schedule.split(), flag, str(target)], f"{flag} {target} is under the file {target.parent}")
    refused(launcher, [*schedule.split(), flag, str(tmp_path)], f"{flag} {tmp_path} is a folder")


def test_saved_costs_that_would_never_be_written_are_refused(launcher, tmp_path: Path) -> None:
    """The default re-planning window (iterations 100-110) ends after a 10-iteration run."""
    refused(
        launcher,
        ["--pipeline-schedule", "zb-1p", "--zero-bubble-save-costs", str(tmp_path / "c.json")],
        "the costs are measured up to iteration 110 (--zero-bubble-pipeline-timers-end-iter) but --train-iters is 10",
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--pipeline-model-parallel-size 1 --virtual-pipeline-model-parallel-size 2", "needs --pipeline-model"),
        ("--cpu-procs 2 --cpu-threads 0", "--cpu-threads must be at least 1"),
        ("--lr-warmup-iters 10", "--lr-warmup-iters 10 must be below --lr-decay-iters 10"),
        ("--min-lr 0.01", "--min-lr 0.01 is above --lr 0.003"),
        ("--hidden-size 30", "--hidden-size 30 does not divide by --num-attention-heads 4"),
        ("--fp16 --initial-loss-scale 8 --min-loss-scale 16", "--min-loss-scale 16 is above --initial-loss-scale 8"),
        ("--seed -1", "--seed must be between 0 and 4294967295, got -1"),
        ("--ffn-hidden-size 0", "--ffn-hidden-size must be at least 1, got 0"),
        ("--make-vocab-size-divisible-by 0", "--make-vocab-size-divisible-by must be at least 1, got 0"),
        ("--pipeline-schedule zb-auto --zero-bubble-memory-limit nan", "--zero-bubble-memory-limit must be a finite"),
        ("--no-zero-bubble-replan --pipeline-schedule zb-1p --zero-bubble-pipeline-timers-end-iter 5", "turns off"),
        ("--zero-bubble-pipeline-timers-start-iter 2", "--zero-bubble-pipeline-timers-start-iter applies to"),
        ("--optimizer-post-validation-rollback in-place", "--optimizer-post-validation-rollback applies to"),
        (
            "--pipeline-schedule zb-1p --optimizer-post-validation-rollback in-place",
            "--optimizer-post-validation-rollback chooses how post-validation undoes a step",
        ),
    ],
)
def test_other_rules_of_megatron_lm_and_ours(launcher, argv: str, message: str) -> None:
    refused(launcher, argv.split(), message)


# The Llama-family flags: what megatron-core's local layer spec would assert on deep inside each rank.
LLAMA_REFUSED = {
    "heads not a multiple of groups": (
        "--group-query-attention --num-query-groups 3",
        "--num-attention-heads 4 does not divide by --num-query-groups 3 (every key/value head serves the same "
        "number of query heads); use one of 1, 2, 4",
    ),
    "groups not a multiple of tp": (
        "--group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2",
        "--num-query-groups 1 does not divide by --tensor-model-parallel-size 2: each tensor-parallel rank holds whole "
        "key/value groups",
    ),
    "swiglu default ffn 0": (
        "--swiglu --hidden-size 16",
        "--swiglu with --hidden-size 16: Megatron-LM's default --ffn-hidden-size, int(8 x hidden / 3 / 64) x 64, is 0",
    ),
    "odd rotary channels": (
        "--position-embedding-type rope --rotary-percent 0.375",
        "--rotary-percent 0.375 rotates int(8 x 0.375) = 3 of each head's 8 channels",
    ),
    "hidden not a multiple of heads": ("--hidden-size 30", "use a multiple of 4 or give --kv-channels"),
    "rotary percent above 1": ("--rotary-percent 1.5", "--rotary-percent must be a finite number in (0, 1]"),
    "norm epsilon negative": ("--norm-epsilon -1", "--norm-epsilon must be a finite number >= 0, got -1.0"),
}


@pytest.mark.parametrize("argv, message", LLAMA_REFUSED.values(), ids=LLAMA_REFUSED.keys())
def test_llama_settings_megatron_core_cannot_build_are_refused(launcher, argv: str, message: str) -> None:
    refused(launcher, argv.split(), message)


def test_llama_flags_reach_the_spawner_with_an_indivisible_hidden_size(monkeypatch, capsys) -> None:
    """With --kv-channels the hidden size need not divide by the heads (as in Megatron-LM); no warning."""
    monkeypatch.setattr(pretrain_gpt, "_spawn_cpu", lambda args: 0)
    llama = "--hidden-size 30 --kv-channels 16 --swiglu --normalization RMSNorm --group-query-attention"
    llama += " --num-query-groups 2 --disable-bias-linear --add-qkv-bias --position-embedding-type rope"
    llama += " --use-rope-scaling --rope-scaling-factor 4 --qk-layernorm --untie-embeddings-and-output-weights"
    llama += " --apply-layernorm-1p"  # megatron_zb's torch norms take zero-centred weights (megatron/norms.py)
    assert pretrain_gpt.main([*BASE, *llama.split()]) == 0
    assert capsys.readouterr().err == ""


def test_llama_flags_without_effect_are_warned_about(monkeypatch, capsys) -> None:
    """Megatron-LM accepts them and ignores them; the launcher says so."""
    monkeypatch.setattr(pretrain_gpt, "_spawn_cpu", lambda args: 0)
    argv = "--rotary-base 500000 --use-rope-scaling --num-query-groups 2 --add-qkv-bias".split()
    assert pretrain_gpt.main([*BASE, *argv]) == 0
    assert pretrain_gpt.main([*BASE, "--position-embedding-type", "rope", "--rope-scaling-factor", "4"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "megatron-zb train: warning: --rotary-base applies to --position-embedding-type rope only; it has no effect "
        "here",
        "megatron-zb train: warning: --use-rope-scaling applies to --position-embedding-type rope only; it has no "
        "effect here",
        "megatron-zb train: warning: --num-query-groups applies to --group-query-attention only (without it every "
        "head has its own key/value head); it has no effect here",
        "megatron-zb train: warning: --add-qkv-bias matters with --disable-bias-linear only (every linear has a "
        "bias); no effect here",
        "megatron-zb train: warning: --rope-scaling-factor applies to --use-rope-scaling only; it has no effect here",
    ]


def test_a_flag_without_effect_is_warned_about(monkeypatch, capsys) -> None:
    monkeypatch.setattr(pretrain_gpt, "_spawn_cpu", lambda args: 0)
    assert pretrain_gpt.main([*BASE, "--optimizer", "sgd", "--adam-beta1", "0.8", "--initial-loss-scale", "1024"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "megatron-zb train: warning: --initial-loss-scale applies to --fp16 only; it has no effect here",
        "megatron-zb train: warning: --adam-beta1 applies to --optimizer adam only; it has no effect here",
    ]


def test_schedule_settings_refuses_a_zero_micro_batch_without_dividing() -> None:
    """The pure-Python path Megatron-LM's validate_args reaches (no launcher checks before it)."""
    import argparse

    namespace = argparse.Namespace(
        pipeline_model_parallel_size=2, num_layers=4, micro_batch_size=0, global_batch_size=8, data_parallel_size=1,
        enable_zero_bubble=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"--micro-batch-size must be at least 1 \(samples per microbatch\), got 0"):
        schedule_settings(namespace)
    namespace.micro_batch_size, namespace.zero_bubble_p2p_timeout = 2, math.inf
    with pytest.raises(ValueError, match=r"--zero-bubble-p2p-timeout must be a finite number of seconds .*, got inf"):
        schedule_settings(namespace)


# Bad values for the numeric flags, each as the argv that carries it (some need a companion flag).
def _as(flag: str, values: st.SearchStrategy, *companions: str) -> st.SearchStrategy:
    return values.map(lambda value: (flag, [*companions, f"{flag}={value}"]))


NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
NON_POSITIVE_INT = st.integers(max_value=0)
SAVE_DIR = tempfile.mkdtemp(prefix="megatron-zb-bad-settings-")
BAD = st.one_of(
    *(
        _as(flag, NON_POSITIVE_INT)
        for flag in (
            "--micro-batch-size",
            "--train-iters",
            "--log-interval",
            "--cpu-threads",
            "--cpu-procs",
            "--seq-length",
            "--vocab-size",
            "--num-layers",
            "--hidden-size",
            "--num-attention-heads",
            "--tensor-model-parallel-size",
            "--pipeline-model-parallel-size",
            "--make-vocab-size-divisible-by",
            "--exit-interval",
            "--ffn-hidden-size",
            "--distributed-timeout-minutes",
            "--hysteresis",
            "--lr-decay-iters",
            "--kv-channels",
            "--num-query-groups",
            "--rotary-base",
        )
    ),  # fmt: skip
    _as("--global-batch-size", NON_POSITIVE_INT | st.integers(1, 10_000).filter(lambda v: v % 2)),
    _as("--max-position-embeddings", st.integers(max_value=15)),
    _as("--save-interval", NON_POSITIVE_INT, "--save", SAVE_DIR),
    _as("--lr-warmup-iters", st.integers(max_value=-1) | st.integers(min_value=10)),
    _as("--seed", st.integers(max_value=-1) | st.integers(min_value=2**32)),
    _as("--lr", NOT_FINITE | st.floats(max_value=0, exclude_max=True)),
    _as("--min-lr", NOT_FINITE | st.floats(max_value=0, exclude_max=True) | st.floats(3e-3, 1e9, exclude_min=True)),
    *(
        _as(flag, NOT_FINITE | st.floats(max_value=0, exclude_max=True) | st.floats(min_value=1))
        for flag in ("--hidden-dropout", "--attention-dropout", "--adam-beta1", "--adam-beta2")
    ),
    *(
        _as(flag, NOT_FINITE | st.floats(max_value=0, exclude_max=True))
        for flag in ("--adam-eps", "--weight-decay", "--clip-grad", "--init-method-std")
    ),
    *(
        _as(flag, NOT_FINITE | st.floats(max_value=0))
        for flag in ("--loss-scale", "--initial-loss-scale", "--min-loss-scale")
    ),
    _as("--loss-scale-window", NOT_FINITE | st.floats(max_value=1, exclude_max=True)),
    _as("--rotary-percent", NOT_FINITE | st.floats(max_value=0) | st.floats(min_value=1, exclude_min=True)),
    _as("--rope-scaling-factor", NOT_FINITE | st.floats(max_value=0)),
    _as("--norm-epsilon", NOT_FINITE | st.floats(max_value=0, exclude_max=True)),
    _as(
        "--zero-bubble-p2p-timeout",
        NOT_FINITE | st.floats(max_value=1, exclude_max=True) | st.floats(min_value=600, exclude_min=True),
        "--pipeline-schedule",
        "zb-1p",
    ),
    _as("--distributed-timeout-minutes", NOT_FINITE | st.floats(max_value=1 / 61) | st.floats(min_value=1441)),
    _as("--zero-bubble-memory-limit", NOT_FINITE | st.floats(max_value=0), "--pipeline-schedule", "zb-auto"),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(BAD, min_size=1, max_size=3, unique_by=lambda bad: bad[0]))
def test_generated_bad_settings_are_refused_before_spawning(bad: list[tuple[str, list[str]]]) -> None:
    argv = [*BASE, *(arg for _, args in bad for arg in args)]
    err = io.StringIO()
    before = set(multiprocessing.active_children())  # the session's pooled workers of other modules
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(err):
        patch.setattr(pretrain_gpt, "_spawn_cpu", _fail_spawn)
        patch.setattr(pretrain_gpt, "_run_under_launcher", _fail_spawn)
        with pytest.raises(SystemExit) as stopped:
            pretrain_gpt.main(argv)
    message = err.getvalue()
    assert stopped.value.code == 2, (argv, message)
    assert message.startswith("megatron-zb train: error: ") and "Traceback" not in message, message
    assert any(flag in message for flag, _ in bad), (argv, message)
    assert set(multiprocessing.active_children()) == before


def _fail_spawn(args) -> int:
    pytest.fail("processes were spawned for a bad setting")


def test_parse_refuses_with_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse([*BASE, "--clip-grad", "nan"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "megatron-zb train: error: --clip-grad must be a finite number >= 0 (0 turns clipping off), got nan\n"
    )


# The Megatron-LM routes: `megatron-zb train --megatron-lm` and the patched pretrain_gpt.py both check our flags
# in Megatron-LM's validate_args (megatron_lm/validation.py); Megatron-LM's own flags are its validate_args' business.
MEGATRON_LM_ARGS = dict(
    pipeline_model_parallel_size=4, num_layers=16, micro_batch_size=1, global_batch_size=8, data_parallel_size=1,
    train_iters=20, zero_bubble_pipeline_timers_start_iter=100, zero_bubble_pipeline_timers_end_iter=110,
    zero_bubble_v_schedule_mem_setup="zb", zero_bubble_p2p_timeout=None, enable_zero_bubble=True,
)  # fmt: skip


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"zero_bubble_p2p_timeout": math.nan}, P2P_RANGE + "nan"),
        ({"zero_bubble_p2p_timeout": 0.0}, P2P_RANGE + "0.0"),
        (
            {"zero_bubble_p2p_timeout": 700.0, "distributed_timeout_minutes": 10},
            "--zero-bubble-p2p-timeout 700 s is longer than --distributed-timeout-minutes 10 (600 s)",
        ),
        (
            {"enable_zero_bubble": False, "pipeline_schedule": "zb-auto", "zero_bubble_memory_limit": -math.inf},
            "--zero-bubble-memory-limit must be a finite number > 0, got -inf",
        ),
        (
            {"enable_zero_bubble": False, "zero_bubble_p2p_timeout": 30.0},
            "--zero-bubble-p2p-timeout applies to megatron-zb schedules only",
        ),
        ({"micro_batch_size": 0}, "--micro-batch-size must be at least 1 (samples per microbatch), got 0"),
    ],
)
def test_megatron_lm_validate_args_refuses_our_bad_numbers(fields: dict, message: str) -> None:
    import argparse

    from megatron_zb.megatron_lm.validation import _checked

    validate = _checked(lambda args: args)
    with pytest.raises(SystemExit) as stopped:
        validate(argparse.Namespace(**{**MEGATRON_LM_ARGS, **fields}))
    assert str(stopped.value.code).startswith(f"megatron-zb: {message}"), stopped.value.code


def test_megatron_lm_validate_args_checks_the_costs_file_path(tmp_path: Path) -> None:
    import argparse

    from megatron_zb.megatron_lm.validation import _checked

    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "costs.json"
    with pytest.raises(SystemExit) as stopped:
        _checked(lambda args: args)(argparse.Namespace(**MEGATRON_LM_ARGS, zero_bubble_save_costs=str(target)))
    assert str(stopped.value.code).startswith(f"megatron-zb: --zero-bubble-save-costs {target} is under the file")


@pytest.mark.parametrize(
    "argv, message",
    [
        ("--cpu --cpu-threads 0", "--cpu-threads must be at least 1 (torch threads per --cpu process), got 0"),
        ("--cpu --cpu-procs -2", "--cpu-procs must be at least 1 (--cpu processes), got -2"),
        ("--cpu-threads 4", "--cpu-threads needs --cpu"),
    ],
)
def test_megatron_lm_launcher_flags_are_checked_before_megatron_lm_is_imported(capsys, argv, message) -> None:
    assert pretrain_gpt.main(["--megatron-lm", *argv.split(), "--num-layers", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-zb train: error: {message}") and err.count("\n") == 1, err


def test_the_zero_bubble_defaults_checked_for_no_effect_are_the_flags_defaults() -> None:
    import argparse

    from megatron_zb.megatron.args import add_args
    from megatron_zb.training.checks import ZERO_BUBBLE_SETTINGS

    parser = add_args(argparse.ArgumentParser())
    assert {name: parser.get_default(name) for name in ZERO_BUBBLE_SETTINGS} == ZERO_BUBBLE_SETTINGS
