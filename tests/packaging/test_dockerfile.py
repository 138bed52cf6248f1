"""The Dockerfile adds megatron-zb to NVIDIA's PyTorch image without letting pip replace what the image brings.

``docker build`` cannot run here, so this lints the file the way Docker reads it: one exact NGC
base tag, megatron-core pinned, neither torch (NVIDIA's own build) nor the package index's unrelated
``apex`` from pip, the image's pip constraints kept, this package installed from the build
context, and a .dockerignore that keeps the local CPU virtual environment out. The bad
Dockerfiles at the end show that every rule fires.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NGC_PYTORCH = re.compile(r"^nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3(@sha256:[0-9a-f]{64})?$")
# What the NGC image already holds, built against its CUDA: pip must not reinstall or upgrade these.
IMAGE_PACKAGES = {"torch", "torchvision", "torchaudio", "transformer-engine", "flash-attn"}
EXACT_VERSION = re.compile(r"^==\s*\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?$")
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")
# pip install options that take a value (so the value is not a package).
PIP_VALUE_OPTIONS = {
    "-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-f", "--find-links",
    "-t", "--target", "--prefix", "--root", "--platform", "--python-version", "--implementation", "--abi",
    "--cache-dir", "--src", "--upgrade-strategy", "--global-option", "-C", "--config-settings", "--trusted-host",
    "--no-binary", "--only-binary", "--log", "--timeout", "--retries", "--progress-bar", "--python",
}  # fmt: skip
SHELL_KEYWORDS = {"if", "then", "else", "elif", "do", "while", "until", "!", "{", "time", "sudo", "env", "exec"}
CONSTRAINT_FILE = "/etc/pip/constraint.txt"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass(frozen=True)
class PipInstall:
    """One ``pip install`` (or ``uv pip install``) inside a RUN."""

    line: int
    uv: bool
    options: tuple[str, ...]
    specs: tuple[str, ...]
    assignments: tuple[str, ...]

    def has(self, *names: str) -> bool:
        return any(option.split("=")[0] in names for option in self.options)


def instructions(text: str) -> list[Instruction]:
    """Docker's view of the file: comments dropped, backslash continuations joined."""
    found, parts, start = [], [], 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not parts and not stripped):
            continue
        start = start if parts else number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1])
            continue
        keyword, _, args = " ".join([*parts, stripped]).partition(" ")
        found.append(Instruction(keyword.upper(), args.strip(), start))
        parts = []
    return found


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a RUN line, split at ; && || | and parentheses."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: look at the words anyway
        tokens = script.split()
    commands: list[list[str]] = [[]]
    for token in tokens:
        if set(token) <= set(";&|()"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def pip_installs(instruction: Instruction) -> list[PipInstall]:
    installs = []
    for words in shell_commands(instruction.args):
        assignments = []
        while words and (words[0] in SHELL_KEYWORDS or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
            if "=" in words[0]:
                assignments.append(words[0])
            words = words[1:]
        rest, uv = _after_pip(words)
        if rest is None:
            continue
        while rest and rest[0].startswith("-"):  # pip's global options before the subcommand
            rest = rest[1:]
        if rest[:1] != ["install"]:
            continue
        options, specs, args = [], [], rest[1:]
        while args:
            word, args = args[0], args[1:]
            if word in ("-e", "--editable") and args:
                specs.append(args[0])
                args = args[1:]
            elif word.startswith("-"):
                options.append(word)
                if word in PIP_VALUE_OPTIONS and args:
                    options[-1] = f"{word}={args[0]}"
                    args = args[1:]
            else:
                specs.append(word)
        installs.append(PipInstall(instruction.line, uv, tuple(options), tuple(specs), tuple(assignments)))
    return installs


def _after_pip(words: list[str]) -> tuple[list[str] | None, bool]:
    """The words after `pip`, `pip3`, `python -m pip`, `python3 -m pip` or `uv pip`; None if not pip."""
    if not words:
        return None, False
    program = words[0].rsplit("/", 1)[-1]
    if re.fullmatch(r"pip(\d+(\.\d+)?)?", program):
        return words[1:], False
    if re.fullmatch(r"python(\d+(\.\d+)?)?", program) and words[1:3] == ["-m", "pip"]:
        return words[3:], False
    if program == "uv" and words[1:2] == ["pip"]:
        return words[2:], True
    return None, False


def requirement(spec: str) -> tuple[str | None, str]:
    """(normalised name, version part) of a requirement; name None for a path or URL."""
    if spec.startswith(("/", ".", "~", "$")) or "://" in spec or spec.endswith((".whl", ".tar.gz", ".zip")):
        return None, spec
    match = REQUIREMENT.match(spec)
    if match is None:
        return None, spec
    return match.group(1).lower().replace("_", "-"), match.group(3).strip()


def base_image_problems(found: list[Instruction]) -> list[str]:
    froms = [instruction for instruction in found if instruction.keyword == "FROM"]
    if not froms:
        return ["no FROM line: build on nvcr.io/nvidia/pytorch:<YY.MM>-py3"]
    problems, stages = [], set()
    for instruction in froms:
        words = [word for word in instruction.args.split() if not word.startswith("--")]
        image = words[0] if words else ""
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2])
        if image in stages:
            continue
        where = f"line {instruction.line}: FROM {image}"
        if "$" in image:
            problems.append(f"{where}: the base image comes from a variable; write the exact tag")
        elif ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
            problems.append(f"{where}: the base image is not pinned (no tag or `latest`); use e.g. :25.12-py3")
        elif not NGC_PYTORCH.match(image):
            problems.append(f"{where}: the base must be NVIDIA's PyTorch image, nvcr.io/nvidia/pytorch:<YY.MM>-py3")
    return problems


