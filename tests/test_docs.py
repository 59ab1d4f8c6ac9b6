"""The code blocks of README.md and docs/*.md run as written, each in a fresh interpreter in an empty folder.

An HTML comment on the line right before a fence says how its block is treated:
    <!-- not-tested: REASON -->   not run (a cluster command, `make`, a diff); the reason is required
    <!-- file: NAME -->           saved as NAME in the folders of the page's later blocks (and run if it is code)
    <!-- multi-process -->        starts worker processes: a longer timeout; `-k "not multiprocess"` skips it
```python blocks run as a script; ```bash blocks run under `bash -e` with the venv's `bin` on PATH, `.venv`
linked into the folder (so `. .venv/bin/activate` works) and `recipes/` linked too. Any other block needs
a `file:` name or a reason not to be tested.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from processes import reaped

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = ("python", "bash")
TIMEOUT_S = {False: 240, True: 360}  # generous for a loaded 2-core machine: one process; several (each imports torch)
FENCE = re.compile(r"^```(\S*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!--\s*(not-tested|file|multi-process)\s*(?::\s*(.*?))?\s*-->\s*\Z")


@dataclass
class Block:
    """One fenced code block of a page, and what its marker says about running it."""

    page: Path
    line: int
    language: str
    code: str
    not_tested: str | None = None  # the reason, when the block is not run
    file_name: str | None = None
    multi_process: bool = False

    @property
    def runs(self) -> bool:
        return self.not_tested is None and self.language in RUNNABLE

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}" + ("-multiprocess" if self.multi_process else "")


def read_blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with the marker on the line before it."""
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        block = Block(page, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2))
        marker = MARKER.search(before)
        if marker:
            kind, value = marker.group(1), (marker.group(2) or "").strip()
            if kind == "not-tested":
                block.not_tested = value
            elif kind == "file":
                block.file_name = value
            else:
                block.multi_process = True
        blocks.append(block)
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in read_blocks(page)]
RUN_BLOCKS = [block for block in ALL_BLOCKS if block.runs]


#: What a training project commonly has beside its script; each block runs beside these, so every page's code also
#: shows that the framework never imports a user's module of such a name (tests/test_name_collisions.py: recipes/).
SHADOWS = ("trainer.py", "callbacks.py")


def add_colliding_modules(folder: Path, names: tuple[str, ...] = SHADOWS) -> None:
    """The names a training project commonly has, each failing loudly if the framework imported it."""
    for name in names:
        path = folder / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"raise ImportError('the user\\'s own {name} was imported by the framework')\n")


def prepare_folder(folder: Path, block: Block) -> None:
    """The files of the page's earlier `file:` blocks, the venv and the recipes, as a user's checkout has them, beside
    a user's own trainer.py and callbacks.py."""
    add_colliding_modules(folder)
    for earlier in read_blocks(block.page):
        if earlier.line >= block.line:
            break
        if earlier.file_name:
            (folder / earlier.file_name).write_text(earlier.code)
    venv = Path(sys.prefix)
    if (venv / "bin" / "activate").is_file():
        (folder / ".venv").symlink_to(venv)
    else:  # not run from a venv: an activate script that puts this interpreter's folder on PATH
        (folder / ".venv" / "bin").mkdir(parents=True)
        (folder / ".venv" / "bin" / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    (folder / "recipes").symlink_to(REPO / "recipes")


def run_block(folder: Path, block: Block) -> subprocess.CompletedProcess:
    """Run the block in `folder`; the whole process group is killed if it outlives its timeout."""
    name = block.file_name or ("snippet.py" if block.language == "python" else "snippet.sh")
    (folder / name).write_text(block.code)
    command = [sys.executable, name] if block.language == "python" else ["bash", "-e", name]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    proc = subprocess.Popen(command, cwd=folder, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    with reaped([proc]):
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S[block.multi_process])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"{block.id} ran past {TIMEOUT_S[block.multi_process]} s:\n{output[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, output)


def check_quickstart(folder: Path, output: str) -> None:
    """The README's Python quick start wrote its run: a last.ckpt, the module's hyperparameters and its metrics
    (a row every 4 of its 24 steps, and the epoch ends'), without a warning on the way (issue 51)."""
    run = folder / "runs" / "default" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "hparams.yaml").read_text().strip() == "lr: 0.01"
    lines = (run / "metrics.csv").read_text().splitlines()
    assert lines[0].split(",") == ["step", "train/loss", "epoch"]
    assert sorted({int(line.split(",")[0]) for line in lines[1:]}) == [4, 8, 12, 16, 20, 24]
    assert "Warning" not in output and "log_every_n_steps" not in output, output


# What some blocks leave behind, checked beyond their exit code: (page, the block's `file:` name) -> check.
OUTCOMES = {("README.md", "quickstart.py"): check_quickstart}


@pytest.mark.timeout(TIMEOUT_S[True] + 30)
@pytest.mark.parametrize("block", [pytest.param(block, id=block.id, marks=() if block.multi_process else
                                                 pytest.mark.one_core) for block in RUN_BLOCKS])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    prepare_folder(tmp_path, block)
    done = run_block(tmp_path, block)
    assert done.returncode == 0, f"{block.id} ({block.language}) exited with {done.returncode}:\n{done.stdout[-4000:]}"
    check = OUTCOMES.get((block.page.name, block.file_name))
    if check is not None:
        check(tmp_path, done.stdout)


def test_every_block_runs_or_says_why_not() -> None:
    assert RUN_BLOCKS and {block.page.name for block in RUN_BLOCKS} >= {"README.md"}
    unexplained = [block.id for block in ALL_BLOCKS
                   if not block.runs and not block.file_name and not (block.not_tested or "").strip()]
    assert not unexplained, f"mark these `<!-- not-tested: REASON -->` or make them runnable: {', '.join(unexplained)}"


def test_readme_quickstart_is_short() -> None:
    quickstart = next(block for block in read_blocks(REPO / "README.md") if block.file_name == "quickstart.py")
    assert len(quickstart.code.splitlines()) <= 35


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", page.read_text())
    titles = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-") for title in titles}


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_relative_links_point_at_files_and_headings(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.is_file() and anchor not in heading_anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.name} links to what does not exist: {broken}"
