"""Bad numbers, bad costs files and unwritable outputs: ``megatron-zb plan|compare`` refuses, never hangs.

Issue 20 found 109 CLI cases with 12 tracebacks, 10 wrong accepts and 3 hangs (NaN costs loop
forever in the list scheduler). Every case here must end within a few seconds (SIGALRM in
this process; the three hangs of the issue also through the real command with a timeout) with
exit code 2 and one ``megatron-zb plan: error: ...`` line naming the option or the field.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zb.cli import main
from megatron_zb.schedule.costs import CostModel
from megatron_zb.schedule.generators.greedy import Switches, _Greedy, greedy_orders, min_memory_limit, step_bound
from megatron_zb.schedule.ir import ScheduleError
from megatron_zb.schedule.placement import linear, v_shape

SECONDS = 10  # far above any case here (each takes milliseconds); a hang fails instead of blocking the suite
PLAN = ["plan", "--schedule", "zb-2p", "--pp", "4", "--microbatches", "8"]  # zb-2p: the list scheduler
COMPARE = ["compare", "--pp", "4", "--microbatches", "8"]
UNWRITABLE = "/proc/megatron-zb-test/out.txt"  # not even root can create files in /proc


@contextlib.contextmanager
def deadline(seconds: float = SECONDS):
    def expired(signum, frame):
        raise TimeoutError(f"hung for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``megatron-zb argv`` in this process, within the deadline."""
    with deadline():
        try:
            code = main(argv)
        except SystemExit as stopped:  # argparse's refusals
            code = stopped.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, argv: list[str], *fragments: str) -> str:
    code, out, err = run(capsys, argv)
    errors = [line for line in err.splitlines() if line.startswith(f"megatron-zb {argv[0]}: error: ")]
    assert code == 2 and len(errors) == 1 and out == "", (code, out, err)
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in errors[0], f"{fragment!r} not in {errors[0]!r}"
    return errors[0]


# nan, inf and out-of-range values of every numeric option, written as --option=VALUE so "-inf" is a value.
NUMBERS = {
    **{option: ("nan", "inf", "-inf", "-1") for option in ("--cost-f", "--cost-b", "--cost-w", "--cost-comm")},
    **{option: ("nan", "inf", "1,nan,1,1") for option in ("--mem-f", "--mem-b", "--mem-w")},
    "--mem-f": ("nan", "inf", "1,nan,1,1", "-1"),
    "--memory-limit": ("nan", "inf", "-1", "0"),
    "--pp": ("0", "-1", "nan", "four"),
    "--microbatches": ("0", "-3", "1.5"),
    "--chunks": ("0", "-2"),
}
PLAN_ONLY = {"--iterations": ("0", "-1"), "--width": ("0", "-5", "nan"), "--refine-seconds": ("nan", "inf", "-1")}
CASES = [
    (command, option, value)
    for command, options in (("plan", {**NUMBERS, **PLAN_ONLY}), ("compare", NUMBERS))
    for option, values in options.items()
    for value in values
]


@pytest.mark.parametrize("command, option, value", CASES, ids=[" ".join(case) for case in CASES])
def test_bad_numbers_are_refused_with_the_option_named(capsys, command: str, option: str, value: str) -> None:
    refused(capsys, [*(PLAN if command == "plan" else COMPARE), f"{option}={value}"], option)


def test_the_issue_examples_name_the_value(capsys) -> None:
    assert refused(capsys, [*PLAN, "--cost-f", "nan"]).endswith(
        "argument --cost-f: expected finite numbers (no nan or inf), got 'nan'"
    )
    assert refused(capsys, [*COMPARE, "--cost-comm", "nan"]).endswith(
        "argument --cost-comm: expected a finite number (no nan or inf), got 'nan'"
    )
    assert refused(capsys, [*PLAN, "--cost-w=-1"]).endswith(
        "t_w (--cost-w) must not be negative: (-1.0, -1.0, -1.0, -1.0)"
    )
    assert refused(capsys, [*COMPARE, "--memory-limit", "0"]).endswith(
        "argument --memory-limit: must be > 0 (leave it out for no limit), got 0"
    )