def pip_problems(found: list[Instruction]) -> list[str]:
    problems, megatron_core = [], []
    runs = [instruction for instruction in found if instruction.keyword == "RUN"]
    for install in (install for instruction in runs for install in pip_installs(instruction)):
        where = f"line {install.line}"
        for spec in install.specs:
            name, version = requirement(spec)
            if name == "apex":
                problems.append(
                    f"{where}: pip installs `{spec}`: the package index's apex is an unrelated package; NVIDIA apex "
                    "comes with the NGC image"
                )
            elif name in IMAGE_PACKAGES:
                problems.append(
                    f"{where}: pip installs `{spec}`, which would replace the NGC image's own build of {name}"
                )
            elif name == "megatron-core":
                megatron_core.append(spec)
                if not EXACT_VERSION.match(version):
                    problems.append(f"{where}: megatron-core is not pinned with `==` (got `{spec}`)")
        if any(option.startswith("-r") or option.startswith("--requirement") for option in install.options):
            problems.append(f"{where}: pip -r hides what it installs from this lint; list the packages instead")
        if install.uv and not install.has("--no-deps", "-c", "--constraint"):
            problems.append(f"{where}: uv pip ignores PIP_CONSTRAINT; add --no-deps or -c {CONSTRAINT_FILE}")
        if "PIP_CONSTRAINT=" in install.assignments:
            problems.append(f"{where}: PIP_CONSTRAINT is emptied, so pip may replace the image's torch")
    if not megatron_core:
        problems.append("megatron-core is never installed: add `pip install megatron-core==<version>`")
    return problems + _constraint_problems(found)


def _constraint_problems(found: list[Instruction]) -> list[str]:
    """The image's PIP_CONSTRAINT pins its torch; emptying it or deleting the file lets pip replace it."""
    problems, emptied = [], re.compile(r"\bPIP_CONSTRAINT(=(\"\"|'')?(\s|$)|\s*$)")
    for instruction in found:
        where = f"line {instruction.line}: {instruction.keyword}"
        if instruction.keyword in ("ENV", "ARG") and emptied.search(instruction.args):
            problems.append(f"{where} empties PIP_CONSTRAINT, so pip may replace the image's torch")
        if instruction.keyword == "RUN":
            for words in shell_commands(instruction.args):
                if words[0] == "unset" and "PIP_CONSTRAINT" in words:
                    problems.append(f"{where} unsets PIP_CONSTRAINT, so pip may replace the image's torch")
                if words[0] in ("rm", "truncate", "mv") and CONSTRAINT_FILE in words:
                    problems.append(f"{where} removes {CONSTRAINT_FILE}, the image's pins on its torch")
    return problems


def package_problems(found: list[Instruction]) -> list[str]:
    """`COPY . DEST` then `pip install DEST` (or `.` with WORKDIR DEST)."""
    workdir, copied, installed = "/", set(), False
    for instruction in found:
        if instruction.keyword == "WORKDIR":
            workdir = instruction.args.rstrip("/") or "/"
        elif instruction.keyword in ("COPY", "ADD"):
            args = instruction.args
            words = json.loads(args) if args.startswith("[") else [w for w in args.split() if not w.startswith("--")]
            if len(words) == 2 and words[0] in (".", "./"):
                copied.add(words[1].rstrip("/") or "/")
        elif instruction.keyword == "RUN":
            for install in pip_installs(instruction):
                for spec in install.specs:
                    path = spec.split("[", 1)[0].rstrip("/")
                    path = workdir if path in ("", ".") else path
                    installed = installed or path in copied
    if not copied:
        return ["the build context is never copied in: add `COPY . /opt/megatron-zb`"]
    if not installed:
        return [f"megatron-zb is never installed: add `pip install --no-deps {sorted(copied)[0]}`"]
    return []


def lint_dockerfile(text: str) -> list[str]:
    """Every rule's complaints about a Dockerfile; empty when it passes."""
    found = instructions(text)
    return base_image_problems(found) + pip_problems(found) + package_problems(found)


