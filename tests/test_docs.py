"""The README and docs/ as a user reads them: every shell block runs as written, every relative
link lands, every CLI flag is documented, the README's Python example prints what the README
shows, and the docs say what was measured on which hardware, not how the runs were organised.

Shell blocks (```bash fences of README.md and docs/*.md) run in order, per file, in one temporary
directory, under `bash -e -o pipefail` (so a failing line fails the block, as a broken line
continuation does). The user's default $PUNICA_CACHE is kept: the embedded model's converted
weights live there. `punica`, `python` and `curl` resolve to shims: `punica` and `python` run this
checkout's code with this interpreter, and `curl` fails on an HTTP error status (`--fail-with-body`),
so a request the docs show must be answered 2xx. A block that starts a server (`punica serve ...`)
runs in the background until /health answers, on a free port instead of the documented 8000 (the
`punica` shim appends `--port`, and blocks that talk to 127.0.0.1:8000 are pointed at it); the
blocks after it in the same file talk to it, and it is stopped (SIGTERM to its process group)
before the next server block or at the end of the file. A block meant for a GPU is written as
```text, never as a ```bash block that a test would skip.

One block is not run here: the README's Quickstart, whose first command installs punica and serves
forever, and whose second installs it and runs this suite. .ci/run runs the first as written, in a
fresh virtual environment, and the second is CI's own test command.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = DOCS / "results"
README = REPO / "README.md"
MAX_README_LINES = 150
DOCUMENTED_HOST = "127.0.0.1:8000"
BLOCK_TIMEOUT_S = 600
SERVER_START_TIMEOUT_S = 600
SERVER_STOP_TIMEOUT_S = 60
QUICKSTART_HEADING = "Quickstart"

# How runs were organised is no part of what they measured: sessions, device calls and leases of
# the machines, the machines' kind names, issue numbers, which run came first, commits as "main at".
LOGISTICS_PATTERNS = [
    r"session",
    r"device[ -]calls?",
    r"(?<![a-z])calls?[ _-]?\d",
    r"\blease\b",
    r"machine kind",
    r"nvidia-h200",
    r"issue[ _-]?#?\d+",
    r"\bagents?\b",
    r"\b(?:first|second|third) round\b",
    r"\b(?:came|ran) (?:first|last)\b",
    r"\bmerged (?:main|tree)\b",
    r"\bmain (?:at|before|after)\b",
    r"\btime bound\b",
]
LOGISTICS = re.compile("|".join(LOGISTICS_PATTERNS), re.IGNORECASE)
HEX_WORD = re.compile(r"\b[0-9a-f]{7,40}\b")  # a commit, where it has both a digit and a letter
RESULT_NAME = re.compile(r"^[a-z0-9][a-z0-9.+_-]*_\d{4}-\d{2}-\d{2}\.(?:json|txt|log)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int       # of the opening fence, 1-based
    lang: str
    text: str
    heading: str    # the nearest heading above it

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line} ({self.lang}, under {self.heading!r})"

    @property
    def starts_server(self) -> bool:
        return self.lang == "bash" and any(line.strip().startswith("punica serve") for line in self.text.splitlines())

    @property
    def talks_to_server(self) -> bool:
        return DOCUMENTED_HOST in self.text


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def fenced_blocks(path: Path) -> list[Block]:
    blocks, heading, opened, lines = [], "", None, []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = re.match(r"^```(\S*)\s*$", line)
        if opened is None:
            if fence:
                opened, lines = (number, fence.group(1)), []
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
        elif line.strip() == "```":
            blocks.append(Block(path, opened[0], opened[1], "\n".join(lines) + "\n", heading))
            opened = None
        else:
            lines.append(line)
    assert opened is None, f"{path}: the fence opened at line {opened[0]} is never closed"
    return blocks


def is_quickstart(block: Block) -> bool:
    return block.path == README and block.heading == QUICKSTART_HEADING and block.lang == "bash"


def runnable_blocks(path: Path) -> list[Block]:
    """The bash blocks of `path` that the test runs, and the python blocks that talk to a server."""
    return [b for b in fenced_blocks(path) if not is_quickstart(b)
            and (b.lang == "bash" or (b.lang == "python" and b.talks_to_server))]


def prose(path: Path) -> str:
    """`path`'s text outside fenced blocks, inline code spans replaced by a word (so that their
    brackets are not read as links)."""
    out, in_block = [], False
    for line in path.read_text().splitlines():
        if re.match(r"^```", line):
            in_block = not in_block
            continue
        if not in_block:
            out.append(re.sub(r"`[^`]*`", "code", line))
    return "\n".join(out)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of `path`'s headings: lower case, punctuation but `-` and `_` dropped,
    spaces as `-`, a repeated anchor numbered -1, -2, ..."""
    anchors, seen = set(), {}
    in_block = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_block = not in_block
        if in_block or not re.match(r"^#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def logistics_found(text: str) -> list[str]:
    found = [m.group(0) for m in LOGISTICS.finditer(text)]
    found += [w for w in HEX_WORD.findall(text) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    return found


# --- the README --------------------------------------------------------------------------------------

def test_readme_has_at_most_150_lines():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines (at most {MAX_README_LINES})"


def test_the_quickstart_is_the_one_block_not_run_and_keeps_the_shape_ci_reads():
    exempt = [b for path in doc_files() for b in fenced_blocks(path) if is_quickstart(b)]
    assert len(exempt) == 1, f"the README's Quickstart has {len(exempt)} bash blocks, CI reads exactly one"
    lines = exempt[0].text.splitlines()
    assert len(lines) == 4 and lines[0].startswith("# 1. ") and lines[2].startswith("# 2. "), lines
    assert lines[1].endswith("punica serve") and lines[3].endswith("python -m pytest -q -n 2 --dist loadgroup"), lines


@pytest.mark.slow
def test_the_readme_python_example_prints_what_the_readme_shows(tmp_path):
    blocks = fenced_blocks(README)
    [index] = [i for i, b in enumerate(blocks) if b.lang == "python" and b.heading == "Python"]
    example, shown = blocks[index], blocks[index + 1]
    assert shown.lang == "text", f"{example} must be followed by the ```text block of what it prints"
    result = subprocess.run([sys.executable, "-c", example.text], cwd=tmp_path, env=checkout_env(),
                            capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.stdout.strip() == shown.text.strip()


# --- every shell block runs -------------------------------------------------------------------------------

def test_no_shell_line_continues_past_a_comment():
    """`cmd \\   # comment` ends the command at the backslash: bash then runs the next line alone."""
    broken = [f"{b}: {line!r}" for path in doc_files() for b in fenced_blocks(path) if b.lang == "bash"
              for line in b.text.splitlines() if re.search(r"\\[ \t]+(#.*)?$", line)]
    assert not broken, broken


def checkout_env() -> dict[str, str]:
    """The environment of a doc block: this checkout's code first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def shim_dir(path: Path, port: int) -> Path:
    real_curl = shutil.which("curl")
    assert real_curl is not None, "the docs' shell blocks use curl: install it"
    path.mkdir()
    shims = {
        "punica": f'if [ "$1" = serve ]; then exec "{sys.executable}" -m punica.cli "$@" --port {port}; fi\n'
                  f'exec "{sys.executable}" -m punica.cli "$@"\n',
        "python": f'exec "{sys.executable}" "$@"\n',
        "curl": f'exec "{real_curl}" --fail-with-body "$@"\n',
    }
    for name, body in shims.items():
        (path / name).write_text("#!/bin/sh\n" + body)
        (path / name).chmod(0o755)
    return path


class DocServer:
    """A server block of the docs, run in the background in its own process group."""

    def __init__(self, block: Block, text: str, cwd: Path, env: dict[str, str], port: int):
        self.block, self.url = block, f"http://127.0.0.1:{port}"
        self.log_path = cwd / f"server-{block.line}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", text], cwd=cwd, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not self.healthy():
            assert self.proc.poll() is None, f"{block} exited with {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"{block} did not answer /health:\n{self.log()}"
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        return self.log_path.read_text()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("doc", [p.relative_to(REPO).as_posix() for p in doc_files() if runnable_blocks(p)])
def test_every_shell_block_runs_as_written(doc, tmp_path):
    port = free_port()
    env = checkout_env()
    env["PATH"] = f"{shim_dir(tmp_path / 'shims', port)}{os.pathsep}{env['PATH']}"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    server = None
    try:
        for block in runnable_blocks(REPO / doc):
            text = block.text.replace(DOCUMENTED_HOST, f"127.0.0.1:{port}")
            if block.starts_server:
                if server is not None:
                    server.stop()
                server = DocServer(block, text, cwd, env, port)
                continue
            assert not block.talks_to_server or server is not None, f"{block} talks to a server no block started"
            command = [sys.executable, "-c", text] if block.lang == "python" else ["bash", "-e", "-o", "pipefail",
                                                                                    "-c", text]
            result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                                    timeout=BLOCK_TIMEOUT_S)
            assert result.returncode == 0, (f"{block} failed ({result.returncode}):\n{text}\n"
                                            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
                                            + (f"\nserver log:\n{server.log()}" if server else ""))
    finally:
        if server is not None:
            server.stop()


# --- links, flags, result files -----------------------------------------------------------------------------

def test_every_relative_link_points_to_a_file_and_heading_that_exist():
    broken = []
    for path in doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and (linked.suffix != ".md" or anchor not in heading_anchors(linked)):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken


def test_every_cli_flag_is_documented():
    import argparse

    from punica.cli import build_parser

    [subparsers] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    docs = "\n".join(path.read_text() for path in doc_files())
    missing = sorted({f"punica {name} {flag}" for name, parser in subparsers.choices.items()
                      for action in parser._actions for flag in action.option_strings
                      if flag.startswith("--") and flag != "--help"
                      and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", docs)})
    assert not missing, f"flags the docs never name: {missing}"


def test_every_benchmark_the_docs_run_exists():
    named = {m for path in doc_files() for m in re.findall(r"python3? -m benchmarks\.([a-z_]\w*)", path.read_text())}
    assert named, "the docs name no benchmark"
    assert not sorted(m for m in named if not (REPO / "benchmarks" / f"{m}.py").is_file())


def test_every_result_file_is_named_by_what_and_when_and_linked_from_the_docs():
    docs = "\n".join(path.read_text() for path in doc_files())
    files = sorted(p.name for p in RESULTS.iterdir())
    assert files
    assert not [name for name in files if not RESULT_NAME.match(name)], "results are named WHAT_HARDWARE_DATE.ext"
    assert not [name for name in files if f"results/{name}" not in docs], "every result file is linked"


def test_the_benchmarks_open_with_a_summary_whose_every_row_links_its_results():
    text = (DOCS / "benchmarks.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    assert sections[1].startswith("Summary\n"), "docs/benchmarks.md's first section is the summary table"
    rows = [line for line in sections[1].splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert rows
    for row in rows:
        result = row.split(" | ")[1]
        assert re.search(r"\]\(results/[^)]+\)", result), f"a summary figure without its results: {row}"


# --- what the docs say about the runs ------------------------------------------------------------------------

def test_the_logistics_check_catches_what_it_is_for():
    for text in ("cuda_tests_session5_h200.txt", "in one device call", "issue24_h200_runs.json",
                 "roofline_h200_call2.json", "on the machine kind nvidia-h200-x2", "main at 2e700ed",
                 "issue 18's second round", "the long-prompt run came last", "other agents' test runs"):
        assert logistics_found(text), text
    for text in ("one NVIDIA H200, torch 2.11.0+cu130", "the idle release of a GPU", "1,000,000 requests",
                 "tool_calls", "lora_op_h200_2026-11-30.json"):
        assert not logistics_found(text), text


def test_the_docs_name_hardware_and_dates_not_the_logistics_of_runs():
    found = [f"{path.relative_to(REPO)}: {hit!r}" for path in doc_files() for hit in logistics_found(path.read_text())]
    found += [f"docs/results/{p.name}" for p in RESULTS.iterdir() if logistics_found(p.name)]
    found += [f"docs/{p.name}" for p in DOCS.iterdir() if p.is_file() and logistics_found(p.name)]
    assert not found, found
