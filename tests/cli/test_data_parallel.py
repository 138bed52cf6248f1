"""The data-parallel flags of plan and compare: lowering, the collectives row, the breadth-first sweep."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from megatron_zb.cli import main

SVG_NS = "{http://www.w3.org/2000/svg}"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_draws_the_collectives_row_and_costs_them(capsys):
    code, out, _ = run(capsys, "plan", "--schedule", "breadth-first-zb", "--pp", "2", "-m", "4", "--cost-dp", "1")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("rank 0 |") and lines[1].startswith("    dp |")
    assert "R0" in lines[1] and "R2" in lines[1] and "U" not in lines[1]  # reductions only, without --zero3
    code, zero3, _ = run(capsys, "plan", "--schedule", "breadth-first-zb", "--pp", "2", "-m", "4", "--cost-dp", "1",
                         "--zero3", "--format", "json")  # fmt: skip
    kinds = [entry["pass"] for entry in json.loads(zero3)["ranks"][0]]
    # chunk 0 for its forwards, chunk 1 for its forwards and Bs, chunk 0 for its Bs; the Ws need no weights
    assert code == 0 and kinds.count("UNSHARD") == 3 and kinds.count("RESHARD") == 3 and kinds.count("REDUCE_GRAD") == 2


def test_prefetch_needs_zero3_and_the_knobs_must_divide_the_microbatches(capsys):
    code, _, err = run(capsys, "plan", "--schedule", "breadth-first", "--pp", "2", "-m", "4", "--prefetch", "2")
    assert code == 2 and "--prefetch applies to the weight gathers of --zero3" in err
    code, _, err = run(capsys, "plan", "--schedule", "breadth-first", "--pp", "2", "-m", "4",
                       "--depth-first-micro-batches", "3")  # fmt: skip
    assert code == 2 and "--depth-first-micro-batches 3 must divide the microbatches (4)" in err
    code, _, err = run(capsys, "plan", "--schedule", "breadth-first", "--pp", "2", "-m", "4",
                       "--breadth-first-micro-batches", "2", "--depth-first-micro-batches", "1")  # fmt: skip
    assert code == 2 and "2 x --depth-first-micro-batches 1 = 2, not the 4 microbatches" in err


def test_sweep_shows_breadth_first_ahead_of_depth_first_at_small_batch_with_zero3(capsys, tmp_path):
    """The seed's qualitative result: with ZeRO-3 and a data-parallel cost, breadth-first beats interleaved
    1F1B (depth-first on the same placement) at small batch per GPU, and the gap closes without DP cost."""
    plot = tmp_path / "sweep.svg"
    argv = ["compare", "--pp", "4", "--chunks", "2", "--sweep", "4,8,16", "--format", "json"]
    code, out, _ = run(capsys, *argv, "--cost-dp", "2", "--zero3", "--plot", str(plot))
    assert code == 0
    found = {(p["name"], p["microbatches"]): p["efficiency"] for p in json.loads(out)["points"]}
    for m in (8, 16):
        assert found["breadth-first", m] > found["interleaved-1f1b", m] + 0.03
        assert found["breadth-first-zb", m] >= found["breadth-first", m]
    code, out, _ = run(capsys, *argv)
    free = {(p["name"], p["microbatches"]): p["efficiency"] for p in json.loads(out)["points"]}
    for m in (4, 8, 16):  # free communication: the same bubble, (p-1)/(v m) of the work
        assert abs(free["breadth-first", m] - free["interleaved-1f1b", m]) < 1e-9
        assert abs(free["breadth-first", m] - 1 / (1 + 3 / (2 * m))) < 1e-9
    lines = ET.parse(plot).getroot().findall(f"{SVG_NS}polyline")
    assert {line.get("class").split()[1] for line in lines} >= {"breadth-first", "interleaved-1f1b"}


def test_sweep_refuses_microbatches_beside_it(capsys):
    code, _, err = run(capsys, "compare", "--pp", "2", "-m", "4", "--sweep", "4,8")
    assert code == 2 and "--sweep gives the microbatch counts; drop --microbatches" in err
