"""Podman for the container tests, and the image built from what ``cudampi env write`` generates.

No image registry is reachable here, so the base is made locally: ``mmdebstrap`` writes a minimal
Debian 12 (its python3 is 3.11: the spec's Python and that of the local CPU torch wheel), and
``podman import`` makes it an image. The image is then built from the folder
``cudampi env write --cuda cpu`` writes (CPU torch; the folder is the build context, cudampi's
wheel bundled in it), through the Dockerfile's own ``BASE_IMAGE`` and ``PIP_CONFIG_FILE`` build
arguments; the site's pip settings (the host's CA bundle, which the registry's TLS needs, and a
folder holding the CPU torch wheel) are mounted at ``/mnt`` for the build only.

podman runs with a store of its own (nothing of the machine's other podman work is touched, and
everything goes at the end) and with runc, which starts containers here where crun does not
(cgroups v1; setrlimit refused) once podman sets no default ulimits. ``CUDAMPI_TEST_PODMAN_ROOT``
names a store to keep instead: the base and the image are then reused while their inputs are
unchanged (their tags are content hashes).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB_DIR = Path(__file__).resolve().parent
SUITE = "bookworm"
BASE_PACKAGES = "python3,python3-venv,python-is-python3,ca-certificates"
TORCH = "2.13.0"
"""The CPU wheel (torch==2.13.0+cpu) that pip finds on this machine; PyPI's 2.13.0 is CUDA."""
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
KEEP = "CUDAMPI_TEST_PODMAN_ROOT"

CONTAINERS_CONF = """\
# crun cannot start a container here (cgroups v1; setrlimit refused); runc can, once podman
# sets no default ulimits.
[containers]
default_ulimits = []

[engine]
runtime = "runc"
"""

PIP_CONF = """\
[global]
cert = /mnt/ca.crt
find-links = /mnt/wheels
# requirements.txt names PyTorch's CPU index, which does not resolve here: fail over fast.
retries = 1
"""

REPORT: dict[str, str] = {}
"""What the tier measured (build time, image size, each mode's time): the summary prints it."""


def why_skip() -> str | None:
    if os.geteuid() != 0:
        return "needs root (rootful podman, a bridge network)"
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"needs {tool}: apt-get install podman runc mmdebstrap uidmap (.ci/run does)"
    return None


def note(key: str, value: str) -> None:
    REPORT[key] = value
    sys.stderr.write(f"container tier: {key}: {value}\n")


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:12]


class Podman:
    """``podman`` with this tier's store and configuration: ``p("run", ...)``."""

    def __init__(self, work: Path) -> None:
        kept = os.environ.get(KEEP)
        self.kept = bool(kept)
        self.work = work
        self.root = Path(kept) if kept else work / "store"
        # conmon's sockets live under the run root: keep its path short (sun_path: 108 bytes).
        self.run_root = Path("/run") / f"cudampi-podman-{_digest(str(self.root).encode())}"
        self.conf = work / "containers.conf"
        self.conf.write_text(CONTAINERS_CONF)
        self.tag = f"cmt{os.getpid() % 100000}"
        self.networks: list[str] = []

    def argv(self, *args: str) -> list[str]:
        return [
            "podman",
            "--root",
            str(self.root),
            "--runroot",
            str(self.run_root),
            "--tmpdir",
            str(self.run_root / "libpod"),
            *args,
        ]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.conf)}

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        try:
            p = subprocess.run(
                self.argv(*args), capture_output=True, text=True, timeout=timeout, env=self.env
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"podman {' '.join(args)} ran over {timeout} s\nstdout:\n{exc.stdout}\n"
                f"stderr:\n{exc.stderr}"
            ) from None
        if check and p.returncode != 0:
            raise AssertionError(
                f"podman {' '.join(args)} exited {p.returncode}\nstdout:\n{p.stdout[-6000:]}\n"
                f"stderr:\n{p.stderr[-6000:]}"
            )
        return p

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )

    def has_image(self, image: str) -> bool:
        return self("image", "exists", image, check=False).returncode == 0

    def image_size(self, image: str) -> int:
        return int(self("image", "inspect", "--format", "{{.Size}}", image).stdout)

    def network(self, name: str) -> Subnet:
        """A bridge network of this machine that reaches nothing outside (``--internal``)."""
        self("network", "create", "--internal", name)
        self.networks.append(name)
        info = json.loads(self("network", "inspect", name).stdout)[0]
        return Subnet(name, ipaddress.ip_network(info["subnets"][0]["subnet"]))

    def remove(self, *containers: str) -> None:
        if containers:
            self("rm", "--force", "--time", "0", *containers, check=False)

    def down(self) -> None:
        """Every container and network of this run; the store too unless it is kept."""
        mine = self("ps", "--all", "--quiet", "--filter", f"name=^{self.tag}-", check=False)
        self.remove(*mine.stdout.split())
        for net in self.networks:
            self("network", "rm", "--force", net, check=False)
        if self.kept:
            return
        self("rm", "--all", "--force", "--time", "0", check=False)
        self("rmi", "--all", "--force", check=False)
        # containers/storage may leave its overlay folder mounted (a private bind mount).
        for target in sorted(_mounts_under(self.root, self.run_root), reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True)
        for d in (self.root, self.run_root, self.work / "site", self.work / "image"):
            shutil.rmtree(d, ignore_errors=True)


