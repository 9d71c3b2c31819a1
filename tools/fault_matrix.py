"""The fault matrix: every fault x launcher x API, each cell a real job.

    python tools/fault_matrix.py                 # all 48 cells, a Markdown table on stdout
    python tools/fault_matrix.py --json out.json --cells skip,exit0 --ranks 3

Faults (rank 1 injects it at the 4th of a loop of collectives): ``raise`` an exception,
``exit3`` (sys.exit(3)), ``exit0`` (sys.exit(0) in the middle of the loop), ``sigkill``,
``skip`` (skips a collective, then works on for a minute), ``mismatch`` (its
CUDAMPI_CHUNK_BYTES differs from the others'). Two faults are of the job's environment, on
every rank: ``badsetting`` (CUDAMPI_CHUNK_BYTES=inf) and ``badcache`` (a capabilities cache of
'[' * 200000). Launchers: ``cudampi launch`` and plain
``mpiexec`` (the Open MPI wheel beside this python), ``torchrun`` (with the MPICH wheel's
libmpi, which cudampi's PMI server joins). APIs: ``comm`` (a cudampi Communicator,
CUDAMPI_TIMEOUT=5) and ``torch`` (the cudampi backend, init_process_group(timeout=5 s)).

A cell passes when the job ends non-zero within its limit (90 s), the fault is named (rank 1
and what it did, by the launcher or by the ranks that waited for it), and no process of the
job is left 2 s afterwards (its launcher, its ranks, the PMI server: every process that carries
the cell's mark in its environment; those are then killed). Every other rank must have ended
with an error of its own or been ended by the launcher; the table says which. A ``badcache``
cell passes the other way round: the cache is named (a warning) and the job runs to its end,
exit 0, every rank through its loop.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("raise", "exit3", "exit0", "sigkill", "skip", "mismatch", "badsetting", "badcache")
LOOP_FAULTS = FAULTS[:6]
"""Rank 1 injects these at the 4th collective of its loop."""
JOB_FAULTS = {
    "badsetting": "every rank has CUDAMPI_CHUNK_BYTES=inf",
    "badcache": "every rank's capabilities cache is '[' * 200000",
}
"""Faults of the job's environment rather than of rank 1: a bad setting must end the job with
the setting named; a corrupt cache must be named and cost nothing else (the job runs to its
end, exit 0)."""
LAUNCHERS = ("cudampi-launch", "mpiexec", "torchrun")
APIS = ("comm", "torch")
LIMIT = 90.0
TIMEOUT = 5

TARGET = r'''
"""One rank of a fault-matrix cell: a loop of collectives; rank 1 injects the fault."""
import os, signal, sys, time

fault, api = sys.argv[1], sys.argv[2]
rank_env = next((os.environ[v] for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
                 if v in os.environ), "0")
if fault == "mismatch" and rank_env == "1":
    os.environ["CUDAMPI_CHUNK_BYTES"] = "64K"


def say(what):
    print(f"FAULT-MATRIX rank {rank} {what}", flush=True)


rank = int(rank_env)
try:
    if api == "torch":
        from datetime import timedelta
        import torch, torch.distributed as dist
        import cudampi.torch
        dist.init_process_group("cudampi", timeout=timedelta(seconds=TIMEOUT))
        rank = dist.get_rank()
        t = torch.ones(1024)
        def step():
            dist.all_reduce(t)
    else:
        import numpy as np
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun: torch's group joins MPI first
            import torch.distributed as dist
            import cudampi.torch
            dist.init_process_group("cudampi")
        from mpi4py import MPI
        from cudampi.comm import Communicator
        comm = MPI.COMM_WORLD
        rank = comm.rank
        c = Communicator(comm)
        x = np.ones(1024)
        def step():
            c.allreduce(x, out=x)
    for i in range(40):
        if rank == 1 and i == 3 and fault in LOOP_FAULTS:
            say(f"injects {fault}")
            if fault == "raise":
                raise ValueError("planted failure on rank 1")
            if fault == "exit3":
                sys.exit(3)
            if fault == "exit0":
                sys.exit(0)
            if fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "skip":
                time.sleep(60)
                sys.exit(0)
        step()
        time.sleep(0.02)
    say("finished the loop")
except SystemExit:
    raise
except BaseException as exc:
    say(f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    raise
'''.replace("TIMEOUT", str(TIMEOUT)).replace("LOOP_FAULTS", repr(LOOP_FAULTS))


@dataclass
class Cell:
    fault: str
    launcher: str
    api: str
    exit_code: int | None = None
    seconds: float = 0.0
    raised: list[int] = field(default_factory=list)
    """Ranks that printed an error of their own."""
    watched: list[int] = field(default_factory=list)
    """Ranks ended by the PMI watch (torchrun) with a message naming the failed rank."""
    ranks: int = 0
    message: str = ""
    """The first line that names the fault (from a rank or the launcher)."""
    finished: list[int] = field(default_factory=list)
    """Ranks that ran their loop to the end."""
    leftovers: list[str] = field(default_factory=list)
    ok: bool = False
    why: str = ""


def mpich_lib(python: str | None) -> Path | None:
    venv = Path(python).parent.parent if python else ROOT / ".venv-mpich"
    lib = venv / "lib" / "libmpi.so.12"
    return lib if lib.exists() else None


def _env(launcher: str, mpich: Path | None, api: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC"))
        and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "MPI4PY_LIBMPI")
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_mpi_yield_when_idle="1",
        PRTE_MCA_prte_silence_shared_fs="1",
        GLOO_SOCKET_IFNAME="lo",
    )
    if api == "comm":
        env["CUDAMPI_TIMEOUT"] = str(TIMEOUT)
    if launcher == "torchrun" and mpich is not None:
        env["MPI4PY_LIBMPI"] = str(mpich)
    return env


def _argv(launcher: str, ranks: int, script: Path, fault: str, api: str) -> list[str]:
    py = sys.executable
    if launcher == "cudampi-launch":
        return [py, "-m", "cudampi", "launch", "-n", str(ranks), str(script), fault, api]
    if launcher == "mpiexec":
        mpiexec = str(Path(py).parent / "mpiexec")
        return [mpiexec, "-n", str(ranks), "--oversubscribe", "--bind-to", "none", py,
                str(script), fault, api]  # fmt: skip
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            str(script), fault, api]  # fmt: skip


MARK = "CUDAMPI_TEST_FAULT_MATRIX_CELL"
"""Set in a cell's launcher environment: every process of the job inherits it (the launcher,
its ranks, rank 0's PMI server), and nothing else has it."""


