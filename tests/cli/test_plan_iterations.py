"""megatron-zb plan --iterations N [--post-validation]: the combined timeline and both periods."""

import json

from megatron_zb.cli import main

PLAN = ["plan", "--schedule", "zb-2p", "--pp", "4", "-m", "12"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_text_gives_the_period_both_ways(capsys):
    code, out, _ = run(capsys, *PLAN, "--iterations", "3", "--post-validation")
    assert code == 0
    lines = out.rstrip("\n").splitlines()
    assert lines[-2:] == [
        "iterations   3 back to back, drawn with post-validation",
        "period       per iteration: 39 with a synchronising optimizer step, 36 with post-validation (0.923x)",
    ]
    assert "schedule     zb-2p x3 (post-validation)  pp=4  microbatches=36  chunks=1" in lines
    assert "makespan     111  stage span 108" in lines  # 3 iterations of 36, rank 3 ends 3 after rank 0
    assert "W35" in lines[3]  # rank 3 draws the last iteration's microbatches


def test_without_post_validation_draws_the_synchronous_run(capsys):
    code, out, _ = run(capsys, *PLAN, "--iterations", "2")
    assert code == 0
    assert "iterations   2 back to back, drawn with a synchronising optimizer step" in out
    assert "per iteration: 39 with a synchronising optimizer step, 36 with post-validation" in out
    assert "makespan     78  stage span 75" in out  # each rank idles 3 at the step; rank 3 starts at 3


def test_json_has_the_iterations_key(capsys):
    argv = ["plan", "--schedule", "zb-h2", "--pp", "4", "-m", "8", "--cost-comm", "0.5", "--format", "json"]
    code, out, _ = run(capsys, *argv, "--iterations", "2")
    assert code == 0
    result = json.loads(out)
    assert result["iterations"] == {
        "count": 2,
        "post_validation": False,
        "period": 29,  # makespan 28.5 + one all-reduce latency
        "period_synchronous": 29,
        "period_post_validation": 27,  # the stage span
    }
    assert result["microbatches"] == 16 and all(len(rank) == 3 * 16 for rank in result["ranks"])
    code, out, _ = run(capsys, *argv, "--iterations", "2", "--post-validation")
    assert json.loads(out)["iterations"]["period"] == 27
    code, out, _ = run(capsys, *argv)
    assert "iterations" not in json.loads(out)


def test_chrome_trace_holds_every_iteration(capsys, tmp_path):
    target = tmp_path / "trace.json"
    code, out, _ = run(capsys, *PLAN, "--iterations", "2", "--format", "chrome-trace", "-o", str(target))
    assert code == 0 and out == ""
    events = json.loads(target.read_text())["traceEvents"]
    assert sum(1 for e in events if e["ph"] == "X") == 2 * 4 * 12 * 3


def test_one_iteration_is_unchanged(capsys):
    _, plain, _ = run(capsys, *PLAN)
    code, once, _ = run(capsys, *PLAN, "--iterations", "1")
    assert code == 0 and once == plain
    assert "period" not in plain


def test_post_validation_needs_two_iterations(capsys):
    for extra in ([], ["--iterations", "1"]):
        code, out, err = run(capsys, *PLAN, "--post-validation", *extra)
        assert code == 2 and out == ""
        assert err.startswith("megatron-zb plan: error: --post-validation needs --iterations N with N >= 2")


def test_post_validation_picks_auto_by_stage_span(capsys):
    """One iteration is enough for auto: the flag changes what it ranks by (zb-1p on 4 chunks by makespan,
    v-auto by span)."""
    setting = ["plan", "--schedule", "auto", "--pp", "4", "-m", "8", "--memory-limit", "5", "--format", "json"]
    setting += ["--cost-f", "1.2,1,1,1.2", "--cost-b", "1.32,1.1,1.1,1.32", "--cost-w", "0.84,0.7,0.7,0.84"]
    setting += ["--cost-comm", "0.05"]
    picked = {}
    for extra in ([], ["--post-validation"]):
        code, out, _ = run(capsys, *setting, *extra)
        assert code == 0
        picked[bool(extra)] = json.loads(out)["schedule"]
    assert picked == {False: "auto (zb-1p, 4 chunks)", True: "auto (v-auto)"}
