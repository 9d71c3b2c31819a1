"""The rank bootstrap: ``python -m cudampi.launch.rank [-m module | script | --exec program]
args...``.

What every rank of ``cudampi launch`` runs first, before the user's code and before CUDA starts:

1. RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from the launcher's own variables;
2. the GPU (CUDA_VISIBLE_DEVICES or the CUDAMPI_DEVICE hint) and the CPU binding to its NUMA
   node; NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME from the route to MASTER_ADDR (if unset);
3. the script, by :mod:`runpy`, as ``python script.py`` / ``python -m module`` would run it; or
   any other program (``--exec``), which replaces this process once 1-2 are done (it keeps the
   environment, the CPU binding and the death signal; the launcher reports how it ended).

Under ``cudampi launch`` every rank first says it started, as a tagged stderr line carrying the
job's token (``CUDAMPI_REPORT_TOKEN``, taken out of the environment before the user's code runs);
when its script has run to the end it says "finished", and once Python's exit handlers have run
after that (non-daemon threads joined, every ``atexit`` handler done) it says "exiting": what
is left is the interpreter's teardown, MPI_Finalize (mpi4py's, after Python's handlers) and C++
and CUDA teardown. The supervisor tells from these lines where a rank that does not end is.
A failure (an exception, a non-zero ``sys.exit``) is reported as tagged stderr lines naming host
and rank (see :mod:`cudampi.launch.rankreport`); if MPI was initialized the job is aborted so the
other ranks do not hang in a collective. A fatal signal's Python traceback goes to
``$CUDAMPI_REPORT_DIR/rank-<R>.fault`` when that folder exists on this host.
"""

from __future__ import annotations

import atexit
import os
import runpy
import socket
import sys
import traceback
from collections.abc import MutableMapping, Sequence
from types import TracebackType
from typing import IO, Any

from cudampi.abort import abort_job
from cudampi.launch.rankreport import (
    NO_TOKEN,
    TOKEN_ENV,
    format_report,
    format_started,
    summarize_exception,
)
from cudampi.rankenv import dies_with_launcher, rank_env

USAGE = "usage: python -m cudampi.launch.rank [-m module | script.py | --exec program] [args...]"
EXEC = "--exec"


def export_rank_env(env: MutableMapping[str, str]) -> Any:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from the launcher's variables."""

    info = rank_env(env)
    env["RANK"] = str(info.rank)
    env["WORLD_SIZE"] = str(info.world_size)
    env["LOCAL_RANK"] = str(info.local_rank)
    env["LOCAL_WORLD_SIZE"] = str(info.local_world_size)
    if info.node_rank is not None:
        env.setdefault("GROUP_RANK", str(info.node_rank))
    return info


def choose_socket_ifname(env: MutableMapping[str, str]) -> str | None:
    """NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME = this host's interface towards MASTER_ADDR."""
    if env.get("NCCL_SOCKET_IFNAME") and env.get("GLOO_SOCKET_IFNAME"):
        return env["NCCL_SOCKET_IFNAME"]
    master = env.get("MASTER_ADDR")
    if not master:
        return None
    from cudampi.net import route_interface

    iface = route_interface(master)
    if iface is None:
        return None
    env.setdefault("NCCL_SOCKET_IFNAME", iface.name)
    env.setdefault("GLOO_SOCKET_IFNAME", iface.name)
    return iface.name