def _procs(cell_id: str) -> list[tuple[int, str]]:
    """Live processes of this user that carry the cell's mark in their environment."""
    found = []
    want = f"{MARK}={cell_id}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if want not in (d / "environ").read_bytes().split(b"\0"):
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            found.append((int(d.name), cmd.strip()[:160]))
    return found


_NAMED = re.compile(
    r"(rank 1\b.*(left the job|did not arrive|exited|killed|raised|MPI_Abort|without "
    r"MPI_Finalize|planted failure|disagree)|chunk_bytes.*CUDAMPI_CHUNK_BYTES|"
    r"planted failure on rank 1)"
)


_JOB_NAMED = {
    "badsetting": re.compile(r"CUDAMPI_CHUNK_BYTES='inf': expected a size"),
    "badcache": re.compile(r"cudampi: the capabilities cache was not read: .* nests too deeply"),
}
"""How each fault of the job's environment is named."""


def _job_fault_env(fault: str, tmp: Path) -> dict[str, str]:
    """The environment a fault of the job (:data:`JOB_FAULTS`) gives every rank."""
    if fault == "badsetting":
        return {"CUDAMPI_CHUNK_BYTES": "inf"}
    if fault == "badcache":
        (tmp / "cache").mkdir(mode=0o700)
        (tmp / "cache" / "capabilities.json").write_text("[" * 200000)
        return {"CUDAMPI_CACHE_DIR": str(tmp / "cache")}
    return {}