def _mounts_under(*dirs: Path) -> Iterator[str]:
    prefixes = tuple(str(d) for d in dirs)
    with open("/proc/self/mounts") as f:
        for line in f:
            target = line.split()[1]
            if target.startswith(prefixes):
                yield target


@dataclass(frozen=True)
class Subnet:
    name: str
    net: ipaddress.IPv4Network | ipaddress.IPv6Network

    def address(self, i: int) -> str:
        """The i-th container's address (.2, .3, ...: .1 is the bridge's gateway)."""
        return str(self.net.network_address + 1 + i)


@dataclass(frozen=True)
class Built:
    image: str
    seconds: float | None
    """None: reused from a kept store."""
    size: int


def _mb(size: int) -> str:
    return f"{size / 1e6:,.0f} MB"


def make_base(p: Podman) -> Built:
    """Debian 12 minbase with python3 and venv, imported as an image."""
    tag = f"localhost/cudampi-test-base:{SUITE}-{_digest(SUITE.encode(), BASE_PACKAGES.encode())}"
    if p.has_image(tag):
        return Built(tag, None, p.image_size(tag))
    tar = p.work / "rootfs.tar"
    start = time.monotonic()
    made = subprocess.run(
        ["mmdebstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", SUITE, str(tar)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert made.returncode == 0, f"mmdebstrap failed:\n{made.stderr[-4000:]}"
    p("import", "--quiet", str(tar), tag)
    tar.unlink()
    built = Built(tag, time.monotonic() - start, p.image_size(tag))
    note("base image", f"{tag}: {_mb(built.size)}, made in {built.seconds:.0f} s (mmdebstrap)")
    return built


def _content(path: Path) -> bytes:
    """What a file holds; for a wheel, its members (a rebuilt wheel differs in timestamps only)."""
    if path.suffix != ".whl":
        return path.read_bytes()
    with zipfile.ZipFile(path) as z:
        return b"".join(n.encode() + z.read(n) for n in sorted(z.namelist()))


def make_site(work: Path, python: str) -> Path:
    """The site's pip settings for the build: the host's CA bundle and the local CPU torch."""
    site = work / "site"
    wheels = site / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    (site / "pip.conf").write_text(PIP_CONF)
    shutil.copy(HOST_CA, site / "ca.crt")
    # Wherever this machine's pip takes torch from (a local wheel folder here), for the image's
    # Python: the base's python3 must be the version of the wheel.
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--platform",
            "manylinux_2_28_x86_64",
            "-d",
            str(wheels),
            f"torch=={TORCH}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert got.returncode == 0, f"pip download torch=={TORCH} failed:\n{got.stderr[-3000:]}"
    found = [w.name for w in wheels.glob("torch-*.whl")]
    assert any("+cpu" in w for w in found), f"no CPU torch wheel for Python {python}: {found}"
    return site


def build_image(p: Podman, base: Built) -> tuple[Built, Path]:
    """Generate the CPU flavour with the real CLI, then build the folder it wrote; returns the
    image and the folder."""
    out = p.work / "image"
    shutil.rmtree(out, ignore_errors=True)
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "cudampi",
            "env",
            "write",
            "--out",
            str(out),
            "--cuda",
            "cpu",
            "--torch",
            TORCH,
            "--lock",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert gen.returncode == 0, f"cudampi env write failed:\n{gen.stdout}\n{gen.stderr}"
    spec = json.loads(gen.stdout)["spec"]
    files = sorted(f for f in out.rglob("*") if f.is_file())
    key = _digest(
        base.image.encode(), *(str(f.relative_to(out)).encode() + _content(f) for f in files)
    )
    tag = f"localhost/cudampi-test:{key}"
    if p.has_image(tag):
        return Built(tag, None, p.image_size(tag)), out
    site = make_site(p.work, spec["python"])
    start = time.monotonic()
    p(
        "build",
        "--format",
        "docker",  # OCI images have no HEALTHCHECK
        "--tag",
        tag,
        "--build-arg",
        f"BASE_IMAGE={base.image}",
        "--build-arg",
        "PIP_CONFIG_FILE=/mnt/pip.conf",
        "--volume",
        f"{site}:/mnt:ro",
        str(out),  # the folder is the build context
        timeout=1200,
    )
    built = Built(tag, time.monotonic() - start, p.image_size(tag))
    note("image", f"{tag}: {_mb(built.size)}, built in {built.seconds:.0f} s")
    return built, out
