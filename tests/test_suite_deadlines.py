"""The test suite checks itself: no test can block without a deadline, and none waits for state with a
fixed sleep. A suite that hangs stops CI at its time limit, and a fixed sleep is a race that a loaded
machine loses (issue 28: `gpud watch` started after a 0.5 s sleep missed its event and read forever).

The rules, read from every test module's syntax tree:
- a child's output stream (`.stdout`/`.stderr`) is never read directly: helpers.Lines reads it with a
  deadline (an asyncio stream may be, inside asyncio.wait_for or gpud.base.loops.within);
- every wait for a process, a thread, an event or a queue passes a timeout (`wait(10)`, `join(5)`), or
  stands inside asyncio.wait_for or within;
- subprocess.run and its kin pass timeout=, and so do urlopen and communicate;
- a sleep outside a loop is not a wait for state: it says `# fixed time: why` on its line, the time
  itself being what the test is about; a sleep inside a loop is a poll interval, and the loop is bounded
  (a `for`, or a `while` whose test or body reads a deadline or the clock).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

TESTS = sorted((REPO / "tests").glob("*.py"))
BLOCKING_WITHOUT_ARGUMENTS = {"wait", "join", "get", "acquire", "communicate"}
STREAM_READS = {"read", "readline", "readlines", "read1"}
NEEDS_TIMEOUT_KEYWORD = {("subprocess", "run"), ("subprocess", "check_output"), ("subprocess", "check_call"),
                         ("subprocess", "call"), ("request", "urlopen"), ("urllib.request", "urlopen")}
FIXED_TIME_NOTE = "# fixed time:"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


class _Checker(ast.NodeVisitor):
    def __init__(self, path: Path):
        self.path = path
        self.lines = path.read_text().splitlines()
        self.problems: list[str] = []
        self._loops: list[ast.AST] = []
        self._inside_wait_for = 0

    def _problem(self, node: ast.AST, message: str) -> None:
        label = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path.name
        self.problems.append(f"{label}:{node.lineno}: {message}: "
                             f"{self.lines[node.lineno - 1].strip()}")

    def _visit_loop(self, node: ast.AST) -> None:
        self._loops.append(node)
        self.generic_visit(node)
        self._loops.pop()

    visit_For = visit_AsyncFor = visit_While = _visit_loop

    def _visit_function(self, node: ast.AST) -> None:
        loops, self._loops = self._loops, []  # a function defined in a loop is not itself polled
        self.generic_visit(node)
        self._loops = loops

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        if name.endswith("wait_for") or name == "within":  # (awaitable, timeout): its awaitable has a deadline
            self._inside_wait_for += 1
            self.generic_visit(node)
            self._inside_wait_for -= 1
            return
        if isinstance(node.func, ast.Attribute):
            self._check_method(node, node.func)
        if tuple(name.rsplit(".", 1)) in NEEDS_TIMEOUT_KEYWORD and not _has_keyword(node, "timeout"):
            self._problem(node, f"{name} without timeout=")
        if name in ("time.sleep", "asyncio.sleep"):
            self._check_sleep(node)
        self.generic_visit(node)

    def _check_method(self, node: ast.Call, func: ast.Attribute) -> None:
        if self._inside_wait_for:
            return
        if func.attr in BLOCKING_WITHOUT_ARGUMENTS and not node.args and not node.keywords:
            self._problem(node, f".{func.attr}() without a timeout")
        receiver = func.value
        if func.attr in STREAM_READS and isinstance(receiver, ast.Attribute) and receiver.attr in ("stdout", "stderr"):
            self._problem(node, f"a child's {receiver.attr} read without a deadline (helpers.Lines)")

    def _check_sleep(self, node: ast.Call) -> None:
        if node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0:
            return  # asyncio.sleep(0): a yield to the event loop, not a wait
        if FIXED_TIME_NOTE in self.lines[node.lineno - 1]:
            return
        if not self._loops:
            self._problem(node, f"a sleep that is not a poll interval says '{FIXED_TIME_NOTE} why'")
        elif isinstance(self._loops[-1], ast.While) and not _reads_a_deadline(self._loops[-1]):
            self._problem(node, "a polling while-loop without a deadline")


def _has_keyword(node: ast.Call, keyword: str) -> bool:
    return any(k.arg == keyword for k in node.keywords)


def _reads_a_deadline(loop: ast.While) -> bool:
    for node in ast.walk(loop):
        if isinstance(node, ast.Name) and "deadline" in node.id:
            return True
        if isinstance(node, ast.Call) and _dotted(node.func) in ("time.monotonic", "time.perf_counter"):
            return True
    return False


def problems_in(path: Path) -> list[str]:
    checker = _Checker(path)
    checker.visit(ast.parse(path.read_text(), str(path)))
    return checker.problems


@pytest.mark.parametrize("path", TESTS, ids=lambda path: path.name)
def test_every_wait_has_a_deadline(path):
    problems = problems_in(path)
    assert not problems, "\n".join(problems)


def test_the_check_finds_what_it_looks_for(tmp_path):
    # Guards the checker itself: each rule catches its case, and each allowed form passes.
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import asyncio, subprocess, time\n"
        "def f(proc, thread, event):\n"
        "    proc.stdout.readline()\n"            # 3
        "    proc.wait()\n"                       # 4
        "    thread.join()\n"                     # 5
        "    subprocess.run(['true'])\n"          # 6
        "    time.sleep(0.5)\n"                   # 7
        "    while True:\n"
        "        time.sleep(0.1)\n"               # 9
        "async def g(queue):\n"
        "    await queue.get()\n"                 # 11
        "    await asyncio.sleep(0.2)\n"          # 12
    )
    found = [int(line.split(":")[1]) for line in problems_in(bad)]
    assert found == [3, 4, 5, 6, 7, 9, 11, 12]
    good = tmp_path / "good.py"
    good.write_text(
        "import asyncio, subprocess, time\n"
        "def f(proc, thread, items):\n"
        "    proc.wait(10); thread.join(5)\n"
        "    subprocess.run(['true'], timeout=10)\n"
        "    time.sleep(1.0)  # fixed time: the CPU it uses in a second is what is measured\n"
        "    for _ in range(10):\n"
        "        time.sleep(0.1)\n"
        "    deadline = time.monotonic() + 5\n"
        "    while items:\n"
        "        assert time.monotonic() < deadline\n"
        "        time.sleep(0.1)\n"
        "async def g(proc):\n"
        "    await asyncio.wait_for(proc.stdout.readline(), 5)\n"
        "    await asyncio.wait_for(proc.wait(), 5)\n"
        "    await asyncio.sleep(0)\n"
    )
    assert problems_in(good) == []



# -- the limits themselves: pytest run on tests that hang, with this suite's conftest ---------------

HANGS_ON_A_CHILD = """
import subprocess, sys