def run_cell(fault: str, launcher: str, api: str, ranks: int, mpich: Path | None) -> Cell:
    cell = Cell(fault, launcher, api)
    if launcher == "torchrun" and mpich is None:
        cell.why = "skipped: no MPICH venv (.venv-mpich) for torchrun"
        return cell
    with tempfile.TemporaryDirectory(prefix=f"fm-{fault}-{launcher}-{api}-") as tmp:
        script = Path(tmp) / "target.py"
        script.write_text(TARGET)
        env = _env(launcher, mpich, api)
        env[MARK] = tmp
        env.update(_job_fault_env(fault, Path(tmp)))
        t0 = time.monotonic()
        proc = subprocess.Popen(
            _argv(launcher, ranks, script, fault, api),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            cell.why = f"still running after {LIMIT:g} s"
        cell.seconds = round(time.monotonic() - t0, 1)
        cell.exit_code = proc.returncode
        time.sleep(2.0)  # what outlives its launcher is left behind
        left = _procs(tmp)
        cell.leftovers = [f"{pid} {cmd}" for pid, cmd in left]
        for pid, _cmd in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    cell.ranks = ranks
    cell.raised = sorted(
        {int(m.group(1)) for m in re.finditer(r"FAULT-MATRIX rank (\d+) raised", out)}
    )
    cell.watched = sorted(
        {int(m.group(1)) for m in re.finditer(r"; ending rank (\d+) of \d+ on", out)}
    )
    pattern = _JOB_NAMED.get(fault, _NAMED)
    named = [
        ln[m.start() if fault in JOB_FAULTS else 0 :].strip()
        for ln in out.splitlines()
        if (m := pattern.search(ln)) and "injects" not in ln
    ]
    cell.message = named[0][:220] if named else ""
    problems = [cell.why] if cell.why else []
    finished = re.findall(r"FAULT-MATRIX rank (\d+) finished the loop", out)
    cell.finished = sorted(int(r) for r in set(finished))
    if fault == "badcache":  # named, and nothing else: every rank runs to its end
        if cell.exit_code != 0:
            problems.append(f"exit status {cell.exit_code}")
        if len(finished) != ranks:
            problems.append(f"{len(finished)} of {ranks} ranks finished the loop")
    else:
        if cell.exit_code == 0:
            problems.append("exit status 0")
        if finished:
            problems.append("a rank went on as if nothing happened")
    if not named:
        problems.append("the fault is named nowhere")
    if cell.leftovers:
        problems.append(f"{len(cell.leftovers)} process(es) left behind")
    cell.ok = not problems
    cell.why = "; ".join(problems)
    return cell


def _others(c: Cell) -> str:
    """How the ranks other than the faulty one ended."""
    if c.fault in JOB_FAULTS and c.finished:
        return f"finished: {','.join(map(str, c.finished))}"
    others = [r for r in range(c.ranks) if r != 1 or c.fault in JOB_FAULTS]
    parts = []
    raised = [r for r in others if r in c.raised]
    watched = [r for r in others if r in c.watched and r not in c.raised]
    rest = [r for r in others if r not in raised and r not in watched]
    if raised:
        parts.append(f"raised: {','.join(map(str, raised))}")
    if watched:
        parts.append(f"PMI watch: {','.join(map(str, watched))}")
    if rest:
        parts.append(f"launcher: {','.join(map(str, rest))}")
    return "; ".join(parts)


def markdown(cells: list[Cell]) -> str:
    rows = [
        "| fault | launcher | API | exit | s | the other ranks | the fault named as | left | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        msg = c.message.replace("|", "/")[:100]
        left = str(len(c.leftovers))
        ok = "yes" if c.ok else f"NO: {c.why}"
        rows.append(
            f"| {c.fault} | {c.launcher} | {c.api} | {c.exit_code} | {c.seconds:g} | "
            f"{_others(c)} | {msg} | {left} | {ok} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cells", default="", help="comma list of faults, launchers, APIs to keep")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--mpich-python", default=os.environ.get("CUDAMPI_TEST_MPICH_PYTHON"))
    p.add_argument("--json", default=None, help="also write the cells as JSON to this file")
    a = p.parse_args(argv)
    keep = {w for w in a.cells.split(",") if w}
    mpich = mpich_lib(a.mpich_python)
    cells = []
    for fault in FAULTS:
        for launcher in LAUNCHERS:
            for api in APIS:
                if keep and not keep & {fault, launcher, api}:
                    continue
                cell = run_cell(fault, launcher, api, a.ranks, mpich)
                cells.append(cell)
                print(
                    f"# {fault:8} {launcher:14} {api:5} exit {cell.exit_code} "
                    f"{cell.seconds:5.1f} s {'ok' if cell.ok else 'NO: ' + cell.why}",
                    file=sys.stderr,
                    flush=True,
                )
    print(markdown(cells))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(c) for c in cells], indent=2))
    return 0 if all(c.ok or c.why.startswith("skipped") for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
