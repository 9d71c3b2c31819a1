"""Fault reports and the launchers' failure messages (real captured output) -> the summary."""

from __future__ import annotations

from pathlib import Path

from cudampi.launch.faults import (
    HostFailure,
    LauncherEvents,
    RankFailure,
    build_result,
    parse_launcher_output,
)
from cudampi.launch.rankreport import (
    NO_TOKEN,
    SUMMARY_LINES,
    format_report,
    format_started,
    is_user_file,
    parse_reports,
    parse_started,
    summarize_exception,
)

LAUNCH = Path(__file__).resolve().parents[1] / "fixtures" / "launch"
TOKEN = "0123456789abcdef"


def rep(host: str, rank: int, code: int, lines: list[str]) -> str:
    return format_report(host, rank, code, lines, TOKEN)


def fixture(name: str) -> str:
    return (LAUNCH / name).read_text()


def test_openmpi_messages():
    ev = parse_launcher_output(fixture("openmpi-exit.txt"), "openmpi")
    assert ev.ranks == (RankFailure(1, None, exit_code=3),)
    ev = parse_launcher_output(fixture("openmpi-kill.txt"), "openmpi")
    assert ev.ranks == (RankFailure(1, "vm", signal=9),)
    ev = parse_launcher_output(fixture("openmpi-segv.txt"), "openmpi")
    assert ev.ranks == (RankFailure(1, "vm", signal=11),)
    ev = parse_launcher_output(fixture("openmpi-abort.txt"), "openmpi")
    assert ev.ranks == (RankFailure(1, "vm", exit_code=7),)
    ev = parse_launcher_output(fixture("openmpi-unresolvable-host.txt"), "openmpi")
    assert ev.hosts == (
        HostFailure(
            "nosuchhost.invalid",
            "unreachable",
            "Name or service not known (Open MPI calls it nosuchhost)",
        ),
    )


def test_openmpi_host_killed_mid_run_and_host_refusing_ssh():
    ev = parse_launcher_output(fixture("openmpi-host-killed.txt"), "openmpi")
    assert ev.hosts == (
        HostFailure("10.231.0.2", "lost", "its ssh connection closed (Open MPI calls it cm-host2)"),
    )
    ev = parse_launcher_output(fixture("openmpi-host-refused.txt"), "openmpi")
    assert ev.hosts == (HostFailure("10.231.0.2", "unreachable", "Connection refused"),)
    res = build_result(255, [], ev)
    assert "host 10.231.0.2 cannot be reached: Connection refused" in res.summary()
    assert "ssh HOST true" in res.summary()


def test_openmpi_lost_daemon_is_named_by_the_host_the_user_gave():
    """PRTE names a lost daemon by the node's own hostname, and when the remote shell's "closed"
    line has not come yet (seen in CI: the two-host test got "host cm-host2", not the address
    it launched on) only its daemon number says which of the given hosts it is."""
    text = fixture("openmpi-host-lost.txt")  # from a two-host run in network namespaces
    ev = parse_launcher_output(text, "openmpi", ("10.231.0.2",))
    assert ev.hosts == (
        HostFailure(
            "10.231.0.2", "lost", "its daemon stopped answering (Open MPI calls it cm-host2)"
        ),
    )
    res = build_result(1, [], ev)
    assert "host 10.231.0.2 was lost during the run" in res.summary()
    # no hosts given (or a daemon number beyond them): the node's own name
    assert parse_launcher_output(text, "openmpi").hosts == (
        HostFailure("cm-host2", "lost", "its daemon stopped answering"),
    )
    # three hosts: daemon 2 is the second remote host given
    third = text.replace("@0,1] on node cm-host2", "@0,2] on node cm-host3")
    assert parse_launcher_output(third, "openmpi", ("h2", "h3")).hosts[0].host == "h3"
    # a node named as it was given (or by its short name) is that host, whatever its number
    assert parse_launcher_output(third, "openmpi", ("cm-host3.lan", "h3")).hosts[0].host == (
        "cm-host3.lan"
    )


