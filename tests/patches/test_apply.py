"""patches/apply.sh patches Megatron-LM's pretrain_gpt.py all or nothing, and the patched script works.

The fixture is pretrain_gpt.py of Megatron-LM main (commit 000ab9d6) trimmed to what the patch
touches; the other layouts the patch is for are made from it by replacing those lines. The
patched script runs in-process against stand-in ``megatron.*`` modules (Megatron-LM is not
installed here) that record what pretrain() is given.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import megatron_zb
from megatron_zb.megatron.args import add_args, extra_args_provider
from megatron_zb.testing import checkouts

ROOT = Path(__file__).resolve().parents[2]
APPLY = ROOT / "patches" / "apply.sh"
FIXTURE = Path(__file__).parent / "fixtures" / "pretrain_gpt.py"

WRAP = "    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)\n"
PROVIDER = "        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,\n"
CHAINED = "extra_args_provider=megatron_zb.extra_args_provider(add_modelopt_args if has_nvidia_modelopt else None)"
STARTUP = """\
    # Timestamp right after entering __main__ block (after all imports/library setup)
    _MAIN_ENTRY_TIME = time.time()

    # Register startup timestamps for timing report in pretrain()
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=_MAIN_ENTRY_TIME)

"""


def layout(name: str) -> str:
    """pretrain_gpt.py's __main__ block as each Megatron-LM layout the patch is for writes it."""
    text = FIXTURE.read_text()
    if name in ("r0.14", "r0.15"):  # no startup timestamps; a blank line after the `if`
        text = text.replace('if __name__ == "__main__":\n' + STARTUP, 'if __name__ == "__main__":\n\n')
    if name == "r0.14":  # model_provider defined in the script itself
        text = text.replace("partial(model_provider, gpt_builder),", "model_provider,")
    if name == "main-embedding-ranks":
        ranks = "        get_embedding_ranks=get_embedding_ranks,\n"
        text = text.replace("        store=store,\n", "        store=store,\n" + ranks)
    assert text != FIXTURE.read_text() or name == "main"
    return text


PACKAGE_INFO = 'MAJOR = {}\nMINOR = {}\nPATCH = {}\nPRE_RELEASE = ""\n'


def checkout(tmp_path: Path, text: str, version: str | None = "0.16.1") -> Path:
    """A checkout with this pretrain_gpt.py and megatron/core/package_info.py saying ``version``."""
    root = tmp_path / "Megatron-LM"
    root.mkdir()
    (root / "pretrain_gpt.py").write_text(text)
    if version is not None:
        (root / "megatron" / "core").mkdir(parents=True)
        (root / "megatron" / "core" / "package_info.py").write_text(PACKAGE_INFO.format(*version.split(".")))
    return root


def apply(root: Path | None) -> subprocess.CompletedProcess:
    command = ["bash", str(APPLY)] + ([str(root)] if root is not None else [])
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["main", "r0.15", "r0.14", "main-embedding-ranks"])
def test_patch_applies_and_marks_every_line(tmp_path: Path, name: str) -> None:
    root = checkout(tmp_path, layout(name))
    before = (root / "pretrain_gpt.py").read_text().splitlines()
    done = apply(root)
    assert done.returncode == 0, done.stderr
    after = (root / "pretrain_gpt.py").read_text()
    assert "    megatron_zb.install()  # megatron-zb\n" in after
    assert "    megatron_zb.check_flags_before_init()  # megatron-zb\n" in after
    assert CHAINED in after and PROVIDER not in after
    compile(after, "pretrain_gpt.py", "exec")
    added = [line for line in after.splitlines() if line not in before]
    assert len(added) == 4 and all("# megatron-zb" in line for line in added)
    assert after.index("megatron_zb.install()") > after.index(WRAP) > after.index('if __name__ == "__main__":')
    assert sorted(path.name for path in root.iterdir()) == ["megatron", "pretrain_gpt.py"]


@pytest.mark.parametrize("name", ["main", "r0.15", "r0.14", "main-embedding-ranks"])
def test_layouts_apply_without_fuzz(tmp_path: Path, name: str) -> None:
    """As the patch header says: exact context, so plain `patch` and `git apply` take it too."""
    root = checkout(tmp_path, layout(name))
    patch = ROOT / "patches" / "megatron-lm-pretrain_gpt.patch"
    exact = ["patch", "--dry-run", "--batch", "--fuzz=0", str(root / "pretrain_gpt.py"), "-i", str(patch)]
    assert subprocess.run(exact, capture_output=True, text=True).returncode == 0
    git = subprocess.run(["git", "apply", "--check", str(patch)], cwd=root, capture_output=True, text=True)
    assert git.returncode == 0, git.stderr


def test_second_run_says_already_applied_and_changes_nothing(tmp_path: Path) -> None:
    root = checkout(tmp_path, layout("main"))
    assert apply(root).returncode == 0
    patched = (root / "pretrain_gpt.py").read_bytes()
    again = apply(root)
    assert again.returncode == 0 and "already applied" in again.stdout
    assert (root / "pretrain_gpt.py").read_bytes() == patched


