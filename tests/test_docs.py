"""Every ```python block of README.md and docs/ runs, each alone in a fresh process, or says why it cannot.

A block runs as a script: the test's Python, the working directory a fresh temporary folder, PYTHONPATH
the repository root, TensorFlow's C++ log off; it passes on exit status 0 within the timeout. A block
that cannot run alone carries, on the line right above its fence, an HTML comment with the reason:

    <!-- not run: needs 2 processes under mpirun; tests/test_multiprocess.py runs the same -->

Such a block is reported as skipped with its reason (pytest -ra lists them all); a marker without a
reason, or one above no Python block, fails. Blocks in other languages (bash, yaml, text) are left
alone. The whole file takes minutes (a process that imports TensorFlow per block), so it is `slow`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_SECONDS = 180
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"<!--\s*not run\b:?(?P<reason>.*?)-->")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # the fence's line, from 1
    lang: str
    code: str
    marker: str | None  # the line above the fence, where it is a "not run" marker
    reason: str | None  # the marker's reason, stripped ("" where it gives none)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks_of(text: str, path: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of one Markdown file, and its problems: markers above no Python block, and
    fences left open."""
    lines = text.splitlines()
    found: list[Block] = []
    problems: list[str] = []
    used_markers: set[int] = set()
    fenced: set[int] = set()  # line numbers inside code blocks, where a marker is an example
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening["indent"], opening["fence"], opening["lang"].lower()
        closing = re.compile(rf"^ {{0,{len(indent) + 3}}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), None)
        if end is None:
            problems.append(f"{path}:{i + 1}: a code fence that is never closed")
            break
        fenced.update(range(i, end + 1))
        body = [
            line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]
        ]
        above = i - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        marker = MARKER.search(lines[above]) if above >= 0 else None
        if marker and lang == "python":
            used_markers.add(above)
        found.append(
            Block(
                path=path,
                line=i + 1,
                lang=lang,
                code="\n".join(body) + "\n",
                marker=lines[above].strip() if marker else None,
                reason=marker["reason"].strip() if marker else None,
            )
        )
        i = end + 1
    for number, line in enumerate(lines):
        if MARKER.search(line) and number not in used_markers and number not in fenced:
            problems.append(
                f"{path}:{number + 1}: a 'not run' marker that is not right above a ```python block"
            )
    return found, problems


def collect(root: Path = ROOT) -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    problems: list[str] = []
    for document in documents(root):
        found, trouble = blocks_of(document.read_text(), document.relative_to(root).as_posix())
        blocks += found
        problems += trouble
    return blocks, problems


BLOCKS, PROBLEMS = collect()
PYTHON = [block for block in BLOCKS if block.lang == "python"]
RUN = [block for block in PYTHON if block.marker is None]
NOT_RUN = [block for block in PYTHON if block.marker is not None]


def run_block(block: Block, folder: Path) -> subprocess.CompletedProcess[str]:
    script = folder / "block.py"
    script.write_text(block.code)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_SECONDS,
    )


@pytest.mark.parametrize("block", RUN, ids=[block.where for block in RUN])
def test_the_block_runs(block: Block, tmp_path: Path) -> None:
    result = run_block(block, tmp_path)
    assert result.returncode == 0, (
        f"{block.where}: exit status {result.returncode}\n--- the block\n{block.code}"
        f"--- stdout (the end)\n{result.stdout[-3000:]}\n--- stderr (the end)\n{result.stderr[-6000:]}"
    )


NONE_MARKED = pytest.param(None, id="none", marks=pytest.mark.skip(reason="no block is marked 'not run'"))


@pytest.mark.parametrize("block", NOT_RUN or [NONE_MARKED], ids=[block.where for block in NOT_RUN] or None)
def test_a_block_not_run_says_why(block: Block) -> None:
    assert block.reason, f"{block.where}: a 'not run' marker needs a reason: <!-- not run: WHY -->"
    pytest.skip(f"{block.where} not run: {block.reason}")


def test_every_marker_sits_above_a_python_block_and_every_fence_closes() -> None:
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_the_documents_hold_python_blocks() -> None:
    assert RUN, "no ```python block found: the collection is broken"
    assert any(block.path == "README.md" for block in RUN)


def test_the_collection_reads_markers_reasons_and_fences(tmp_path: Path) -> None:
    text = (
        "# t\n\n```python\nprint(1)\n```\n\n"
        "<!-- not run: needs 2 processes -->\n```python\nimport x\n```\n\n"
        "<!-- not run -->\n\n```python\nimport y\n```\n\n"
        "- a list item:\n\n  ```python\n  if True:\n      pass\n  ```\n\n"
        "```bash\nmake test\n```\n\n<!-- not run: above nothing -->\n\nText.\n"
        "```text\n<!-- not run: an example of a marker, in a code block -->\n```\n"
    )
    found, problems = blocks_of(text, "t.md")
    assert [(b.line, b.lang, b.reason) for b in found] == [
        (3, "python", None),
        (8, "python", "needs 2 processes"),
        (14, "python", ""),
        (20, "python", None),
        (25, "bash", None),
        (32, "text", None),
    ]
    assert found[3].code == "if True:\n    pass\n"
    assert problems == ["t.md:29: a 'not run' marker that is not right above a ```python block"]
    _, unclosed = blocks_of("```python\nx = 1\n", "u.md")
    assert unclosed == ["u.md:1: a code fence that is never closed"]


def module_of(path: str) -> str:
    """A module as the design page's floors table names it (`_compat/losses.py`, `comm/`) in FLOORS's
    dotted form (`_compat.losses`, `comm`)."""
    path = path.rstrip("/")
    return path.removesuffix(".py").replace("/", ".")


def test_the_design_page_shows_the_floors_of_test_layers() -> None:
    from tests.support.floors import FLOORS

    text = (ROOT / "docs" / "design.md").read_text()
    shown = {
        (int(floor), module_of(path)) for floor, path in re.findall(r"^\| (\d+) \| `([^`]+)` \|", text, re.M)
    }
    declared = {(number, module) for number, modules in enumerate(FLOORS, 1) for module in modules}
    assert shown == declared, (
        "docs/design.md's floors table and tests/test_layers.py's FLOORS differ:\n"
        f"only in the table: {sorted(shown - declared)}\nonly in FLOORS: {sorted(declared - shown)}"
    )


def test_the_keras_page_lists_every_hook_in_its_module() -> None:
    from tf_adasum import _compat

    text = (ROOT / "docs" / "keras-changes.md").read_text()
    shown = set(re.findall(r"^\| `(\w+)\.py` \| `([^`]+)` \| [^|]+ \| (yes|no) \|$", text, re.M))
    registered = {
        (hook.check.__module__.rsplit(".", 1)[1], name, "yes" if hook.required else "no")
        for name, hook in _compat.HOOKS.items()
    }
    assert shown == registered, (
        "docs/keras-changes.md's table of hooks and tf_adasum/_compat's registry differ:\n"
        f"only on the page: {sorted(shown - registered)}\nonly registered: {sorted(registered - shown)}"
    )
