"""``cudampi doctor --hosts a,b,c`` (or ``--hostfile``, or inside an allocation): the doctor on
every node of a job, then every link between them. The I/O of the job doctor; what it found is
judged by :mod:`cudampi.doctor.jobfacts` and :mod:`cudampi.doctor.links` (pure).

Every job it starts goes through ``cudampi launch`` (``python -m cudampi launch``: the same
launchers, argv and supervision as a user's job; nothing here spells an mpiexec argv; running
it and reading what it said is :mod:`cudampi.doctor.jobrun`):

1. the nodes: ``cudampi launch --dry-run --json`` reads ``--hosts``/``--hostfile`` as a launch
   would (inside an allocation without them, the nodes are where the first job's ranks ran);
2. the facts: one job of one rank per node runs :mod:`cudampi.doctor.node` (the single-node
   doctor there: its probes and its capabilities cache on that node). A node that does not say
   it is there within ``node_timeout`` s, or a job that fails, is run again alone, so a bad node
   is named by itself: its launcher's message, and whether ssh reaches it;
3. the links: the pairs of nodes in rounds (:func:`cudampi.doctor.links.rounds`), one job per
   round running :mod:`cudampi.probe.links`; a round that fails runs its pairs again one job
   each, and a pair with a node that failed before runs alone. A node ssh cannot reach is left
   out of the rounds that follow.

Every job has a timeout; nothing waits for ever.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudampi.doctor.gather import DoctorOptions
from cudampi.doctor.jobrun import LAUNCH, Launched, launch, markers, unreachable
from cudampi.doctor.links import (
    LINK_BYTES,
    NODE_TIMEOUT,
    Link,
    link_from_report,
    outliers,
    parse_refused,
    rounds,
)
from cudampi.doctor.node import MARKER, NodeLines, options_json
from cudampi.errors import ConfigError, LaunchError
from cudampi.probe.links import MARKER as LINK_MARKER
from cudampi.probe.runtime import DEVICE_TESTS, HOST_TESTS, launch_env

SSH_TIMEOUT = 10.0
CONFIRM_AT_MOST = 8
"""Outlier links measured again, alone; more than this many is a pattern, not a busy moment."""
PROBE_JOBS = len(HOST_TESTS) + 2 * (len(DEVICE_TESTS) + 1)
"""The most probe jobs one node's doctor runs (the device ones twice with the libucx recipe):
with the probe timeout, the bound on a node's doctor."""


@dataclass(frozen=True)
class JobOptions:
    """What ``cudampi doctor`` was asked for a job."""

    node: DoctorOptions
    hosts: str | None = None
    hostfile: str | None = None
    ssh: str | None = None
    """The remote shell ``cudampi launch --ssh`` takes (also the doctor's own ssh check)."""
    launcher: str = "auto"
    links: bool = True
    link_bytes: int = LINK_BYTES
    node_timeout: float = NODE_TIMEOUT


@dataclass
class JobResult:
    """What the job doctor found (rendered by :mod:`cudampi.doctor.job_render`)."""

    nodes: list[str]
    launcher: dict[str, Any]
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)
    unanswered: dict[str, str] = field(default_factory=dict)
    """node -> why it gave no facts, in words ("did not answer in 30 s: ssh ok, ...")."""
    down: dict[str, str] = field(default_factory=dict)
    """Nodes ssh could not reach (node -> why, as ``unanswered`` says it): left out of the
    links that follow."""
    links: list[Link] = field(default_factory=list)
    rounds: list[list[tuple[str, str]]] = field(default_factory=list)
    links_run: bool = True
    link_bytes: int = LINK_BYTES
    wall_s: float = 0.0
    jobs: int = 0
    """How many jobs were launched."""


Progress = Callable[[str], None]