def old_call(text: str) -> str:
    """core_r0.12 and older: no in-process restart, no extra_args_provider."""
    restart = "    # Optionally enable inprocess restart on pretrain\n" + WRAP + "\n"
    return text.replace(restart, "").replace(PROVIDER, "").replace("        store=store,\n", "")


def own_provider(text: str) -> str:
    """A checkout passing its own provider: hunk 1 alone would apply, so this checks all-or-nothing."""
    return text.replace(PROVIDER, "        extra_args_provider=my_args,\n")


@pytest.mark.parametrize("change, failed, kept", [(old_call, [1, 2], []), (own_provider, [2], [1])])
def test_refusal_names_the_lines_and_leaves_the_file_alone(
    tmp_path: Path, change, failed: list[int], kept: list[int]
) -> None:
    text = change(layout("main"))
    assert text != layout("main")
    root = checkout(tmp_path, text)
    done = apply(root)
    assert done.returncode == 1
    message = done.stderr
    assert f"does not apply to {root / 'pretrain_gpt.py'}" in message and "not changed" in message
    for hunk in failed:
        assert f"Hunk {hunk} found no place with these lines" in message
    for hunk in kept:
        assert f"Hunk {hunk} found" not in message
    assert PROVIDER.strip() in message  # the line hunk 2 looks for
    assert "core_v0.16.0" in message and "by hand" in message and "--megatron-lm" in message
    assert (root / "pretrain_gpt.py").read_text() == text
    assert sorted(path.name for path in root.iterdir()) == ["megatron", "pretrain_gpt.py"]


@pytest.mark.parametrize("version", ["0.16.0", "0.19.1", "0.20.0"])
def test_versions_in_the_range_are_patched(tmp_path: Path, version: str) -> None:
    assert apply(checkout(tmp_path, layout("main"), version)).returncode == 0


@pytest.mark.parametrize("version", ["0.15.1", "0.21.0", "1.0.0"])
def test_version_outside_the_range_is_refused(tmp_path: Path, version: str) -> None:
    root = checkout(tmp_path, layout("main"), version)
    done = apply(root)
    assert done.returncode == 1
    assert done.stderr.startswith(
        f"apply.sh: {root} is Megatron-LM (megatron-core) {version}; this patch is for Megatron-LM core_v0.16.0 .. "
        "core_v0.19.x and main up to 2026-08 (megatron-core 0.16.0 up to, not including, 0.21.0).\n"
    )
    assert (root / "pretrain_gpt.py").read_text() == layout("main")


def test_checkout_without_a_version_is_refused(tmp_path: Path) -> None:
    root = checkout(tmp_path, layout("main"), version=None)
    done = apply(root)
    assert done.returncode == 1 and "cannot tell the Megatron-LM version" in done.stderr
    assert (root / "pretrain_gpt.py").read_text() == layout("main")


REAL_CHECKOUTS = [
    *([os.environ["MEGATRON_LM_PATH"]] if os.environ.get("MEGATRON_LM_PATH") else []),
    *(str(path) for path in sorted(checkouts.SHARED.glob("core_v*")) if (path / "pretrain_gpt.py").is_file()),
]


@pytest.mark.skipif(not REAL_CHECKOUTS, reason="no Megatron-LM checkout: set MEGATRON_LM_PATH or have ../shared")
@pytest.mark.parametrize("real", REAL_CHECKOUTS or [None], ids=lambda path: Path(path).name if path else "none")
def test_patch_applies_to_the_real_checkout(tmp_path: Path, real: str) -> None:
    """A copy of the real pretrain_gpt.py and package_info.py (the checkout itself is left alone): every shared
    checkout (core_v0.16.1, core_v0.19.0), and MEGATRON_LM_PATH's."""
    real = Path(real)
    root = tmp_path / "Megatron-LM"
    (root / "megatron" / "core").mkdir(parents=True)
    shutil.copy(real / "pretrain_gpt.py", root / "pretrain_gpt.py")
    shutil.copy(real / "megatron" / "core" / "package_info.py", root / "megatron" / "core" / "package_info.py")
    done = apply(root)
    assert done.returncode == 0, done.stderr
    after = (root / "pretrain_gpt.py").read_text()
    assert "    megatron_zb.install()  # megatron-zb\n" in after and CHAINED in after
    compile(after, "pretrain_gpt.py", "exec")


def test_partly_patched_file_is_refused(tmp_path: Path) -> None:
    text = layout("main").replace(WRAP, WRAP + "    megatron_zb.install()  # megatron-zb\n")
    root = checkout(tmp_path, text)
    done = apply(root)
    assert done.returncode == 1 and "partly patched" in done.stderr
    assert (root / "pretrain_gpt.py").read_text() == text


