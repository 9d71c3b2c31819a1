"""Which MPI the ranks of a non-MPI launcher load (cudampi.pmi.mpich), and the doctor's line
saying so for each launcher."""

from __future__ import annotations

from cudampi.doctor.checks_launch import check_launcher_mpis
from cudampi.names import OPEN_MPI
from cudampi.pmi import mpich
from cudampi.probe.mpi_library import MpiLibrary


def test_the_users_library_then_cudampis_mpich_then_mpi4pys_default(tmp_path):
    where = str(tmp_path / "p")
    assert mpich.prefix(str(tmp_path)) == str(tmp_path / "opt" / "cudampi-mpich")
    assert mpich.choose({"MPI4PY_LIBMPI": "/x/libmpi.so.12"}, where).path == "/x/libmpi.so.12"
    none = mpich.choose({}, where)
    assert none.path is None and "not installed" in none.why
    (tmp_path / "p" / "lib").mkdir(parents=True)
    (tmp_path / "p" / "lib" / "libmpi.so.12").write_bytes(b"")
    env: dict[str, str] = {}
    got = mpich.select(env, where)
    assert got.path == env["MPI4PY_LIBMPI"] == mpich.library(where)
    cmd = mpich.install_command(where)
    assert cmd[-1] == "mpich" and cmd[cmd.index("--prefix") + 1] == where


def test_the_doctor_names_each_launchers_mpi_and_the_cost():
    lib = MpiLibrary(python="python", vendor=OPEN_MPI, version="5.0.11")
    none = check_launcher_mpis(lib, mpich.Choice(None, "not installed"), "")
    assert "cannot join" in none.detail and mpich.INSTALL in none.fix
    theirs = check_launcher_mpis(lib, mpich.Choice("/v/libmpi.so.12", "cudampi's own"), "MPICH")
    assert theirs.status == "ok" and "torchrun and the like: MPICH" in theirs.detail
    assert "staged through host memory" in theirs.detail
    assert "across nodes too" in theirs.detail
