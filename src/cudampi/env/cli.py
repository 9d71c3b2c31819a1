"""``cudampi env``: write the files that rebuild the stack, list and check the settings.

cudampi env write [--spec env.toml] [--out DIR] [--cuda 13.0 --torch 2.11.0 --mpi openmpi ...]
cudampi env write --check --out docker      # exit 1 if any file is out of date
cudampi env lock --spec docker/env.toml --out docker   # hash lock via pip's resolver
cudampi env show [--json]                   # the resolved description
cudampi env settings [--json]               # the documented Open MPI / UCX / NCCL settings
cudampi env check [--json] [--single-node]  # check this shell's environment
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from cudampi.errors import EnvGenError

SPEC_FLAGS = {
    # flag: (spec key, type, help)
    "--name": ("name", str, "job / environment name (a DNS label)"),
    "--python": ("python", str, "Python version, e.g. 3.11"),
    "--cuda": ("cuda", str, "CUDA version: 12.6, 12.8, 12.9, 13.0, or cpu (none)"),
    "--torch": ("torch", str, "exact torch version, e.g. 2.11.0"),
    "--mpi": ("mpi", str, "MPI flavour: openmpi or mpich"),
    "--mpi-version": ("mpi_version", str, "exact version of the MPI wheel"),
    "--extras": ("extras", str, "comma-separated extras: cupy, jupyter, plot ('' for none)"),
    "--nodes": ("nodes", int, "nodes of the Slurm / Kubernetes job"),
    "--gpus-per-node": ("gpus_per_node", int, "GPUs per node"),
    "--ranks-per-node": ("ranks_per_node", int, "ranks per node (default: one per GPU)"),
    "--cpus-per-task": ("cpus_per_task", int, "CPU cores per rank"),
    "--image": ("image", str, "image name:tag the Dockerfile builds and the jobs run"),
    "--partition": ("partition", str, "Slurm partition"),
    "--time": ("time_limit", str, "Slurm time limit [days-]HH:MM:SS"),
    "--source": (
        "source",
        str,
        "where the files install cudampi from: a requirement, URL or path (relative to --out); "
        "default: this cudampi, bundled into --out as its wheel",
    ),
}


def _add_spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec", metavar="FILE", help="description file (.toml, .yaml); flags override it"
    )
    for flag, (key, typ, help_text) in SPEC_FLAGS.items():
        p.add_argument(flag, dest=f"spec_{key}", type=typ, default=None, help=help_text)
    p.add_argument(
        "--command",
        dest="spec_command",
        nargs="+",
        default=None,
        help="the training command (argv) that MODE=train, srun and mpirun run",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="env_action", metavar="ACTION")
    w = sub.add_parser(
        "write", help="write environment.yml, requirements, Dockerfile, sbatch, MPIJob"
    )
    _add_spec_flags(w)
    w.add_argument("--out", default="cudampi-env", help="output folder (default: ./cudampi-env)")
    w.add_argument(
        "--only", default=None, help="comma-separated targets: spec, conda, pip, docker, slurm, k8s"
    )
    w.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a file differs from what would be written",
    )
    w.add_argument(
        "--lock",
        action="store_true",
        help="also (re)resolve requirements.lock with pip (needs the package index)",
    )
    w.add_argument("--json", action="store_true", help="report as JSON")
    lk = sub.add_parser("lock", help="resolve requirements.lock (exact files + sha256) with pip")
    _add_spec_flags(lk)
    lk.add_argument("--out", default="cudampi-env", help="folder of requirements.lock")
    lk.add_argument("--json", action="store_true", help="report as JSON")
    sh = sub.add_parser("show", help="print the resolved description")
    _add_spec_flags(sh)
    sh.add_argument("--json", action="store_true", help="as JSON (default: TOML)")
    st = sub.add_parser("settings", help="the recommended Open MPI / UCX / NCCL settings and why")
    st.add_argument("--json", action="store_true", help="as JSON")
    ck = sub.add_parser("check", help="check this environment's MPI/UCX/NCCL variables")
    ck.add_argument("--single-node", action="store_true", help="the job runs on one node")
    ck.add_argument("--multi-node", action="store_true", help="the job spans nodes")
    ck.add_argument("--cpu", action="store_true", help="no GPUs: host buffers only")
    ck.add_argument("--json", action="store_true", help="as JSON")


def _spec(args: argparse.Namespace) -> Any:
    from cudampi.env.spec import load_spec

    overrides = {k[len("spec_") :]: v for k, v in vars(args).items() if k.startswith("spec_")}
    return load_spec(args.spec, overrides)


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "env_action", None)
    if action is None:
        print(
            "cudampi env: choose an action: write, lock, show, settings, check "
            "(cudampi env --help)",
            file=sys.stderr,
        )
        return 2
    try:
        return int(
            {"write": _write, "lock": _lock, "show": _show, "settings": _settings, "check": _check}[
                action
            ](args)
        )
    except EnvGenError as exc:
        from cudampi.env.spec import SpecError

        print(f"cudampi env {action}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SpecError) else 1


def _write(args: argparse.Namespace) -> int:
    """Write the files; the folder must work on its own wherever it is moved, so the lock
    install.sh and the Dockerfile need is resolved when missing or stale, and cudampi's own
    wheel is bundled (exit 1 with the fix when either cannot be made)."""
    from cudampi.env import source
    from cudampi.env.files import (
        LOCK,
        TARGETS,
        generate,
        lock_status,
        validate_generated,
        write_files,
    )
    from cudampi.env.pip import resolve_lock

    spec = _spec(args)
    targets = tuple(t.strip() for t in args.only.split(",")) if args.only else TARGETS
    out = Path(args.out)
    files = generate(spec, targets, out)
    validated = validate_generated(files)
    lock_path = out / LOCK
    needs_lock = any(t in targets for t in ("pip", "docker"))
    lock_text = lock_path.read_text() if lock_path.exists() else None
    status = lock_status(spec, lock_text) if needs_lock else "not needed"
    problems: list[str] = []
    if needs_lock and not args.check and (args.lock or status != "ok"):
        try:
            files[LOCK] = resolve_lock(spec)
            status = "ok (resolved)"
        except EnvGenError as exc:
            problems.append(
                f"{lock_path}: {status}, and it could not be resolved: {exc}\n  fix: run "
                f"`cudampi env lock --spec {out / 'env.toml'} --out {out}` where the package "
                "index is reachable (install.sh and the Dockerfile need it)"
            )
    needs_wheel = any(t in targets for t in ("conda", "pip", "docker", "slurm"))
    bundle = source.bundle_status(spec, out) if needs_wheel else "not needed"
    results = write_files(files, out, check=args.check)
    if bundle != "not needed" and not args.check:
        try:
            bundle = "ok (" + source.write_bundle(out) + ")"
        except EnvGenError as exc:
            problems.append(f"{out / source.WHEEL}: {exc}")
            bundle = "missing"
    changed = [r.name for r in results if r.changed]
    lock_bad = needs_lock and not status.startswith("ok")
    wheel_bad = bundle == "missing"
    if args.json:
        print(
            json.dumps(
                {
                    "out": str(out),
                    "spec": spec.as_dict(),
                    "lock": status,
                    "wheel": bundle,
                    "validated": validated,
                    "files": [dataclasses.asdict(r) for r in results],
                    "problems": problems,
                },
                indent=2,
            )
        )
    else:
        verb = "differs" if args.check else "written"
        for r in results:
            mark = verb if r.changed else "up to date"
            print(f"{out / r.name}: {mark}")
        if needs_lock:
            print(f"{lock_path}: {status}")
        if bundle != "not needed":
            print(f"{out / source.WHEEL}: {bundle}")
    for problem in problems:
        print(f"cudampi env write: {problem}", file=sys.stderr)
    if args.check and lock_bad:
        print(f"  fix: cudampi env lock --spec {out / 'env.toml'} --out {out}", file=sys.stderr)
    if args.check and wheel_bad:
        print(f"  fix: cudampi env write --spec {out / 'env.toml'} --out {out}", file=sys.stderr)
    if args.check:
        return 1 if changed or lock_bad or wheel_bad else 0
    return 1 if problems else 0


def _lock(args: argparse.Namespace) -> int:
    from cudampi.env.files import LOCK, write_files
    from cudampi.env.pip import resolve_lock

    spec = _spec(args)
    text = resolve_lock(spec)
    results = write_files({LOCK: text}, args.out)
    if args.json:
        print(json.dumps({"file": str(Path(args.out) / LOCK), "changed": results[0].changed}))
    else:
        print(f"{Path(args.out) / LOCK}: {'written' if results[0].changed else 'up to date'}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from cudampi.env.spec import spec_to_toml

    spec = _spec(args)
    print(
        json.dumps(spec.as_dict(), indent=2) if args.json else spec_to_toml(spec),
        end="\n" if args.json else "",
    )
    return 0


def _settings(args: argparse.Namespace) -> int:
    from cudampi.env.recommended import SETTINGS

    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in SETTINGS], indent=2))
        return 0
    for s in SETTINGS:
        kind = "" if s.kind == "env" else f" [{s.kind} flag]"
        print(f"{s.name}={s.value}{kind}  ({', '.join(s.applies_to)}; when: {s.when})")
        print(f"    why: {s.reason}")
        print(f"    source: {s.source}")
    return 0


def _loaded_library_facts() -> dict[str, Any]:
    """What the settings rules need to know of the MPI mpi4py loads here (its build decides
    whether e.g. a CUDA switch is fatal); nothing when there is none or it cannot say."""
    from cudampi.env.settings import library_facts
    from cudampi.probe.mpi_library import query_build, query_mpi_library

    library = query_mpi_library(sys.executable)
    ompi, _mpich, _why = query_build(library)
    return library_facts(ompi)


def _check(args: argparse.Namespace) -> int:
    from cudampi.env.settings import check_settings

    if args.single_node and args.multi_node:
        from cudampi.env.spec import SpecError

        raise SpecError("--single-node and --multi-node contradict each other: give one")
    multi = True if args.multi_node else False if args.single_node else None
    from cudampi.probe.interfaces import query_interfaces

    findings = check_settings(
        os.environ,
        gpus=not args.cpu,
        multi_node=multi,
        interfaces=query_interfaces() or None,
        **_loaded_library_facts(),
    )
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            print(f"[{f.status}] {f.name}={f.value}: {f.detail}\n    fix: {f.fix}")
        print(
            f"{len(findings)} problem(s) in this environment's MPI/UCX/NCCL settings"
            if findings
            else "no known-wrong MPI/UCX/NCCL settings in this environment"
        )
    return 1 if any(f.status == "fail" for f in findings) else 0
