"""One summary of GPU suite runs: passed, failed, skipped and not run per test file and per MPS
setting, every failed and not-run test named, exit 1 when anything failed or did not run.

    python tools/gpu-summary.py RUN_DIR [RUN_DIR ...]

A RUN_DIR is what ``tools/gpu-session.sh verify`` leaves for one MPS setting
($OUT/verify-mps-on, $OUT/verify-mps-off):

- ``run.txt``: KEY=VALUE lines: ``mps``, ``device``, ``limit_s``, ``wall_s``, and ``rc_<part>``,
  the exit status of each pytest process (124 or 137: stopped at the hard time limit);
- ``collected.txt``: the node ids ``pytest --collect-only -q`` listed (what should have run);
- ``*.xml``: pytest's junit XML, one per pytest process;
- ``*.log``: pytest's ``-v`` output, read for the tests missing from the XML (a pytest process
  stopped at the hard limit writes no XML).

A test skipped because the session's deadline came ("time ran out", tests/gpu/jobs.py) counts as
not run, as does a collected test no file reports; a run in which no test passed fails too. Pure functions (parse_*, summarize, render)
over the files' text; tests/unit/test_gpu_summary.py runs them on captured pytest output.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

TIME_RAN_OUT = "time ran out"  # tests/gpu/jobs.py's TIME_RAN_OUT
OUTCOMES = ("passed", "failed", "skipped", "not run")
LOG_LINE = re.compile(
    r"^(?P<id>\S+\.py::\S+) (?P<status>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
    r"(?: \((?P<reason>.*?)\))?(?:\s+\[\s*\d+%\])?\s*$"
)
LOG_FAILED = re.compile(r"^(?:FAILED|ERROR) (?P<id>\S+\.py::\S+)(?: - (?P<message>.*))?$")
STOPPED = (124, 137)
"""Exit statuses of ``timeout``: the command ran past its limit (and was killed)."""


@dataclass(frozen=True)
class Result:
    nodeid: str
    outcome: str
    """passed, failed, skipped or not run."""
    seconds: float = 0.0
    message: str = ""

    @property
    def file(self) -> str:
        return self.nodeid.split("::", 1)[0]


@dataclass
class Run:
    """One verify run (one MPS setting): its facts and every test's result."""

    facts: dict[str, str]
    results: list[Result]
    stopped: list[str] = field(default_factory=list)
    """The pytest parts stopped at the hard time limit."""

    @property
    def mps(self) -> str:
        return self.facts.get("mps", "?")

    def count(self, outcome: str, file: str | None = None) -> int:
        return sum(1 for r in self.results if r.outcome == outcome and file in (None, r.file))


def parse_facts(text: str) -> dict[str, str]:
    """run.txt: KEY=VALUE lines (later lines win)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key:
            out[key] = value
    return out


def parse_collected(text: str) -> list[str]:
    """The node ids of ``pytest --collect-only -q`` output, in order."""
    return [ln.strip() for ln in text.splitlines() if re.match(r"^\S+\.py::\S", ln.strip())]


def _nodeid(classname: str, name: str, known: Collection[str]) -> str:
    """The node id of a junit testcase: ``tests.gpu.test_x`` + ``test_y[p]`` is
    ``tests/gpu/test_x.py::test_y[p]`` (a class in the classname is a ``::`` step; the collected
    ids say where the module ends)."""
    parts = classname.split(".")
    guesses = [
        "::".join(["/".join(parts[:k]) + ".py", *parts[k:], name]) for k in range(len(parts), 0, -1)
    ]
    return next((g for g in guesses if g in known), guesses[0])


def _first_line(text: str | None, limit: int = 400) -> str:
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def parse_junit(text: str, known: Collection[str] = ()) -> list[Result]:
    """The testcases of pytest's junit XML (``known``: collected node ids, to name them)."""
    out = []
    for case in ET.fromstring(text).iter("testcase"):
        nodeid = _nodeid(case.get("classname", ""), case.get("name", ""), known)
        seconds = float(case.get("time") or 0)
        bad = [e for e in case if e.tag in ("failure", "error")]
        skipped = case.find("skipped")
        if bad:
            message = _first_line(bad[0].get("message") or bad[0].text)
            out.append(Result(nodeid, "failed", seconds, message))
        elif skipped is not None:
            reason = skipped.get("message") or _first_line(skipped.text)
            outcome = "not run" if reason.startswith(TIME_RAN_OUT) else "skipped"
            out.append(Result(nodeid, outcome, seconds, reason))
        else:
            out.append(Result(nodeid, "passed", seconds))
    return out


def parse_log(text: str) -> tuple[list[Result], str | None]:
    """The results of pytest's ``-v`` lines, and the test that started without a result (the
    one running when the process was stopped), if any."""
    status_of = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "failed"}
    results: dict[str, Result] = {}
    messages: dict[str, str] = {}
    running = None
    for raw in text.splitlines():
        line = raw.rstrip()
        m = LOG_LINE.match(line)
        if m:
            nodeid, status, reason = m["id"], m["status"], m["reason"] or ""
            if status in ("SKIPPED", "XFAIL"):
                outcome = "not run" if reason.startswith(TIME_RAN_OUT) else "skipped"
            else:
                outcome = status_of[status]
            if results.get(nodeid, Result(nodeid, "passed")).outcome != "failed":
                results[nodeid] = Result(nodeid, outcome, 0.0, reason)
            running = None
            continue
        f = LOG_FAILED.match(line)
        if f:
            messages[f["id"]] = f["message"] or ""
            continue
        started = re.match(r"^(\S+\.py::\S+)(?: |$)", line)
        if started and " " not in line.strip():
            running = started[1]
    out = [
        Result(r.nodeid, r.outcome, r.seconds, messages.get(r.nodeid, r.message))
        for r in results.values()
    ]
    return out, running