def lint_dockerignore(text: str) -> list[str]:
    """The build context leaves out .venv (a CPU torch) and keeps what `pip install` needs."""
    patterns = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]

    def excluded(path: str) -> bool:
        result = False
        for pattern in patterns:
            negate, pattern = pattern.startswith("!"), pattern.lstrip("!").strip("/").removeprefix("**/")
            if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.removesuffix("/**")):
                result = not negate
        return result

    problems = [] if excluded(".venv") else [".dockerignore does not exclude .venv (the local CPU torch)"]
    for needed in ("setup.py", "pyproject.toml", "README.md", "megatron_zb", "patches"):
        if excluded(needed):
            problems.append(f".dockerignore excludes {needed}, which installing megatron-zb needs")
    return problems


def test_dockerfile_passes_the_lint() -> None:
    problems = lint_dockerfile((ROOT / "Dockerfile").read_text())
    assert not problems, "Dockerfile:\n" + "\n".join(problems)


def test_dockerignore_passes_the_lint() -> None:
    problems = lint_dockerignore((ROOT / ".dockerignore").read_text())
    assert not problems, "\n".join(problems)


def test_dockerfile_patches_megatron_lm_with_the_shared_script() -> None:
    """The patch is applied by patches/apply.sh (its contract: non-zero exit when it does not apply)."""
    runs = " ".join(i.args for i in instructions((ROOT / "Dockerfile").read_text()) if i.keyword == "RUN")
    assert "patches/apply.sh /opt/Megatron-LM" in runs, "the Megatron-LM checkout is not patched by patches/apply.sh"


BASE = "nvcr.io/nvidia/pytorch:25.12-py3"
GOOD = f"""
FROM {BASE}
RUN python -m pip install --no-cache-dir --no-deps megatron-core==0.16.1
COPY . /opt/megatron-zb
RUN python -m pip install --no-deps /opt/megatron-zb
"""


INDEX_APEX = "the package index's apex"


def before_copy(line: str) -> tuple[str, str]:
    """(old, new) that adds `line` to the good example."""
    return "COPY .", f"{line}\nCOPY ."


# case: (text in GOOD, its replacement, what the lint must say)
BAD = {
    "unpinned base": (BASE, "nvcr.io/nvidia/pytorch:latest", "not pinned"),
    "untagged base": (BASE, "nvcr.io/nvidia/pytorch", "not pinned"),
    "base from a variable": (f"FROM {BASE}", "ARG TAG=25.12\nFROM nvcr.io/nvidia/pytorch:${TAG}-py3", "variable"),
    "another base": (BASE, "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-devel", "NVIDIA's PyTorch image"),
    "pip install apex": (*before_copy("RUN pip install apex"), INDEX_APEX),
    "pip3 install with options": (*before_copy("RUN pip3 install --no-cache-dir -U apex"), INDEX_APEX),
    "python -m pip apex": (*before_copy("RUN cd /tmp && python3 -m pip install 'apex==0.9.10dev'"), INDEX_APEX),
    "unpinned megatron-core": ("megatron-core==0.16.1", "megatron-core", "not pinned with `==`"),
    "ranged megatron-core": ("megatron-core==0.16.1", "'megatron-core>=0.16'", "not pinned with `==`"),
    "wildcard megatron-core": ("megatron-core==0.16.1", "megatron-core==0.16.*", "not pinned with `==`"),
    "no megatron-core": ("megatron-core==0.16.1", "numpy", "megatron-core is never installed"),
    "torch upgraded": ("--no-deps megatron-core", "--upgrade torch megatron-core", "own build of torch"),
    "torch pinned": (*before_copy("RUN pip install torch==2.5.1"), "own build of torch"),
    "constraint emptied": (*before_copy("ENV PIP_CONSTRAINT="), "empties PIP_CONSTRAINT"),
    "constraint inline": ("RUN python -m", "RUN PIP_CONSTRAINT= python -m", "PIP_CONSTRAINT is emptied"),
    "constraint removed": (*before_copy("RUN rm -f /etc/pip/constraint.txt"), "removes /etc/pip/constraint.txt"),
    "uv without guard": (*before_copy("RUN uv pip install --system numpy"), "uv pip ignores"),
    "package not installed": ("RUN python -m pip install --no-deps /opt/megatron-zb", "", "megatron-zb is never"),
    "context not copied": ("COPY . /opt/megatron-zb", "COPY setup.py /opt/megatron-zb/", "never copied"),
}


def test_the_good_example_passes() -> None:
    assert lint_dockerfile(GOOD) == []


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_lint_reports_a_bad_dockerfile(case: str) -> None:
    old, new, expected = BAD[case]
    assert old in GOOD, f"the case {case!r} does not change the good example"
    problems = lint_dockerfile(GOOD.replace(old, new, 1))
    assert any(expected in problem for problem in problems), f"{case}: expected {expected!r}, got {problems}"


@pytest.mark.parametrize(
    "text, expected",
    [
        (".git\nout\n", "does not exclude .venv"),
        (".venv\n!.venv\n", "does not exclude .venv"),
        (".venv\n*.md\n", "excludes README.md"),
    ],
)
def test_the_lint_reports_a_bad_dockerignore(text: str, expected: str) -> None:
    problems = lint_dockerignore(text)
    assert any(expected in problem for problem in problems), f"expected {expected!r}, got {problems}"