def test_reads_a_child_that_never_writes():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
    finally:
        child.kill()
        child.wait(10)

def test_after_it():
    pass
"""

BLOCKS_THE_ALARM = """
import signal, time

def test_blocks_the_alarm():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(120)

def test_after_it():
    pass
"""


def pytest_on(tmp_path: Path, source: str, limit_s: int) -> subprocess.CompletedProcess:
    """pytest with two xdist workers on one test file, tests/conftest.py loaded as a plugin, and a
    per-test limit of limit_s seconds."""
    (tmp_path / "test_hangs.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-n", "2",
                           "--rootdir", str(tmp_path), "-o", f"timeout={limit_s}", "test_hangs.py"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO / "tests"), "COLUMNS": "200"},
                          capture_output=True, text=True, timeout=180)


def test_a_hang_fails_naming_the_test_and_the_line_it_was_stuck_on(tmp_path):
    result = pytest_on(tmp_path, HANGS_ON_A_CHILD, 2)
    assert "FAILED test_hangs.py::test_reads_a_child_that_never_writes - Failed: Timeout (>2.0s) from pytest-timeout" \
        in result.stdout, result.stdout + result.stderr
    assert ">           child.stdout.readline()" in result.stdout  # where it was stuck
    assert "1 failed, 1 passed" in result.stdout and result.returncode == 1


@pytest.mark.slow
def test_a_hang_the_alarm_cannot_break_is_dumped_and_its_worker_ended(tmp_path):
    from conftest import LAST_RESORT_AFTER_S
    result = pytest_on(tmp_path, BLOCKS_THE_ALARM, 1)
    output = result.stdout + result.stderr
    assert "crashed while running 'test_hangs.py::test_blocks_the_alarm'" in output, output
    assert f"Timeout (0:00:{1 + LAST_RESORT_AFTER_S:02d})!" in output  # faulthandler, on the real stderr
    assert f'File "{tmp_path / "test_hangs.py"}", line 6 in test_blocks_the_alarm' in output
    assert "1 failed, 1 passed" in result.stdout