def _die_with_parent() -> None:
    """Ask the kernel to kill this rank if its launcher daemon dies (no orphans after kill -9)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _fault_file(rank: int) -> IO[str] | None:
    folder = os.environ.get("CUDAMPI_REPORT_DIR")
    if not folder or not os.path.isdir(folder):
        return None
    try:
        f = open(os.path.join(folder, f"rank-{rank}.fault"), "w")  # noqa: SIM115 (kept open)
        f.write(f"host={socket.gethostname()} pid={os.getpid()}\n")
        f.flush()
        return f
    except OSError:
        return None


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    return 1


def _target(args: list[str]) -> tuple[str | None, str | None, str | None, list[str]] | None:
    """``(module, program, script, its args)`` from the bootstrap's argv (one of the three
    set); None for a usage error."""
    if not args or args[0] in ("-h", "--help"):
        return None
    if args[0] == "--":
        args = args[1:]
    if not args:
        return None
    if args[0] == EXEC:
        return None if len(args) < 2 else (None, args[1], None, args[2:])
    if args[0] == "-m":
        return None if len(args) < 2 else (args[1], None, None, args[2:])
    if args[0].startswith("-m") and len(args[0]) > 2:
        return args[0][2:], None, None, args[1:]
    return None, None, args[0], args[1:]


def run(argv: Sequence[str]) -> int:
    """Prepare this rank, run the target, report a failure. Returns the exit code."""
    target = _target(list(argv))
    if target is None:
        print(USAGE, file=sys.stderr)
        return 2
    module, program, script, rest = target
    host = socket.gethostname()
    rank = -1
    token = os.environ.pop(TOKEN_ENV, "") or NO_TOKEN
    try:
        info = export_rank_env(os.environ)
        rank = info.rank
        if token != NO_TOKEN:
            sys.stderr.write(format_started(host, rank, token))
            sys.stderr.flush()
            # Registered before the script's own handlers (and torch's, cudampi's, weakref's),
            # so it runs after them: atexit calls its handlers last registered first.
            atexit.register(_exiting, host, rank, token)
        if dies_with_launcher(info.launcher):
            _die_with_parent()
        fault = _fault_file(rank) if program is None else None
        if fault is not None:
            import faulthandler

            faulthandler.enable(file=fault, all_threads=True)
        from cudampi.launch.gpu import select_in_rank

        select_in_rank(info.local_rank, os.environ)
        choose_socket_ifname(os.environ)
        if program is not None:
            return _exec(host, rank, program, rest, token)
        if module is not None:
            sys.argv = [module, *rest]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            assert script is not None
            sys.argv = [script, *rest]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(os.path.abspath(script), run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")  # what python prints for sys.exit("message")
        if code != 0:
            msg = exc.code if isinstance(exc.code, str) else f"exited with code {code}"
            _report(host, rank, code, [f"SystemExit: {msg}"], token)
            abort_job(code)
        else:
            _finished(host, rank, token)
        return code
    except KeyboardInterrupt:
        _report(host, rank, 130, ["KeyboardInterrupt"], token)
        return 130
    except BaseException as exc:
        trimmed = _user_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc, trimmed)  # as python would: the script's hooks, cudampi's
        tb = traceback.format_exception(type(exc), exc, trimmed)  # hints (kept as notes) too
        lines = summarize_exception(tb)
        lines += [n for n in getattr(exc, "__notes__", ()) if isinstance(n, str) and n not in lines]
        _report(host, rank, 1, lines, token)
        abort_job(1)
        return 1
    _finished(host, rank, token)
    return 0


_FINISHED: list[bool] = []
"""[True] once this rank said its script finished (then its exit is reported too)."""


def _finished(host: str, rank: int, token: str) -> None:
    """Tell the supervisor this rank's script ran to the end with status 0 (so a launcher that
    then fails to exit is not taken for a failed job)."""
    if token == NO_TOKEN:
        return
    _FINISHED.append(True)
    _say(format_started(host, rank, token, "finished"))


def _exiting(host: str, rank: int, token: str) -> None:
    """At exit, after every other Python exit handler: tell the supervisor that this rank,
    whose script finished, is past Python's own exit (a rank that then does not end is in the
    interpreter's teardown, MPI_Finalize or C++/CUDA teardown, not in an atexit handler)."""
    if _FINISHED:
        _say(format_started(host, rank, token, "exiting"))


def _say(line: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(line)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # the script closed its streams


def _exec(host: str, rank: int, program: str, args: list[str], token: str) -> int:
    """Replace this process with ``program`` (returns only if it cannot be started)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(program, [program, *args])
    except OSError as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        _report(host, rank, code, [f"cannot run {program!r} on {host}: {exc.strerror}"], token)
        return code
    return 0  # not reached


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without this bootstrap's and runpy's frames (they are not the user's)."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    return tb


def _report(host: str, rank: int, code: int, lines: list[str], token: str) -> None:
    try:
        sys.stdout.flush()
    except Exception:
        pass
    sys.stderr.write(format_report(host, rank, code, lines, token))
    sys.stderr.flush()


def main() -> None:
    code = run(sys.argv[1:])
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    sys.exit(code)


if __name__ == "__main__":
    main()
