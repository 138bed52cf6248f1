"""The megatron-zb command: plan in every format, list, and refusals with exit code 2."""

import json
import subprocess
import sys

import pytest

from megatron_zb.cli import main
from megatron_zb.schedule.registry import names


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_has_the_documented_fields(capsys):
    code, out, _ = run(capsys, "plan", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8", "--format", "json")
    assert code == 0
    result = json.loads(out)
    assert {"schedule", "pp", "microbatches", "makespan", "stage_span", "bubble_rate", "bubble_rate_makespan"} <= set(
        result
    )
    assert (result["schedule"], result["pp"], result["microbatches"]) == ("zb-h1", 4, 8)
    assert result["makespan"] == 3 * 8 + 4 - 1
    assert result["bubble_rate"] == pytest.approx(3 / 27)
    assert result["peak_memory"] == [4, 3.5, 3, 2.5]
    assert len(result["ranks"]) == 4 and all(len(rank) == 3 * 8 for rank in result["ranks"])
    first = result["ranks"][1][0]
    assert first == {"pass": "F", "stage": 1, "chunk": 0, "microbatch": 0, "start": 1.0, "end": 2.0}


def test_plan_takes_per_stage_costs_and_comm(capsys):
    argv = ["plan", "--schedule", "1f1b", "--pp", "2", "-m", "2", "--format", "json"]
    costs = ["--cost-f", "1,2", "--cost-b", "2,3", "--cost-w", "1", "--cost-comm", "0.5"]
    code, out, _ = run(capsys, *argv, *costs)
    assert code == 0
    assert json.loads(out)["makespan"] == 17  # worked by hand in tests/schedule/test_hand_computed.py


@pytest.mark.parametrize(
    "fmt,marker", [("svg", "<svg"), ("html", "<html"), ("chrome-trace", '"traceEvents"'), ("text", "rank 3 |")]
)
def test_plan_writes_each_format_to_a_file(capsys, tmp_path, fmt, marker):
    target = tmp_path / f"plan.{fmt}"
    code, out, _ = run(
        capsys, "plan", "--schedule", "zb-h2", "--pp", "4", "-m", "8", "--format", fmt, "-o", str(target)
    )
    assert code == 0 and out == ""
    text = target.read_text()
    assert marker in text
    if fmt == "chrome-trace":
        events = json.loads(text)["traceEvents"]
        assert sum(1 for e in events if e["ph"] == "X") == 4 * 8 * 3


def test_list_names_every_schedule_once(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == names()


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--schedule", "zb-h2", "--memory-limit", "4"],
            "zb-h2 needs --memory-limit >= 7 for pp=4, microbatches=8, got 4",
        ),
        (["--schedule", "1f1b", "--chunks", "2"], "1f1b runs one chunk per rank, got --chunks 2"),
        (["--schedule", "1f1b", "--cost-f", "1,2"], "t_f (--cost-f) has 2 values; give one number or one per stage"),
        (["--schedule", "nope"], "unknown schedule 'nope'"),
        (
            ["--schedule", "1f1b", "--mem-b", "-0.7"],
            "mem_f + mem_b + mem_w (--mem-f/--mem-b/--mem-w) = -0.2, must be 0",
        ),
    ],
)
def test_bad_settings_are_refused(capsys, extra, message):
    code, out, err = run(capsys, "plan", "--pp", "4", "-m", "8", *extra)
    assert code == 2 and out == ""
    assert err.startswith("megatron-zb plan: error: ") and message in err


def test_memory_refusal_lists_schedules_that_fit(capsys):
    _, _, err = run(capsys, "plan", "--schedule", "zb-h2", "--pp", "4", "-m", "8", "--memory-limit", "4")
    fits = err.strip().split("schedules that fit: ")[1].split(", ")
    assert {"1f1b (4)", "zb-h1 (4)"} <= set(fits)  # and any other schedule that fits, as generators are added
    assert all(float(item.rsplit("(", 1)[1].rstrip(")")) <= 4 for item in fits)
    assert not any(item.startswith("zb-h2 ") for item in fits)


def test_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "megatron_zb", "plan", "--schedule", "1f1b", "--pp", "2", "-m", "2", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(result.stdout)["makespan"] == 9


def test_plan_and_compare_refuse_settings_above_their_size_naming_the_limit(capsys) -> None:
    from megatron_zb.cli import MAX_PASSES, check_size

    for command in (["plan", "--schedule", "zb-v"], ["compare"]):
        code = main([*command, "--pp", "4096", "--microbatches", "8192"])
        err = capsys.readouterr().err
        assert code == 2 and "is 201,326,592 passes" in err and f"take at most {MAX_PASSES:,}" in err
    check_size(128, 1024, None)  # the largest setting taken: pp 128, 1024 microbatches, 2 chunks


@pytest.mark.parametrize("command", [["plan", "--schedule", "1f1b", "--pp", "2", "-m", "2"], ["train", "--cpu"]])
def test_ctrl_c_at_any_point_exits_130_without_a_traceback(monkeypatch, capsys, command) -> None:
    from megatron_zb import cli
    from megatron_zb.training import arguments

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_plan", interrupted)
    monkeypatch.setattr(arguments, "build_parser", interrupted)  # while the launcher is still parsing
    assert main(command) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C)" in err and "Traceback" not in err
