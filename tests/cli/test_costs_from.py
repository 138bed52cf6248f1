"""``megatron-zb plan/compare --costs-from FILE``: a training run's measured costs, studied offline."""

import json

import pytest

from megatron_zb.cli import main
from megatron_zb.schedule import CostModel, ScheduleSpec, build, simulate
from megatron_zb.schedule.costs_file import MeasuredCosts, save_costs

# pp=4, stage 1 three times as heavy (an extra layer block), in ms as training writes them.
COSTS = CostModel(4, t_f=(2.0, 6.0, 2.0, 2.5), t_b=(2.2, 6.6, 2.2, 2.6), t_w=(1.5, 4.5, 1.5, 1.6), t_comm=0.1)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "costs.json"
    save_costs(path, MeasuredCosts(COSTS, schedule="zb-1p", microbatches=8, chunks=1, iterations=(2, 3)))
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_defaults_to_the_runs_setting(capsys, saved):
    code, out, _ = run(capsys, "plan", "--costs-from", saved, "--format", "json")
    assert code == 0, out
    result = json.loads(out)
    assert (result["schedule"], result["pp"], result["microbatches"]) == ("zb-1p", 4, 8)
    expected = simulate(build("zb-1p", ScheduleSpec(4, 8, None, COSTS)), COSTS)
    assert result["makespan"] == pytest.approx(expected.makespan)
    # Planned with the measured costs, not unit costs: the heavy stage's F lasts 6 ms.
    heavy = [p for p in result["ranks"][1] if p["pass"] == "F"]
    assert all(p["end"] - p["start"] == pytest.approx(6.0) for p in heavy)


def test_other_schedule_microbatches_and_limit_on_the_same_costs(capsys, saved):
    code, out, _ = run(
        capsys, "plan", "--costs-from", saved, "--schedule", "zb-auto", "-m", "16", "--memory-limit", "6", "--format",
        "json",
    )  # fmt: skip
    assert code == 0, out
    result = json.loads(out)
    assert (result["schedule"], result["microbatches"]) == ("zb-auto", 16)
    assert max(result["peak_memory"]) <= 6


def test_compare_ranks_every_schedule_under_the_measured_costs(capsys, saved):
    code, out, _ = run(capsys, "compare", "--costs-from", saved, "--format", "json")
    assert code == 0, out
    rows = {row["schedule"]: row for row in json.loads(out)["rows"]}
    one_f_one_b = simulate(build("1f1b", ScheduleSpec(4, 8, None, COSTS)), COSTS)
    assert rows["1f1b"]["makespan"] == pytest.approx(one_f_one_b.makespan)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--cost-f", "1"], "--cost-f and --costs-from"),
        (["--pp", "8"], "--pp 8: --costs-from"),
    ],
)
def test_refuses_mixing_with_other_times_or_another_pp(capsys, saved, extra, message):
    code, _, err = run(capsys, "plan", "--costs-from", saved, *extra)
    assert code == 2
    assert err.startswith("megatron-zb plan: error: ") and message in err


def test_refuses_a_file_that_is_not_ours(capsys, tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"t_f": 1}')
    code, _, err = run(capsys, "plan", "--costs-from", str(other))
    assert code == 2 and "not a megatron-zb costs file" in err and "--zero-bubble-save-costs" in err
    code, _, err = run(capsys, "plan", "--costs-from", str(tmp_path / "missing.json"))
    assert code == 2 and "no such file" in err


def test_without_a_file_pp_and_microbatches_are_required(capsys):
    code, _, err = run(capsys, "plan", "--schedule", "1f1b", "--pp", "4")
    assert code == 2 and "give --microbatches (or --costs-from FILE" in err
    code, _, err = run(capsys, "plan", "--pp", "4", "-m", "4")
    assert code == 2 and "give --schedule NAME" in err
