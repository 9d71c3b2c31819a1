"""Does a change of the ipc kernels' source change the code they compile to? No GPU needed.

    python tools/kernel-sass-diff.py [REV] [--arch sm_80,sm_90]

Compiles kernels.cu as at git revision REV (default HEAD) and as in the working tree with NVRTC
(CuPy's binding, as the engine does), every kernel that ``tests/unit/test_ipc_kernels.py``
compiles (each element kind, op family and rank count that changes the code), and compares each
kernel's machine code (the cubin's ``.text.<kernel>`` section) between the two. A refactor whose
kernels all come out byte for byte the same needs no GPU run to trust it; one that changes any
is listed with how many instructions differ, and then needs the GPU suite
(``tools/gpu-session.sh verify``) and a benchmark. Exit status 0: all identical; 1: some differ.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.unit.test_ipc_kernels import names  # noqa: E402

from cudampi.comm.ipc import layout as L  # noqa: E402

KERNELS = "src/cudampi/comm/ipc/kernels.cu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", nargs="?", default="HEAD", help="the git revision to compare with")
    ap.add_argument("--arch", default="sm_80,sm_90", help="architectures, comma-separated")
    a = ap.parse_args()
    before = subprocess.run(
        ["git", "show", f"{a.rev}:{KERNELS}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    now = (ROOT / KERNELS).read_text()
    wanted = names()
    differ = 0
    for arch in a.arch.split(","):
        old = L.kernel_code(L.compile_cubin(wanted, arch, before))
        new = L.kernel_code(L.compile_cubin(wanted, arch, now))
        same = 0
        for kernel in sorted(old.keys() | new.keys()):
            x, y = old.get(kernel), new.get(kernel)
            if x == y:
                same += 1
                continue
            differ += 1
            if x is None or y is None:
                print(f"{arch}  {kernel}: only {'now' if x is None else a.rev}")
                continue
            insts = {i // 16 for i in range(min(len(x), len(y))) if x[i] != y[i]}
            print(
                f"{arch}  {kernel}: {len(x) // 16} -> {len(y) // 16} instructions, "
                f"{len(insts)} differ"
            )
        print(f"{arch}: {same} of {len(old.keys() | new.keys())} kernels identical to {a.rev}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