@pytest.mark.parametrize(
    "argv",
    [
        "plan --schedule zb-2p --pp 4 --microbatches 8 --cost-f nan",
        "compare --pp 4 --microbatches 8 --cost-b nan",
        "plan --schedule zb-1p --pp 4 --microbatches 8 --cost-comm nan",
    ],
)
def test_the_issue_hangs_end_through_the_real_command(argv: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "megatron_zb", *argv.split()], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "error: argument --cost-" in done.stderr


def _costs(tmp_path: Path, edit=None, text: str | None = None) -> str:
    """A costs file as --zero-bubble-save-costs writes it (pp=2), edited."""
    data = {
        "format": "megatron-zb costs 1",
        "unit": "ms",
        "pp": 2,
        "costs": {
            "t_f": [1.0, 1.0], "t_b": [1.0, 1.0], "t_w": [1.0, 1.0], "t_comm": 0.0,
            "mem_f": [1.0, 1.0], "mem_b": [-0.5, -0.5], "mem_w": [-0.5, -0.5],
        },
        "schedule": "zb-1p", "microbatches": 4, "chunks": 1, "memory_limit": None, "iterations": [2, 3],
    }  # fmt: skip
    if edit is not None:
        edit(data)
    path = tmp_path / "costs.json"
    path.write_text(text if text is not None else json.dumps(data))  # json writes NaN and Infinity as Python does
    return str(path)


def _set(key: str, value):
    def edit(data: dict) -> None:
        if key.startswith("costs."):
            data["costs"][key.removeprefix("costs.")] = value
        elif value is _DROP:
            del data[key]
        else:
            data[key] = value

    return edit


_DROP = object()
BAD_FILES = {
    "NaN time": (_set("costs.t_f", [math.nan, 1.0]), "t_f (--cost-f) must be finite numbers", ""),
    "infinite comm": (_set("costs.t_comm", math.inf), "t_comm (--cost-comm) must be finite numbers", ""),
    "NaN memory": (_set("costs.mem_f", math.nan), "mem_f (--mem-f) must be finite numbers", ""),
    "negative time": (_set("costs.t_b", -2), "t_b (--cost-b) must not be negative", ""),
    "huge time": (_set("costs.t_w", 1e300), "t_w (--cost-w) must be finite numbers of magnitude at most 1e+15", ""),
    "time as text": (
        _set("costs.t_f", "fast"),
        '"costs"."t_f" must be a number or a list of numbers, got \'fast\'',
        "",
    ),
    "time as true": (_set("costs.t_b", True), '"costs"."t_b" must be a number or a list of numbers, got True', ""),
    "time as object": (_set("costs.t_w", {"a": 1}), '"costs"."t_w" must be a number or a list of numbers', ""),
    "time list wrong length": (_set("costs.t_f", [1, 2, 3]), "t_f (--cost-f) has 3 values", ""),
    "missing time": (lambda data: data["costs"].pop("t_w"), "\"costs\" lacks 't_w'", ""),
    "costs a list": (_set("costs", [1, 2]), '"costs" must be an object with "t_f"', ""),
    "pp as text": (_set("pp", "two"), "\"pp\" must be a whole number >= 1, got 'two'", ""),
    "pp 0": (_set("pp", 0), '"pp" must be a whole number >= 1, got 0', ""),
    "pp 2.5": (_set("pp", 2.5), '"pp" must be a whole number >= 1, got 2.5', ""),
    "pp missing": (_set("pp", _DROP), '"pp" is missing', ""),
    "microbatches as text": (_set("microbatches", "four"), '"microbatches" must be a whole number >= 1', ""),
    "microbatches 0": (_set("microbatches", 0), '"microbatches" must be a whole number >= 1, got 0', ""),
    "microbatches 2.5": (_set("microbatches", 2.5), '"microbatches" must be a whole number >= 1, got 2.5', ""),
    "chunks as text": (_set("chunks", "x"), "\"chunks\" must be a whole number >= 1, got 'x'", ""),
    "memory limit as text": (_set("memory_limit", "big"), '"memory_limit" must be a finite number > 0 or null', ""),
    "memory limit 0": (_set("memory_limit", 0), '"memory_limit" must be a finite number > 0 or null, got 0', ""),
    "negative F memory": (_set("costs.mem_f", -1), "mem_f (--mem-f) is what F allocates and must not be negative", ""),
    "memory limit NaN": (
        _set("memory_limit", math.nan),
        '"memory_limit" must be a finite number > 0 or null, got nan',
        "",
    ),
    "iterations a number": (_set("iterations", 5), '"iterations" must be [first, last] timed iterations', ""),
    "schedule a number": (_set("schedule", 5), '"schedule" must be a schedule name or null, got 5', ""),
    "empty file": (None, "not a JSON costs file", ""),
    "truncated": (None, "not a JSON costs file", '{"format": "megatron-zb costs 1", "pp": '),
    "a JSON list": (None, "not a megatron-zb costs file", "[1, 2]"),
}


