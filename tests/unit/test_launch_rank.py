"""The rank bootstrap run as a plain process (size 1): runpy semantics and failure reports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from cudampi.launch.rankreport import TOKEN_ENV, parse_reports, parse_started

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "name", __name__, "path0", sys.path[0] == os.path.dirname(__file__))
print("env", os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
      os.environ["LOCAL_WORLD_SIZE"])
mode = sys.argv[1]
def deep():
    raise KeyError("missing weights")
if mode == "raise":
    deep()
if mode == "exit":
    sys.exit("bad config")
if mode == "code":
    sys.exit(0)
"""


TOKEN = "0123456789abcdef"


def boot(*args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    env[TOKEN_ENV] = token
    return subprocess.run(
        [sys.executable, "-m", "cudampi.launch.rank", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_script_runs_as_main_with_its_argv(tmp_path: Path):
    s = tmp_path / "s.py"
    s.write_text(SCRIPT)
    p = boot(str(s), "ok", "--x", "a b")
    assert p.returncode == 0, p.stderr
    assert "argv ['ok', '--x', 'a b'] name __main__ path0 True" in p.stdout
    assert "env 0 1 0 1" in p.stdout
    assert boot(str(s), "code").returncode == 0
    m = boot("-m", "platform", "--terse")
    assert m.returncode == 0 and m.stdout.strip()


def test_failures_are_reported_with_host_rank_and_first_lines(tmp_path: Path):
    s = tmp_path / "s.py"
    s.write_text(SCRIPT)
    p = boot(str(s), "raise")
    assert p.returncode == 1
    assert "cudampi/launch/rank.py" not in p.stderr.split("[cudampi-fault")[0]  # user frames only
    (rep,) = parse_reports(p.stderr.splitlines(), TOKEN)
    assert (rep.host, rep.rank, rep.code) == (socket.gethostname(), 0, 1)
    assert rep.lines[0] == "KeyError: 'missing weights'"
    assert rep.lines[1].endswith("in deep")
    p = boot(str(s), "exit")
    (rep,) = parse_reports(p.stderr.splitlines(), TOKEN)
    assert p.returncode == 1 and rep.lines == ("SystemExit: bad config",)
    assert p.stderr.split("started]\n", 1)[1].startswith("bad config\n")  # as python prints it
    assert boot().returncode == 2


def test_the_rank_says_it_started_and_hides_the_token(tmp_path: Path):
    s = tmp_path / "s.py"
    s.write_text("import os\nprint('token seen:', os.environ.get('CUDAMPI_REPORT_TOKEN'))\n")
    p = boot(str(s))
    assert p.returncode == 0 and "token seen: None" in p.stdout
    assert parse_started(p.stderr.splitlines(), TOKEN) == {0}
    # run by hand (no token): no started line, and its report is for a person, not a supervisor
    p = boot(str(s), token="")
    assert p.stderr == "" and "token seen: None" in p.stdout


def test_the_rank_says_exiting_after_every_other_atexit_handler(tmp_path: Path):
    """ "finished" when the script ends, "exiting" once Python's exit handlers (the script's
    own, registered after the bootstrap's) have run: a rank that then does not end is past
    them (MPI_Finalize, teardown), not in them."""
    s = tmp_path / "s.py"
    s.write_text(
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('handler ran', file=sys.stderr, flush=True))\n"
        "threading.Thread(target=time.sleep, args=(0.3,)).start()\n"
    )
    p = boot(str(s))
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert parse_started(lines, TOKEN, "finished") == {0}
    assert parse_started(lines, TOKEN, "exiting") == {0}
    order = [ln for ln in lines if ln == "handler ran" or ln.endswith(("finished]", "exiting]"))]
    assert [o.split()[-1] for o in order] == ["finished]", "ran", "exiting]"]
    # a failed script says neither
    s.write_text("raise SystemExit(3)\n")
    p = boot(str(s))
    assert p.returncode == 3
    assert not parse_started(p.stderr.splitlines(), TOKEN, "exiting")
