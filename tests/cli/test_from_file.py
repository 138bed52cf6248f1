"""plan --from-file (our JSON, PyTorch's CSV), --format torch-csv, and training's --pipeline-schedule file:PATH."""

from __future__ import annotations

import json

import pytest

from megatron_zb.cli import main
from megatron_zb.training.arguments import build_parser, derive_and_check

GPT = ["--cost-f", "1.2,1,1,1.2", "--cost-b", "1.1", "--cost-w", "0.7", "--cost-comm", "0.05"]
# pp=2, m=1, ZB-H1 with PyTorch's communication actions in place
WITH_COMMS = "0F0,0SEND_F0,0RECV_B0,0I0,0W0\n1RECV_F0,1F0,1I0,1SEND_B0,1W0\n"


def run(capsys, *argv):
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def planned(capsys, *argv) -> dict:
    code, out, err = run(capsys, "plan", *argv, "--format", "json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("name, chunks", [("1f1b", None), ("zb-2p", 2), ("zb-v", None), ("interleaved-1f1b", 4)])
@pytest.mark.parametrize("fmt, suffix", [("json", "json"), ("torch-csv", "csv")])
def test_a_written_schedule_reads_back_to_the_same_timeline(capsys, tmp_path, name, chunks, fmt, suffix):
    setting = ["--pp", 4, "-m", 8, *(["--chunks", chunks] if chunks else [])]
    path = tmp_path / f"{name}.{suffix}"
    code, _, err = run(capsys, "plan", "--schedule", name, *setting, *GPT, "--format", fmt, "-o", path)
    assert code == 0, err
    direct = planned(capsys, "--schedule", name, *setting, *GPT)
    back = planned(capsys, "--from-file", path, *GPT)
    assert back["schedule"] == path.name
    assert {key: value for key, value in back.items() if key != "schedule"} == {
        key: value for key, value in direct.items() if key != "schedule"
    }


def test_torch_csv_is_what_pytorch_writes(capsys):
    code, out, _ = run(capsys, "plan", "--schedule", "zb-h1", "--pp", 2, "-m", 2, "--format", "torch-csv")
    assert code == 0
    assert out == "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n"


def test_a_csv_with_comms_plans_and_says_what_it_dropped(capsys, tmp_path):
    path = tmp_path / "h1.csv"
    path.write_text(WITH_COMMS)
    code, out, err = run(capsys, "plan", "--from-file", path, "--cost-comm", 0.5)
    assert code == 0
    assert "schedule     h1.csv  pp=2  microbatches=1  chunks=1" in out
    assert "makespan     6  stage span 6" in out  # rank 0: F0 1, comm 0.5, F1 1 + B1 1, comm 0.5, B0 1 + W0 1
    assert err == (
        f"megatron-zb plan: note: {path}: 4 SEND/RECV actions agree with the compute order and were dropped: "
        "megatron-zb derives its messages from the compute order\n"
    )


def test_a_hand_written_json_needs_only_the_orders(capsys, tmp_path):
    path = tmp_path / "h1.json"
    passes = [("F", 0), ("B", 0), ("W", 0)], [("F", 1), ("B", 1), ("W", 1)]
    orders = [[{"pass": kind, "stage": stage, "microbatch": 0} for kind, stage in rank] for rank in passes]
    path.write_text(json.dumps({"ranks": orders}))
    result = planned(capsys, "--from-file", path)
    assert (result["pp"], result["microbatches"], result["placement"], result["makespan"]) == (2, 1, ["linear"], 5)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "0I0,0F0,0W0\n1F0,1I0,1W0\n",
            "schedule bad.csv (pp=2, microbatches=1) is invalid:\n"
            "  [order] rank 0 runs B s0 mb0 (pass 0) before its input F s0 mb0 (pass 1)",
        ),
        (
            "0F0,0I0,0W0\n1F0,1W0\n",
            "schedule bad.csv (pp=2, microbatches=1) is invalid:\n  [missing] missing B s1 mb0: rank 1 never runs it",
        ),
        (
            '{"ranks": [[{"pass": "F", "stage": 0}]]}',
            "bad.csv: not a schedule as `megatron-zb plan --format json` writes it (KeyError: 'microbatch')",
        ),
        (
            '{"placement": ["linear"], "ranks": [[{"pass": "F", "stage": 0, "chunk": 1, "microbatch": 0}]]}',
            "bad.csv: rank 0 runs stage 0 on chunk 1, but the linear placement puts it on chunk 0",
        ),
        (
            '{"pp": 3, "ranks": [[{"pass": "F", "stage": 0, "microbatch": 0}], [{"pass": "F", "stage": 1, '
            '"microbatch": 0}]]}',
            'bad.csv: "pp" is 3 but "ranks" holds the orders of 2 ranks',
        ),
    ],
)
def test_a_file_that_fails_validation_is_refused_with_the_validators_message(capsys, tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    code, out, err = run(capsys, "plan", "--from-file", path)
    assert (code, out) == (2, "")
    assert err.startswith(f"megatron-zb plan: error: {message}")


def test_the_memory_limit_is_checked_by_the_validator(capsys, tmp_path):
    path = tmp_path / "h1.csv"
    path.write_text(WITH_COMMS)
    code, _, err = run(capsys, "plan", "--from-file", path, "--memory-limit", 0.5)
    assert code == 2
    assert err == (
        "megatron-zb plan: error: schedule h1.csv (pp=2, microbatches=1) is invalid:\n"
        "  [memory] rank 0 holds 1 microbatch-stages of activations after F s0 mb0 (pass 0), over the memory limit "
        "0.5; this rank peaks at 1\n"
        "  [memory] rank 1 holds 1 microbatch-stages of activations after F s1 mb0 (pass 0), over the memory limit "
        "0.5; this rank peaks at 1\n"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--pp", 4], "--from-file {path} holds a schedule for pp=2, microbatches=1, chunks=1, but --pp gives pp=4;"),
        (["-m", 3, "--chunks", 2], "but --microbatches gives microbatches=3; --chunks gives chunks=2; plan a schedule"),
        (["--schedule", "1f1b"], "--schedule plans a schedule; --from-file {path} gives its orders: drop one"),
        (["--refine-seconds", 1], "--refine-seconds plans a schedule; --from-file {path} gives its orders: drop one"),
        (["--format", "torch-csv", "--iterations", 2], "--format torch-csv writes one iteration's orders; drop"),
    ],
)
def test_flags_that_contradict_the_file_are_refused(capsys, tmp_path, extra, message):
    path = tmp_path / "h1.csv"
    path.write_text(WITH_COMMS)
    code, _, err = run(capsys, "plan", "--from-file", path, *extra)
    assert code == 2
    assert message.format(path=path) in err