class JobDoctor:
    """One run of the job doctor (see the module docstring)."""

    def __init__(self, options: JobOptions, progress: Progress | None = None) -> None:
        self.o = options
        self.say = progress or (lambda text: None)
        self.flavour = "openmpi"
        self.ssh_said: dict[str, str] = {}
        self.jobs = 0
        self.lock = threading.Lock()

    # -- the nodes ---------------------------------------------------------------------------

    def where(self) -> list[str]:
        """The launch flags that name the nodes as given (none inside an allocation)."""
        out = []
        if self.o.hosts:
            out += ["--hosts", self.o.hosts]
        if self.o.hostfile:
            out += ["--hostfile", self.o.hostfile]
        return out

    def common(self) -> list[str]:
        """The flags of every job: the launcher, its ssh, no binding, the stack as it is."""
        out = ["--launcher", self.o.launcher, "--bind-to", "none", "--cuda-aware", "no"]
        if self.o.ssh:
            out += ["--ssh", self.o.ssh]
        return out

    def plan(self) -> tuple[list[str], dict[str, Any]]:
        """The nodes (as ``cudampi launch`` reads the flags) and the launcher; nodes is empty
        inside an allocation given no hosts (the first job's ranks name them)."""
        argv = [*LAUNCH, "--dry-run", "--json", "-ppn", "1", *self.where(), *self.common()]
        argv += ["-m", "cudampi.doctor.node"]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=launch_env())
        if p.returncode != 0:
            msg = p.stderr.strip().removeprefix("cudampi launch: ")
            raise ConfigError(f"the doctor cannot launch on these hosts: {msg}")
        data = json.loads(p.stdout)
        hostfile = (data.get("command") or {}).get("hostfile_path")
        if hostfile and Path(hostfile).parent.name.startswith("cudampi-launch-"):
            shutil.rmtree(Path(hostfile).parent, ignore_errors=True)  # the dry run's hostfile
        plan = data["plan"]
        names = list(dict.fromkeys(h["name"] for h in plan.get("hosts") or ()))
        launcher = dict(plan["launcher"])
        launcher["nprocs"] = plan.get("nprocs")
        self.flavour = launcher.get("flavour", "openmpi")
        return names, launcher

    def hosts_flag(self, names: Sequence[str]) -> list[str]:
        return ["--hosts", ",".join(f"{n}:1" for n in names)]

    # -- the facts ---------------------------------------------------------------------------

    def facts_job(
        self, names: Sequence[str] | None, expected: int | None = None
    ) -> tuple[dict[str, dict[str, Any]], Launched]:
        """One rank per node of ``names`` (None: of the allocation) runs the node doctor."""
        node = self.o.node
        bound = self.o.node_timeout + 60 + node.timeout * PROBE_JOBS
        where = self.hosts_flag(names) if names else self.where()
        args = [*where, "-ppn", "1", *self.common(), "-m", "cudampi.doctor.node"]
        args += [options_json(node), *(names or ())]
        got: dict[str, dict[str, Any]] = {}
        total = len(names) if names else expected
        lines = NodeLines()

        def seen(line: str) -> None:
            whole = lines.add(line) if line.startswith(MARKER) else None
            if whole is not None:
                got[whole[0]] = whole[1]
                self.say(f"node facts: {len(got)} of {total or '?'} nodes")

        self.count()
        run = launch(
            args,
            timeout=bound,
            hello_from=list(names or ()),
            hello_timeout=self.o.node_timeout,
            on_line=seen,
        )
        return got, run

    def gather_facts(self, result: JobResult) -> None:
        names = result.nodes
        self.say(f"node facts: starting the doctor on {len(names) or 'every'} node(s)")
        got, run = self.facts_job(names or None, result.launcher.get("nprocs"))
        if not names:  # inside an allocation: the nodes are where the ranks ran
            result.nodes = names = list(got)
            expected = result.launcher.get("nprocs") or 0
            if len(got) < expected:
                result.unanswered["(the allocation)"] = (
                    f"{expected - len(got)} of its {expected} nodes did not answer: "
                    f"{run.message or f'exit status {run.returncode}'}"
                )
        result.facts.update(got)
        missing = [n for n in names if n not in got]
        gone = [n for n in missing if n in unreachable(run.message)]
        for n in gone if len(gone) < len(names) else ():
            result.unanswered[n] = self.why(n, run)  # the launcher named it: no need to ask again
        missing = [n for n in missing if n not in result.unanswered]
        if gone and len(missing) > 1:
            self.say(f"node facts: again without {', '.join(gone)}")
            got, run = self.facts_job(missing)
            result.facts.update(got)
            missing = [n for n in missing if n not in got]
        if not missing or len(names) == 1:
            for n in missing:
                result.unanswered[n] = self.why(n, run)
            return
        self.say(f"node facts: again, one job per node, for {', '.join(missing)}")
        with ThreadPoolExecutor(max_workers=min(16, len(missing))) as pool:
            alone = list(pool.map(lambda n: (n, self.facts_job([n])), missing))
        for n, (facts, run1) in alone:
            if n in facts:
                result.facts[n] = facts[n]
            else:
                result.unanswered[n] = self.why(n, run1)

    def why(self, node: str, run: Launched) -> str:
        """Why ``node`` gave nothing: did it answer, does ssh reach it, the launcher's words."""
        head = f"did not answer in {self.o.node_timeout:g} s" if run.timed_out else "did not answer"
        ssh = self.ssh_check(node)
        parts = [head + (f": {ssh}" if ssh else "")]
        parts.append(f"MPI job failed: {run.message or f'exit status {run.returncode}'}")
        return ", ".join(parts)

    def ssh_check(self, node: str) -> str:
        """``ssh ok`` / ``ssh failed: ...`` where the launcher starts its daemons by ssh; ""
        under a batch system's own launcher. Asked once a node."""
        if self.flavour not in ("openmpi", "mpich"):
            return ""
        with self.lock:
            if node in self.ssh_said:
                return self.ssh_said[node]
        base = shlex.split(self.o.ssh) if self.o.ssh else ["ssh"]
        argv = [*base, "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", node, "true"]
        try:
            p = subprocess.run(
                argv, capture_output=True, text=True, timeout=SSH_TIMEOUT, stdin=subprocess.DEVNULL
            )
            if p.returncode == 0:
                said = "ssh ok"
            else:
                last = [ln for ln in p.stderr.splitlines() if ln.strip()]
                why = last[-1].strip().removeprefix("ssh: ") if last else f"exit {p.returncode}"
                said = f"ssh failed: {why}"
        except subprocess.TimeoutExpired:
            said = f"ssh failed: no answer in {SSH_TIMEOUT:g} s"
        except OSError as exc:
            said = f"ssh failed: {exc}"
        with self.lock:
            self.ssh_said[node] = said
        return said

    def count(self) -> None:
        with self.lock:
            self.jobs += 1

    # -- the links ---------------------------------------------------------------------------

    def pair_spec(self, a: str, b: str, facts: Mapping[str, Mapping[str, Any]]) -> str:
        """``a=b`` (``a=b=cupy`` where both nodes proved device p2p with one backend)."""
        fa, fb = facts.get(a, {}), facts.get(b, {})
        backend = fa.get("device_backend")
        both = fa.get("device_p2p") and fb.get("device_p2p") and backend == fb.get("device_backend")
        return f"{a}={b}={backend}" if both else f"{a}={b}"

    def pairs_job(
        self, pairs: Sequence[tuple[str, str]], result: JobResult
    ) -> tuple[list[Link], Launched]:
        """One job measuring ``pairs`` at once; the pairs it measured."""
        order = [n for p in pairs for n in p]
        args = [*self.hosts_flag(order), *self.common(), "-m", "cudampi.probe.links"]
        args += [str(self.o.link_bytes), *(self.pair_spec(a, b, result.facts) for a, b in pairs)]
        self.count()
        run = launch(args, timeout=self.o.node_timeout)
        wanted = {tuple(p) for p in pairs}
        links = []
        for m in markers(run.lines, LINK_MARKER):
            pair = tuple(m.get("pair") or ())
            if pair in wanted:
                links.append(link_from_report(pair[0], pair[1], m, run.wall_s))
        return links, run

    def failed_link(self, a: str, b: str, run: Launched, addresses: Mapping[str, str]) -> Link:
        refused = tuple(
            dict.fromkeys(
                addresses.get(addr, addr)
                for addr, _err in parse_refused(run.stderr)
                if addresses.get(addr) in (a, b)
            )
        )
        if run.timed_out and not run.message.startswith("stopped"):
            why = f"did not finish in {self.o.node_timeout:g} s: {run.message}"
        else:
            why = run.message or f"exit status {run.returncode}"
        return Link(a, b, "failed", message=why, refused_by=refused, wall_s=run.wall_s)

    def measure_round(
        self, pairs: Sequence[tuple[str, str]], suspects: set[str], result: JobResult
    ) -> list[Link]:
        """The pairs of one round: those with a suspect node alone, the others in one job; a
        job that failed has its unmeasured pairs run again one job each."""
        together = [p for p in pairs if not set(p) & suspects]
        groups = ([together] if together else []) + [[p] for p in pairs if set(p) & suspects]
        addresses = self.addresses(result.nodes)
        links: list[Link] = []
        again: list[tuple[str, str]] = []
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(groups)))) as pool:
            for group, (got, run) in zip(
                groups, pool.map(lambda g: self.pairs_job(g, result), groups)
            ):
                links += got
                done = {(lk.a, lk.b) for lk in got}
                rest = [p for p in group if p not in done]
                # a host the launcher itself says it could not reach fails its pair at once
                gone = unreachable(run.message)
                links += [self.failed_link(a, b, run, addresses) for a, b in rest if {a, b} & gone]
                rest = [p for p in rest if not {p[0], p[1]} & gone]
                if len(group) > 1:
                    again += rest
                else:
                    links += [self.failed_link(a, b, run, addresses) for a, b in rest]
        if again:
            with ThreadPoolExecutor(max_workers=min(16, len(again))) as pool:
                for (a, b), (got, run) in zip(
                    again, pool.map(lambda p: self.pairs_job([p], result), again)
                ):
                    links += got or [self.failed_link(a, b, run, addresses)]
        return links

    def addresses(self, nodes: Sequence[str]) -> dict[str, str]:
        """IPv4 address -> node, for reading the MPI's own connection messages."""
        import socket

        out = {}
        for n in nodes:
            try:
                for info in socket.getaddrinfo(n, None, socket.AF_INET):
                    out[str(info[4][0])] = n
            except (OSError, UnicodeError):
                continue
        return out

    def measure_links(self, result: JobResult) -> None:
        alive = [n for n in result.nodes if n in result.facts]
        if len(alive) < 2:
            return
        result.rounds = rounds(alive)
        suspects: set[str] = set()
        total = len(result.rounds)
        for i, pairs in enumerate(result.rounds, 1):
            todo = [p for p in pairs if not set(p) & set(result.down)]
            for a, b in pairs:
                if (a, b) not in todo:
                    dead = ", ".join(n for n in (a, b) if n in result.down)
                    result.links.append(
                        Link(a, b, "skipped", message=f"not measured: {dead} is down")
                    )
            if not todo:
                continue
            shown = ", ".join(f"{a}<->{b}" for a, b in todo)
            self.say(f"links: round {i}/{total}: {shown}")
            got = self.measure_round(todo, suspects, result)
            for lk in got:
                if lk.status == "failed":
                    suspects.update((lk.a, lk.b))
                    for n in (lk.a, lk.b):
                        said = self.ssh_check(n)
                        if said.startswith("ssh failed") and n not in result.down:
                            result.down[n] = f"did not answer: {said}, MPI job failed: {lk.message}"
            result.links += got
        self.confirm(result)

    def confirm(self, result: JobResult) -> None:
        """Measure each outlier again, alone (nothing else running between the nodes), and keep
        the better figures: a link slow because of a busy moment is not named."""
        again = outliers(result.links)[:CONFIRM_AT_MOST]
        for lk in again:
            self.say(f"links: {lk.name} again, alone (it stood out)")
            got, _run = self.pairs_job([(lk.a, lk.b)], result)
            if got:
                i = result.links.index(lk)
                result.links[i] = lk.best_of(got[0])

    # -- all of it ---------------------------------------------------------------------------

    def run(self) -> JobResult:
        t0 = time.monotonic()
        names, launcher = self.plan()
        result = JobResult(names, launcher, link_bytes=self.o.link_bytes)
        self.gather_facts(result)
        for node, why in result.unanswered.items():
            if "ssh failed" in why:
                result.down[node] = why
        if self.o.links:
            self.measure_links(result)
        else:
            result.links_run = False
        result.wall_s = time.monotonic() - t0
        result.jobs = self.jobs
        return result