def test_hydra_and_srun_messages():
    ev = parse_launcher_output(fixture("mpich-kill.txt"), "mpich")
    assert ev.ranks == (RankFailure(None, "vm", signal=9, pid=10014),)
    # Hydra's PID is the killed process: its fault file names the rank (on the host as Hydra
    # names it, or by a pid that only one rank had where Hydra names the host another way)
    faults = {0: "host=vm pid=10013\n", 1: "host=vm pid=10014\n"}
    res = build_result(9, [], ev, faults)
    assert "rank 1 on host vm was killed by signal 9 (SIGKILL)" in res.summary()
    renamed = {0: "host=node0 pid=10013\n", 1: "host=node0 pid=10014\n"}
    assert build_result(9, [], ev, renamed).failures[0].rank == 1
    clash = {0: "host=a pid=10014\n", 1: "host=b pid=10014\n"}
    assert build_result(9, [], ev, clash).failures[0].rank is None  # not guessed
    ev = parse_launcher_output(fixture("mpich-abort.txt"), "mpich")
    assert ev.ranks == (RankFailure(1, None, exit_code=7),)
    # srun (Slurm 22.05) with --kill-on-bad-exit: the others are "Terminated" by srun itself
    ev = parse_launcher_output(fixture("srun-exit.txt"), "slurm")
    assert ev.ranks == (RankFailure(1, "vm", exit_code=3),)
    ev = parse_launcher_output(fixture("srun-kill.txt"), "slurm")
    assert ev.ranks == (RankFailure(1, "vm", signal=9, lines=("Killed",)),)
    res = build_result(143, [], parse_launcher_output(fixture("srun-segv.txt"), "slurm"))
    assert res.exit_code == 139 and "rank 1 on host vm was killed by signal 11" in res.summary()
    multi = "srun: error: gpu01: tasks 0-1: Segmentation fault (core dumped)\n"
    assert [f.rank for f in parse_launcher_output(multi, "slurm").ranks] == [0, 1]
    ev = parse_launcher_output(fixture("srun-no-pmix.txt"), "slurm")
    assert "--launcher mpirun" in ev.problems[0]
    res = build_result(1, [], ev)
    assert "mpi/pmix plugin failed to load" in res.summary()


def test_reports_roundtrip_and_traceback_summary():
    tb = [
        "Traceback (most recent call last):\n",
        '  File "/w/train.py", line 9, in <module>\n    main()\n',
        '  File "/w/train.py", line 5, in main\n    raise ValueError("loss is nan")\n',
        "ValueError: loss is nan\n",
    ]
    lines = summarize_exception(tb)
    assert lines[0] == "ValueError: loss is nan"
    assert lines[1] == '  File "/w/train.py", line 5, in main'  # innermost first
    text = rep("node2", 3, 1, lines) + "unrelated\n" + rep("node1", 0, 2, ["x"])
    reps = parse_reports(text.splitlines(), TOKEN)
    assert [(r.host, r.rank, r.code) for r in reps] == [("node2", 3, 1), ("node1", 0, 2)]
    assert reps[0].lines == tuple(lines)


def test_only_lines_with_the_jobs_token_are_reports():
    """A program that prints report-like lines (a log of an earlier job) cannot end a healthy
    job or blame a rank: only the job's own token counts, and no token never does."""
    other = format_report("vm", 7, 1, ["ValueError: old"], "fedcba9876543210")
    bare = "[cudampi-fault host=vm rank=7 code=1] ValueError: from an old cudampi\n"
    handmade = format_report("vm", 0, 1, ["E"], NO_TOKEN)
    lines = (other + bare + handmade + rep("vm", 1, 3, ["E"])).splitlines()
    assert [(r.rank, r.code) for r in parse_reports(lines, TOKEN)] == [(1, 3)]
    assert parse_reports(lines, NO_TOKEN) == []
    started = format_started("vm", 0, TOKEN) + format_started("vm", 1, "x") + rep("vm", 2, 1, ["E"])
    assert parse_started(started.splitlines(), TOKEN) == {0}
    assert parse_reports(started.splitlines(), TOKEN)[0].rank == 2