def test_a_missing_file_is_refused(capsys, tmp_path):
    code, _, err = run(capsys, "plan", "--from-file", tmp_path / "nowhere.csv")
    assert code == 2
    missing = tmp_path / "nowhere.csv"
    assert err == f"megatron-zb plan: error: {missing}: cannot read the schedule file (No such file or directory)\n"


# -- training: --pipeline-schedule file:PATH is checked before any process starts -----------------
TRAIN = (
    "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 --cpu --cpu-procs 2 "
    "--pipeline-model-parallel-size 2"
).split()


def train_flags(extra: list[str]):
    args = build_parser().parse_args(TRAIN + extra)
    derive_and_check(args)
    return args


@pytest.fixture
def zbv_file(capsys, tmp_path):
    path = tmp_path / "zbv.csv"
    assert run(capsys, "plan", "--schedule", "zb-v", "--pp", 2, "-m", 4, "--format", "torch-csv", "-o", path)[0] == 0
    return path


def test_training_runs_a_file_schedule_on_its_placement(zbv_file):
    args = train_flags(["--pipeline-schedule", f"file:{zbv_file}"])
    assert (args.zero_bubble.schedule, args.placement.kind, args.zero_bubble.chunks) == (f"file:{zbv_file}", "v", None)


@pytest.mark.parametrize(
    "extra, differs",
    [
        (
            ["--global-batch-size", "16"],
            "--global-batch-size 16 / (--micro-batch-size 2 x data-parallel size 1) gives ",
        ),
        (["--virtual-pipeline-model-parallel-size", "4"], "--virtual-pipeline-model-parallel-size gives chunks=4"),
    ],
)
def test_training_refuses_a_file_planned_for_another_run(zbv_file, extra, differs):
    with pytest.raises(ValueError) as error:
        train_flags(["--pipeline-schedule", f"file:{zbv_file}", *extra])
    message = str(error.value)
    assert message.startswith(
        f"--pipeline-schedule file:{zbv_file}: the file holds a schedule for pp=2, microbatches=4, chunks=2, but "
    )
    assert differs in message and message.endswith("or change the setting")


def test_training_names_the_choices_of_an_unknown_schedule(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*TRAIN, "--pipeline-schedule", "zb-x"])
    err = capsys.readouterr().err
    assert "argument --pipeline-schedule: invalid choice: 'zb-x' (choose from 1f1b, auto," in err
    assert err.rstrip().endswith("zb-v, or file:PATH)")
