"""The README and the Makefile agree with each other and with CI.

CI (.ci/run) runs `make setup`, `make build`, `make compile` and `make test`; the README's quick start
must show those commands, and the pytest command it says `make test` runs must be the Makefile's.
A bare `make` must only print help. Every `make TARGET` the docs name must exist, and every relative
link in README.md and docs/*.md must point at a file of the repository.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
README = (REPO_ROOT / "README.md").read_text()
MAKEFILE = (REPO_ROOT / "Makefile").read_text()
CI = (REPO_ROOT / ".ci" / "run").read_text()
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _quick_start() -> str:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```sh\n(.*?)```", section, re.S)
    return block


def _make_variables() -> dict[str, str]:
    return dict(re.findall(r"^([A-Z_]+) \?= (.*)$", MAKEFILE, re.M))


def _recipe(target: str) -> str:
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", MAKEFILE, re.M)
    assert match, f"no recipe for {target}"
    return match.group(1)


def _phony_targets() -> list[str]:
    return re.search(r"^\.PHONY: (.*)$", MAKEFILE, re.M).group(1).split()


def test_quick_start_creates_a_venv_then_runs_what_ci_runs():
    block = _quick_start()
    lines = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert lines[0].startswith("python -m venv .venv") and ". .venv/bin/activate" in lines[0]
    assert lines[1:] == ["make setup", "make test"]
    for command in ("make setup", "make test"):
        assert re.search(rf"^{command}\b", CI, re.M), f".ci/run does not run {command}"


def test_the_test_command_the_readme_names_is_the_makefiles():
    """README: `make test  # the CPU test suite: python -m pytest ...`; the Makefile's recipe with its
    default variables must run exactly that command."""
    [said] = re.findall(r"^make test\s+#.*?: (python -m pytest .*)$", _quick_start(), re.M)
    recipe = _recipe("test").split(";")[0].strip()
    variables = _make_variables()
    expanded = re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], recipe)
    assert expanded == said.strip()


@needs_make
def test_bare_make_prints_help_and_runs_nothing_else(tmp_path):
    dry = subprocess.run(["make", "-n", "--no-print-directory"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "pip install" not in dry.stdout and "-m pytest" not in dry.stdout, dry.stdout
    done = subprocess.run(["make", "--no-print-directory"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    listed = re.findall(r"^\s+make ([a-z-]+)\s", done.stdout, re.M)
    assert set(listed) == set(_phony_targets()), done.stdout
    assert "python -m venv .venv" in done.stdout


def test_every_make_target_the_docs_name_exists():
    targets = set(_phony_targets())
    for path in DOCS:
        named = set(re.findall(r"(?<![\w-])make ([a-z][a-z-]*)", path.read_text()))
        # prose such as "make sure", "make the cap bite" is not a target: only names that look like ours
        missing = {n for n in named if n not in targets and n in {"setup", "build", "compile", "test", "test-gpu",
                                                                   "demo", "bench", "bench-decode", "clean",
                                                                   "sass-report", "help", "install", "all",
                                                                   "check", "lint", "docs"}}
        assert not missing, f"{path.name} names make targets the Makefile lacks: {sorted(missing)}"


def test_relative_links_in_the_docs_resolve():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(REPO_ROOT)}: broken link {target}"


def test_readme_links_the_docs_that_hold_what_moved_out_of_it():
    for doc in ("docs/API_COMPAT.md", "docs/VERIFICATION.md", "docs/perf.md", "docs/DEVELOPMENT.md",
                "docs/CONTRACTS.md"):
        assert f"]({doc})" in README, doc


def test_the_kernels_symlink_points_the_way_the_docs_say():
    """README, CONTRACTS.md and pyproject.toml: the kernels are real files in
    torch-ext/flash_attn4/fa4_kernels/; the top-level fa4_kernels is a symlink to them."""
    top, inside = REPO_ROOT / "fa4_kernels", REPO_ROOT / "torch-ext" / "flash_attn4" / "fa4_kernels"
    assert top.is_symlink() and top.resolve() == inside.resolve()
    assert inside.is_dir() and not inside.is_symlink()
    assert "the top-level `fa4_kernels` symlink" in README