def hosts_of_this_job(size: int, rank: int, timeout: float) -> list[str] | None:
    """Where the ranks of the MPI job this process is rank ``rank`` of ``size`` in run
    (``mpirun -n 8 --map-by ppr:1:node cudampi doctor``, ``srun``, ``cudampi launch ...
    cudampi doctor``): every rank tells its host name over MPI; rank 0 gets them in rank order
    (each host once), the others None. MPI is finalized after, so rank 0 can start the doctor's
    own jobs. Ranks that cannot reach each other are ended after ``timeout`` s with that said;
    ranks that are not one MPI job (a launcher without its MPI plug-in) are told so."""
    import socket

    from mpi4py import MPI

    from cudampi.abort import abort_job

    comm = MPI.COMM_WORLD

    def stuck() -> None:
        abort_job(
            1,
            f"cudampi doctor: the ranks of this job could not tell each other their hosts in "
            f"{timeout:g} s: MPI does not work between its nodes. Run the doctor from one node "
            "with the job's hosts instead: cudampi doctor --hosts h1,h2,... (or --hostfile)\n",
            comm,
        )

    watch = threading.Timer(timeout, stuck)
    watch.daemon = True
    watch.start()
    names = comm.allgather(socket.gethostname())
    watch.cancel()
    together = comm.size == size
    MPI.Finalize()
    if rank != 0:
        return None
    if not together:
        raise LaunchError(
            f"the launcher started {size} ranks but MPI sees a world of {len(names)}: they are "
            "not one MPI job (srun needs --mpi=pmix for Open MPI). Run the doctor from one node "
            "with the job's hosts instead: cudampi doctor --hosts h1,h2,... (or --hostfile)"
        )
    return list(dict.fromkeys(names))


def run_job(options: JobOptions, progress: Progress | None = None) -> JobResult:
    """The job doctor: every node's facts, then every link (see the module docstring)."""
    return JobDoctor(options, progress).run()


def progress_line(stream: Any = None) -> Progress:
    """Progress on stderr: one line rewritten in place on a terminal, a line each elsewhere."""
    out = sys.stderr if stream is None else stream
    tty = hasattr(out, "isatty") and out.isatty()
    start = time.monotonic()
    last = [""]

    def show(text: str) -> None:
        line = f"  doctor [{time.monotonic() - start:5.1f} s] {text}"
        if tty:
            width = shutil.get_terminal_size((100, 24)).columns - 1
            out.write("\r" + line[:width].ljust(len(last[0][:width])))
            last[0] = line
        else:
            out.write(line + "\n")
        out.flush()

    return show


def end_progress(stream: Any = None) -> None:
    out = sys.stderr if stream is None else stream
    if hasattr(out, "isatty") and out.isatty():
        out.write("\n")
        out.flush()