def test_build_result_merges_reports_launcher_and_fault_files():
    reps = parse_reports(rep("vm", 1, 1, ["ValueError: boom"]).splitlines(), TOKEN)
    ev = parse_launcher_output(
        fixture("openmpi-exit.txt").replace("Exit code:    3", "Exit code:    1"), "openmpi"
    )
    res = build_result(1, reps, ev)
    assert res.exit_code == 1 and res.failures == (
        RankFailure(1, "vm", 1, None, ("ValueError: boom",)),
    )
    assert "rank 1 on host vm exited with code 1" in res.summary()
    assert "ValueError: boom" in res.summary()
    # a crash: the launcher knows the signal, the fault file the Python stack
    fault = (
        "host=vm pid=42\nFatal Python error: Segmentation fault\n\nCurrent thread 0x1:\n"
        '  File "/w/t.py", line 3 in <module>\n'
    )
    res = build_result(
        139,
        [],
        parse_launcher_output(fixture("openmpi-segv.txt"), "openmpi"),
        {1: fault, 0: "host=vm pid=41\n"},
    )
    assert res.exit_code == 139
    assert res.failures[0].signal == 11
    assert res.failures[0].lines[0] == "Fatal Python error: Segmentation fault"
    assert "killed by signal 11 (SIGSEGV)" in res.summary()
    # ranks stopped by the job's own end are not listed next to the real fault
    stopped = rep("vm", 0, 130, ["KeyboardInterrupt"])
    both = parse_reports((stopped + rep("vm", 1, 4, ["E"])).splitlines(), TOKEN)
    res = build_result(131, both, parse_launcher_output("", "mpich"), stopped_for_fault=True)
    assert [f.rank for f in res.failures] == [1] and res.exit_code == 4
    assert build_result(0, [], parse_launcher_output("", "openmpi")).ok
    assert (
        build_result(-2, [], parse_launcher_output("", "openmpi"), interrupted=True).exit_code
        == 130
    )
    term = build_result(-2, [], LauncherEvents(), interrupted=True, stopped_by=15)
    assert (
        term.exit_code == 143 and "terminated (SIGTERM): every rank was stopped" in term.summary()
    )


def test_the_summary_keeps_the_users_frames_when_the_error_is_deep_in_libraries():
    libs = ("/usr/lib/python3.11", "/v/lib/python3.11/site-packages")
    tb = [
        "Traceback (most recent call last):\n",
        '  File "/home/u/train.py", line 40, in <module>\n    main()\n',
        '  File "/home/u/train.py", line 31, in main\n    loss = step(model, batch)\n',
        '  File "/home/u/train.py", line 12, in step\n    out = model(batch)\n',
    ]
    tb += [
        f'  File "/v/lib/python3.11/site-packages/torch/nn/mod{i}.py", line {i}, in f{i}\n'
        f"    return self.g{i}(x)\n"
        for i in range(6)
    ]
    tb.append("RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)\n")
    lines = summarize_exception(tb, libs=libs)
    assert len(lines) <= SUMMARY_LINES
    assert lines[0].startswith("RuntimeError: mat1 and mat2")
    assert '  File "/home/u/train.py", line 12, in step' in lines  # the user's own line
    assert "    out = model(batch)" in lines
    assert lines[1] == '  File "/v/lib/python3.11/site-packages/torch/nn/mod5.py", line 5, in f5'
    # innermost first: where it raised, then the user's frames outward
    files = [ln for ln in lines if ln.startswith("  File ")]
    assert files.index(lines[1]) < files.index('  File "/home/u/train.py", line 12, in step')
    assert is_user_file("/home/u/train.py", libs)
    assert not is_user_file("/usr/lib/python3.11/json/decoder.py", libs)
    assert not is_user_file("<frozen runpy>", libs)