def summarize(
    facts: dict[str, str], collected: list[str], junits: list[str], logs: list[str]
) -> Run:
    """Every collected test's result: from the junit XML, else from the ``-v`` logs, else not
    run (named as stopped where a log shows it running when its process was stopped)."""
    known = set(collected)
    found: dict[str, Result] = {}
    for text in junits:
        for r in parse_junit(text, known):
            found[r.nodeid] = r
    running = set()
    for text in logs:
        results, now = parse_log(text)
        for r in results:
            found.setdefault(r.nodeid, r)
        if now:
            running.add(now)
    stopped = [
        k[3:] for k, v in facts.items() if k.startswith("rc_") and v.isdigit() and int(v) in STOPPED
    ]
    order = collected + [n for n in found if n not in known]
    results = []
    for nodeid in order:
        if nodeid in found:
            results.append(found[nodeid])
        elif nodeid in running:
            results.append(Result(nodeid, "not run", 0.0, f"{TIME_RAN_OUT}: stopped while it ran"))
        else:
            why = f"{TIME_RAN_OUT}: its pytest was stopped" if stopped else "no result reported"
            results.append(Result(nodeid, "not run", 0.0, why))
    return Run(facts, results, stopped)


def _short(nodeid: str) -> str:
    return nodeid.removeprefix("tests/gpu/")


def render(runs: list[Run]) -> str:
    """A table per run (files x outcomes), the failed and not-run tests by name, the skip
    reasons, and one verdict line."""
    lines = []
    for run in runs:
        f = run.facts
        head = f"== GPU suite, MPS {run.mps}"
        if f.get("device"):
            head += f", {f['device']}"
        if f.get("wall_s"):
            head += f": {f['wall_s']} s"
            head += f" of {f['limit_s']} s" if f.get("limit_s") else ""
        lines += [
            head,
            f"{'file':<28}{'passed':>8}{'failed':>8}{'skipped':>9}{'not run':>9}{'test s':>9}",
        ]
        files = list(dict.fromkeys(r.file for r in run.results))
        for file in [*files, None]:
            mine = [r for r in run.results if file in (None, r.file)]
            counts = [run.count(o, file) for o in OUTCOMES]
            secs = sum(r.seconds for r in mine)
            label = "all" if file is None else _short(file)
            lines.append(
                f"{label:<28}{counts[0]:>8}{counts[1]:>8}{counts[2]:>9}{counts[3]:>9}{secs:>9.1f}"
            )
        for r in run.results:
            if r.outcome in ("failed", "not run"):
                word = "FAILED" if r.outcome == "failed" else "NOT RUN"
                lines.append(f"{word} (MPS {run.mps}) {_short(r.nodeid)}: {r.message}")
        if not run.count("passed"):
            lines.append(f"NOTHING PASSED (MPS {run.mps}): no test ran to a pass (no GPU seen?)")
        if run.stopped:
            lines.append(
                f"STOPPED at the hard time limit (MPS {run.mps}): {', '.join(run.stopped)}"
            )
        reasons = Counter(r.message for r in run.results if r.outcome == "skipped")
        for reason, n in reasons.most_common():
            lines.append(f"skipped (MPS {run.mps}) x{n}: {reason}")
        lines.append("")
    lines.append(verdict(runs))
    return "\n".join(lines)


def verdict(runs: list[Run]) -> str:
    parts = [f"MPS {r.mps}: " + ", ".join(f"{r.count(o)} {o}" for o in OUTCOMES) for r in runs]
    word = "PASSED" if ok(runs) else "FAILED"
    return f"== verdict: {word} ({'; '.join(parts) or 'no runs'})"


def ok(runs: list[Run]) -> bool:
    """Every run passed tests (a run that skipped everything checked nothing: no GPU seen?), and
    none failed or did not run."""
    return bool(runs) and all(
        r.count("passed") and not r.count("failed") and not r.count("not run") and not r.stopped
        for r in runs
    )


def load(folder: Path) -> Run:
    """A run's files (see the module docstring)."""

    def read(path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""

    facts = parse_facts(read(folder / "run.txt"))
    facts.setdefault("mps", folder.name.rsplit("-", 1)[-1])
    collected = parse_collected(read(folder / "collected.txt"))
    junits = [read(p) for p in sorted(folder.glob("*.xml"))]
    logs = [read(p) for p in sorted(folder.glob("*.log"))]
    return summarize(facts, collected, [j for j in junits if j.strip()], logs)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    runs = []
    for arg in argv:
        folder = Path(arg)
        if not folder.is_dir():
            print(f"gpu-summary: {arg!r} is not a folder of a verify run (run.txt, *.xml, *.log)")
            return 2
        runs.append(load(folder))
    print(render(runs))
    return 0 if ok(runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