def test_usage_without_a_checkout(tmp_path: Path) -> None:
    missing = apply(None)
    assert missing.returncode == 2 and "usage: bash patches/apply.sh MEGATRON_LM_DIR" in missing.stderr
    empty = apply(tmp_path)
    assert empty.returncode == 2 and f"{tmp_path / 'pretrain_gpt.py'} does not exist" in empty.stderr


def test_chained_provider_runs_theirs_then_ours() -> None:
    assert extra_args_provider(None) is add_args and extra_args_provider(add_args) is add_args

    def modelopt(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--export-kd-teacher-load")
        return parser

    parser = extra_args_provider(modelopt)(argparse.ArgumentParser())
    args = parser.parse_args(["--export-kd-teacher-load", "/ckpt", "--pipeline-schedule", "zb-h1"])
    assert args.export_kd_teacher_load == "/ckpt" and args.pipeline_schedule == "zb-h1"


SHAPE = "--pipeline-model-parallel-size 4 --num-layers 8 --micro-batch-size 1 --global-batch-size 8".split()


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> dict:
    """Stand-in megatron.training & co. for the patched script; returns what pretrain() saw."""
    seen: dict = {"installed": 0}

    def validate_args(args, defaults=None):
        args.data_parallel_size = 1
        return args

    def pretrain(datasets, model_provider, model_type, forward_step, args_defaults=None, extra_args_provider=None, **_):
        parser = argparse.ArgumentParser()
        for flag in ("--pipeline-model-parallel-size", "--num-layers", "--micro-batch-size", "--global-batch-size"):
            parser.add_argument(flag, type=int, default=1)
        args = extra_args_provider(parser).parse_args(sys.argv[1:])
        sys.modules["megatron.training.initialize"].validate_args(args, args_defaults)  # as initialize_megatron
        seen["args"] = args

    def module(name: str, **attrs) -> types.ModuleType:
        made = types.ModuleType(name)
        made.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, made)
        return made

    def install() -> None:
        seen["installed"] += 1

    def add_modelopt_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--modelopt-x")
        return parser

    initialize = module("megatron.training.initialize", validate_args=validate_args)
    restart = module("megatron.training.inprocess_restart", maybe_wrap_for_inprocess_restart=lambda p: (p, None))
    module(
        "megatron.training",
        initialize=initialize,
        inprocess_restart=restart,
        pretrain=pretrain,
        get_args=None,
        print_rank_0=print,
        set_startup_timestamps=lambda **kw: None,
    )
    module("megatron.core")
    module("megatron.core.enums", ModelType=types.SimpleNamespace(encoder_or_decoder="encoder_or_decoder"))
    module("megatron.post_training")
    module("megatron.post_training.arguments", add_modelopt_args=add_modelopt_args)
    module("gpt_builders", gpt_builder=object())
    module("model_provider", model_provider=lambda builder, pre_process=True, post_process=True: builder)
    monkeypatch.setattr(megatron_zb, "install", install)
    return seen


def run_patched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str]) -> None:
    root = checkout(tmp_path, layout("main"))
    assert apply(root).returncode == 0
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    runpy.run_path(str(root / "pretrain_gpt.py"), run_name="__main__")


def test_patched_script_installs_and_parses_both_providers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stand_in: dict
) -> None:
    run_patched(tmp_path, monkeypatch, [*SHAPE, "--enable-zero-bubble", "--modelopt-x", "1"])
    assert stand_in["installed"] == 1
    args = stand_in["args"]
    assert args.enable_zero_bubble and args.modelopt_x == "1"
    initialize = sys.modules["megatron.training.initialize"]
    checked = initialize.validate_args
    megatron_zb.check_flags_before_init()  # again: the wrapper is not wrapped twice
    assert initialize.validate_args is checked and checked.megatron_zb_checked


def test_patched_script_gives_a_v_schedule_two_chunks_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stand_in: dict
) -> None:
    """Megatron-LM's validate_args leaves no virtual stages; megatron-zb's check sets the V's two."""
    run_patched(tmp_path, monkeypatch, [*SHAPE, "--zero-bubble-v-schedule"])
    assert stand_in["args"].virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--zero-bubble-v-schedule", "--num-layers", "14", "--allow-padding-num-layers"],
            ["zb-v on Megatron-LM needs --num-layers divisible by 8", "megatron-zb train"],
        ),
        (["--zero-bubble-max-pending-backward", "4"], ["--zero-bubble-max-pending-backward needs"]),
    ],
)
def test_patched_script_refuses_bad_flags_before_pretrain_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stand_in: dict, flags: list[str], words: list[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        run_patched(tmp_path, monkeypatch, [*SHAPE, *flags])
    for word in words:
        assert word in str(refused.value)
    assert "args" not in stand_in


def test_fixture_matches_what_the_patch_expects() -> None:
    assert shutil.which("patch"), "GNU patch is needed by apply.sh"
    text = FIXTURE.read_text()
    assert text.count(WRAP) == 1 and text.count(PROVIDER) == 1
