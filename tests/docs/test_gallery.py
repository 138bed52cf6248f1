"""docs/gallery.md and docs/gallery/*.svg are what scripts/gen_gallery.py writes, for every schedule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_zb.cli import main
from megatron_zb.schedule.registry import ScheduleSpec, build, names
from megatron_zb.schedule.simulate import simulate
from megatron_zb.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REGENERATE = "python scripts/gen_gallery.py"


gen = load_script("gen_gallery")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """The gallery regenerated into a temporary docs folder."""
    docs = tmp_path_factory.mktemp("docs")
    gen.write(docs)
    return docs


def test_gallery_page_is_up_to_date(fresh):
    current = (DOCS / "gallery.md").read_text(encoding="utf-8")
    assert current == (fresh / "gallery.md").read_text(encoding="utf-8"), (
        f"docs/gallery.md is out of date; regenerate with `{REGENERATE}`"
    )


def test_gallery_pictures_are_up_to_date(fresh):
    committed = {path.name for path in (DOCS / "gallery").glob("*.svg")}
    generated = {path.name for path in (fresh / "gallery").glob("*.svg")}
    assert committed == generated, f"docs/gallery/ has other files than the generator writes; run `{REGENERATE}`"
    stale = [
        name
        for name in sorted(generated)
        if (DOCS / "gallery" / name).read_bytes() != (fresh / "gallery" / name).read_bytes()
    ]
    assert not stale, f"out of date: {stale}; regenerate with `{REGENERATE}`"


def test_every_registered_schedule_is_in_the_gallery():
    page = (DOCS / "gallery.md").read_text(encoding="utf-8")
    for name in names():
        assert (DOCS / "gallery" / f"{name}.svg").is_file(), name
        assert f"### {name}\n" in page, name
        assert f"![{name}](gallery/{name}.svg)" in page, name


def summary_rows() -> dict[str, list[str]]:
    """The cells of the summary table of docs/gallery.md, by schedule name."""
    rows = {}
    for line in (DOCS / "gallery.md").read_text(encoding="utf-8").splitlines():
        found = re.match(r"\| \[`([^`]+)`\]\(#[^)]+\) \|(.*)\|$", line)
        if found:
            rows[found.group(1)] = [cell.strip() for cell in found.group(2).split("|")]
    return rows


def test_gallery_numbers_match_the_simulator():
    rows = summary_rows()
    assert set(rows) == set(names())
    for name, (chunks, limit, makespan, bubble, bubble_ms, peak) in rows.items():
        memory_limit = None if limit == "none" else float(limit)
        assert memory_limit == gen.LIMITS.get(name), name
        spec = ScheduleSpec(gen.PP, gen.MICROBATCHES, memory_limit=memory_limit)
        timeline = simulate(build(name, spec), spec.cost_model())
        assert int(chunks) == timeline.schedule.chunks, name
        assert float(makespan) == pytest.approx(timeline.makespan), name
        assert bubble == f"{timeline.bubble_rate:.2%}", name
        assert bubble_ms == f"{timeline.bubble_rate_makespan:.2%}", name
        assert float(peak) == pytest.approx(max(timeline.peak_memory)), name


def test_gallery_svg_is_what_the_cli_draws(tmp_path):
    out = tmp_path / "zb-h1.svg"
    assert main([*gen.plan_argv("zb-h1"), "--format", "svg", "-o", str(out)]) == 0
    assert out.read_bytes() == (DOCS / "gallery" / "zb-h1.svg").read_bytes()


def code_block_after(text: str, first_line: str) -> str:
    """The rest of the code block whose first line is ``first_line``."""
    start = text.index(first_line + "\n") + len(first_line) + 1
    return text[start : text.index("```", start)]


def test_user_guide_quotes_the_real_compare_table():
    prompt = f"$ megatron-zb compare {' '.join(gen.PARETO)} --plot"
    gallery = (DOCS / "gallery.md").read_text(encoding="utf-8")
    guide = (DOCS / "user-guide.md").read_text(encoding="utf-8")
    line = next(line for line in gallery.splitlines() if line.startswith(prompt))
    guide_line = next(line for line in guide.splitlines() if line.startswith(prompt))
    assert code_block_after(guide, guide_line) == code_block_after(gallery, line), (
        f"the compare table in docs/user-guide.md differs from docs/gallery.md (run `{REGENERATE}` and copy it)"
    )


# -- the decision table of docs/user-guide.md: flags -> schedule -> simulated numbers ----------
DECISION_SETTING = dict(pipeline_model_parallel_size=8, num_layers=16, micro_batch_size=1, global_batch_size=24)


def decision_rows() -> list[list[str]]:
    text = (DOCS / "user-guide.md").read_text(encoding="utf-8")
    section = text[text.index("### Decision table") : text.index("## Re-planning")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| memory")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_user_guide_decision_table_matches_flags_and_simulator():
    import argparse
    import shlex

    from megatron_zb import add_args
    from megatron_zb.megatron.args import schedule_settings

    rows = decision_rows()
    assert len(rows) >= 8
    for budget, schedule, flags, peak, bubble, bubble_ms in rows:
        name = schedule.strip("`")
        found = re.fullmatch(r"`([^`]*)`", flags)
        parser = add_args(argparse.ArgumentParser())
        parser.add_argument("--virtual-pipeline-model-parallel-size", type=int)  # Megatron-LM's own flag
        args = parser.parse_args(shlex.split(found.group(1)) if found else [])
        vars(args).update(DECISION_SETTING, data_parallel_size=1)
        settings = schedule_settings(args)
        chosen = settings.schedule if settings is not None else "1f1b"  # no flags: megatron-core's 1F1B
        assert chosen == name, f"{flags} selects {chosen}, the guide says {name}"
        limit = settings.memory_limit if settings is not None else None
        chunks = settings.chunks if settings is not None else None
        spec = ScheduleSpec(8, 24, chunks, memory_limit=limit)
        timeline = simulate(build(name, spec), spec.cost_model())
        row = f"{name} ({budget})"
        assert float(peak) == pytest.approx(max(timeline.peak_memory)), row
        assert bubble == f"{timeline.bubble_rate:.2%}", row
        assert bubble_ms == f"{timeline.bubble_rate_makespan:.2%}", row
        if budget[0].isdigit():
            assert max(timeline.peak_memory) <= float(budget.split()[0].rstrip(",")) + 1e-9, row


# -- pages that copy numbers or list pages ---------------------------------------------------
def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_benchmarks_page_copies_its_sources():
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    checked = 0
    for title, body in sections(page).items():
        source = re.search(r"^Source: \[[^]]+\]\(([^)#]+)", body, flags=re.M)
        if source is None:
            continue
        source_text = (DOCS / source.group(1)).resolve().read_text(encoding="utf-8")
        rows = [line for line in body.splitlines() if line.startswith("|") and not line.startswith("|---")]
        for row in rows:
            if source.group(1).startswith("bench_"):
                assert row in source_text.splitlines(), f"{title}: row not in {source.group(1)}: {row}"
            for number in re.findall(r"\d+(?:\.\d+)?%?", row):
                assert number in source_text, f"{title}: {number} not in {source.group(1)}"
            checked += 1
    assert checked > 20


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    pages = sorted(path.name for path in DOCS.glob("*.md") if path.name != "README.md")
    missing = [name for name in pages if f"]({name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"