@pytest.mark.parametrize("command", ["plan", "compare"])
@pytest.mark.parametrize("edit, message, text", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_costs_files_are_refused_naming_the_file_and_field(capsys, tmp_path, command, edit, message, text):
    path = _costs(tmp_path, edit, text or ("" if edit is None else None))
    error = refused(capsys, [command, "--costs-from", path], message)
    assert f"--costs-from {path}: " in error


def test_a_good_costs_file_still_plans(capsys, tmp_path) -> None:
    code, out, err = run(capsys, ["plan", "--costs-from", _costs(tmp_path), "--format", "json"])
    assert code == 0, err
    assert (json.loads(out)["schedule"], json.loads(out)["pp"]) == ("zb-1p", 2)


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_unwritable_outputs_are_refused_before_planning(capsys, tmp_path, command: str) -> None:
    base = PLAN if command == "plan" else COMPARE
    (tmp_path / "file").write_text("keep")
    under_file = tmp_path / "file" / "out.txt"
    refused(capsys, [*base, "-o", str(under_file)], f"-o/--output {under_file} is under the file {tmp_path / 'file'}")
    refused(capsys, [*base, "-o", str(tmp_path)], f"-o/--output {tmp_path} is a folder; give a file name inside it")
    if Path("/proc/self").exists():
        refused(capsys, [*base, "-o", UNWRITABLE], f"-o/--output {UNWRITABLE}: cannot create its folder")
    assert (tmp_path / "file").read_text() == "keep"


def test_unwritable_plots_are_refused_before_comparing(capsys, tmp_path) -> None:
    (tmp_path / "file").write_text("")
    refused(capsys, [*COMPARE, "--plot", str(tmp_path / "file" / "p.svg")], "--plot", "is under the file")
    refused(capsys, [*COMPARE, "--plot", str(tmp_path / "p.pdf")], "--plot writes .svg or .png files")
    if Path("/proc/self").exists():
        refused(capsys, [*COMPARE, "--plot", "/proc/megatron-zb-test/p.svg"], "--plot", "cannot create its folder")
    (tmp_path / "plots.svg").mkdir()
    folder = tmp_path / "plots.svg"
    refused(capsys, [*COMPARE, "-o", str(tmp_path / "out.txt"), "--plot", str(folder)], f"--plot {folder} is a folder")
    assert not (tmp_path / "out.txt").exists(), "nothing is written when one output is refused"


def test_outputs_into_a_missing_folder_are_written(capsys, tmp_path) -> None:
    target = tmp_path / "new" / "deeper" / "plan.json"
    code, _, err = run(capsys, [*PLAN, "--format", "json", "-o", str(target)])
    assert code == 0, err
    assert json.loads(target.read_text())["schedule"] == "zb-2p"


def test_the_cost_model_refuses_non_finite_numbers() -> None:
    """The check at construction, for callers that are not the CLI (the runtime's measured costs, scripts)."""
    with pytest.raises(ScheduleError, match=r"t_f \(--cost-f\) must be finite numbers .*, got nan"):
        CostModel(2, t_f=(math.nan, 1.0))
    with pytest.raises(ScheduleError, match=r"t_comm \(--cost-comm\) must be finite numbers .*, got inf"):
        CostModel(2, t_comm=math.inf)
    with pytest.raises(ScheduleError, match=r"mem_b \(--mem-b\) must be finite numbers .*, got -inf"):
        CostModel(2, mem_b=-math.inf)
    with pytest.raises(ScheduleError, match="pp must be a whole number >= 1, got 0"):
        CostModel(0)


def _unchecked(costs: CostModel, **fields) -> CostModel:
    """A cost model with fields set behind the constructor's back (what the step bound is a backstop for)."""
    for name, value in fields.items():
        object.__setattr__(costs, name, value)
    return costs


@pytest.mark.parametrize("placement", [linear(4), v_shape(4)], ids=["linear", "v"])
@pytest.mark.parametrize("field", ["t_f", "t_b", "t_comm"])
def test_the_list_scheduler_refuses_non_finite_costs(placement, field: str) -> None:
    """NaN times set around the cost model's check: refused by the timing model, never a hang."""
    value = math.nan if field == "t_comm" else (math.nan,) * 4
    costs = _unchecked(CostModel(4), **{field: value})
    with deadline(), pytest.raises(ScheduleError, match="costs must be finite numbers"):
        greedy_orders(placement, costs, 8, None)


def test_the_step_bound_is_far_above_what_finite_costs_need() -> None:
    """A quarter of the bound covers every setting of a mixed grid; the bound only ever catches broken costs."""
    for placement in (linear(1), linear(4), v_shape(4), linear(8)):
        pp = placement.pp
        for costs in (
            CostModel(pp),
            CostModel(pp, t_f=(0.0,), t_b=(0.0,), t_w=(0.0,)),
            CostModel(pp, t_f=[1 + s for s in range(pp)], t_b=2.0, t_w=0.01, t_comm=3.0),
        ):
            for limit in (None, min_memory_limit(placement, costs)):
                for microbatches in (1, 5, 24):
                    greedy = _counting(placement, costs, microbatches, limit)
                    assert greedy.used < (step_bound(placement, microbatches) - 1000) / 4, (placement, costs)


def _counting(placement, costs, microbatches, limit) -> _Greedy:
    greedy = _Greedy(placement, costs, microbatches, limit, Switches())
    greedy.run()
    greedy.used = step_bound(placement, microbatches) - greedy.steps_left
    return greedy


COST_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 10),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "-0.0", "0"]),
)


@settings(max_examples=60, deadline=None)
@given(
    command=st.sampled_from(["plan", "compare"]),
    values=st.dictionaries(st.sampled_from(["--cost-f", "--cost-b", "--cost-w", "--cost-comm"]), COST_VALUES),
)
def test_any_cost_numbers_plan_or_are_refused_never_hang(command: str, values: dict) -> None:
    """Whatever the numbers, the command ends: a plan (exit 0) or one clean error (exit 2)."""
    argv = [*(PLAN if command == "plan" else COMPARE), *(f"{option}={value}" for option, value in values.items())]
    out, err = io.StringIO(), io.StringIO()
    with deadline(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as stopped:
            code = stopped.code
    assert "Traceback" not in err.getvalue()
    finite = all(math.isfinite(float(value)) and abs(float(value)) <= 1e15 for value in values.values())
    negative = any(float(value) < 0 for value in values.values())
    if finite and not negative:
        assert code == 0, (argv, err.getvalue())
    else:
        assert code == 2 and f"megatron-zb {command}: error: " in err.getvalue(), (argv, err.getvalue())
