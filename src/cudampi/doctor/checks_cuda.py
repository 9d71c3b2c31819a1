"""The doctor's CUDA-awareness checks: the MPI build, UCX's transports, the device probes, the ipc engine,
silent host staging and the verdict (read as the communicators read the probe). Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cudampi.doctor import fixes
from cudampi.doctor.checks_mpi import lib_label
from cudampi.doctor.report import CUDA, Check
from cudampi.probe.capabilities import ProbeOutcome
from cudampi.probe.mpi_library import MpiLibrary
from cudampi.probe.mpich import MpichInfo
from cudampi.probe.ompi import OmpiInfo
from cudampi.probe.runtime import ProbeRun, staging_verdict
from cudampi.probe.ucx import UcxInstall


def check_cuda_build(
    lib: MpiLibrary,
    ompi: OmpiInfo | None,
    mpich: MpichInfo | None,
    mpix_value: int | None = None,
    build_error: str | None = None,
) -> Check:
    """Signal 1 of 3: was the MPI library built with CUDA?"""
    if not lib.ok:
        return Check("CUDA build", "n/a", "no MPI library", "", CUDA)
    signals: list[str] = []
    verdict: bool | None = None
    if ompi is not None:
        if ompi.built_with_cuda is not None:
            signals.append(f"built_with_cuda_support={str(ompi.built_with_cuda).lower()}")
        if ompi.accelerators:
            signals.append(f"accelerator components: {', '.join(ompi.accelerators)}")
        if ompi.configured_without_cuda:
            signals.append("configured --without-cuda")
        if "smcuda" in ompi.btl:
            signals.append("btl smcuda present")
        verdict = ompi.cuda_build
    if mpich is not None:
        signals.append(f"device {mpich.device}")
        if mpich.configure is not None:
            signals.append(
                "configured with CUDA" if mpich.gpu_support else "configured without CUDA"
            )
        verdict = mpich.gpu_support
    if lib.mpix_query_cuda_support is not None:
        signals.append(
            "exports MPIX_Query_cuda_support"
            if lib.mpix_query_cuda_support
            else "no MPIX_Query_cuda_support symbol"
        )
    if mpix_value is not None:
        signals.append(f"MPIX_Query_cuda_support()={mpix_value} in a rank")
        if mpix_value == 1:
            verdict = True if verdict is None else verdict
    if build_error:
        signals.append(build_error)
    detail = f"{lib_label(lib)}: " + ("; ".join(signals) if signals else "no build information")
    if (
        verdict is True
        and ompi is not None
        and ompi.cuda_support_enabled is False
        and (ompi.version or lib.version or "").startswith("4.")
    ):
        # conda-forge's Open MPI 4.1 is built with CUDA but ships it switched off
        return Check(
            "CUDA build",
            "warn",
            detail + "; but opal_cuda_support=false: CUDA support is switched off at run time",
            "export OMPI_MCA_opal_cuda_support=true (or mpirun --mca opal_cuda_support 1)",
            CUDA,
        )
    if verdict is True:
        return Check("CUDA build", "ok", detail, "", CUDA)
    if verdict is False:
        return Check(
            "CUDA build",
            "warn",
            detail + " -> not built with CUDA",
            "see the CUDA-aware MPI check for the three ways to a CUDA-aware stack",
            CUDA,
        )
    return Check(
        "CUDA build",
        "warn",
        detail + " -> unknown",
        "run without --no-runtime: the runtime probe decides",
        CUDA,
    )


def _stack_uses_ucx(ranks_env: Mapping[str, str], ucx_package: str | None) -> bool:
    return ranks_env.get("OMPI_MCA_pml", "") == "ucx" or ucx_package is not None


def check_ucx(
    installs: Sequence[UcxInstall],
    ucx_package: str | None,
    ranks_env: Mapping[str, str],
    gpus_present: bool,
) -> Check:
    """Signal 2 of 3: does the UCX the stack would use have CUDA transports?"""
    if not installs:
        return Check(
            "UCX transports",
            "n/a",
            "no UCX found (no libucx package, no ucx_info, no UCX inside the MPI)",
            "for device p2p with Open MPI: " + fixes.PYPI_UCX,
            CUDA,
        )
    rows: list[str] = []
    any_cuda = False
    built_cuda = False
    for inst in installs:
        if inst.transports is not None:
            cuda = inst.transports.cuda
            any_cuda = any_cuda or bool(cuda)
            ver = inst.version.version if inst.version else "?"
            text = (
                f"{inst.source} UCX {ver}: transports "
                f"{', '.join(sorted(inst.transports.transports)) or 'none'}"
            )
            if not cuda and inst.has_cuda_module:
                built_cuda = True
                text += (
                    " (built with CUDA, but cuda_copy/cuda_ipc not loaded: no GPU/driver visible)"
                )
        else:
            text = f"{inst.source} UCX modules: {', '.join(inst.modules) or 'none'}"
            if inst.error:
                text += f" ({inst.error})"
            built_cuda = built_cuda or inst.has_cuda_module
        rows.append(text)
    used = (
        "preloaded with LD_PRELOAD"
        if ucx_package
        else (
            "pml ucx selected"
            if _stack_uses_ucx(ranks_env, ucx_package)
            else "not selected (no --mca pml ucx)"
        )
    )
    detail = "; ".join(rows) + f" [stack: {used}]"
    if any_cuda:
        gdr = any(i.transports and "gdr_copy" in i.transports.transports for i in installs)
        note = (
            "" if gdr else " (no gdr_copy: inter-node GPUDirect RDMA copies go through cuda_copy)"
        )
        if not _stack_uses_ucx(ranks_env, ucx_package):
            return Check(
                "UCX transports",
                "warn",
                detail + note,
                "the CUDA UCX is there but the stack does not use it: add --preload-ucx "
                "(doctor) / the LD_PRELOAD + --mca pml ucx recipe (launch)",
                CUDA,
            )
        return Check("UCX transports", "ok", detail + note, "", CUDA)
    if built_cuda and not gpus_present:
        return Check("UCX transports", "n/a", detail, "", CUDA)
    if built_cuda:
        return Check(
            "UCX transports",
            "warn",
            detail + " -> a cuda module is installed but no ucx_info lists its transports here",
            "the runtime device p2p row decides; to see the transports: ucx_info -d | grep Transport",
            CUDA,
        )
    return Check(
        "UCX transports",
        "warn",
        detail + " -> no CUDA transports",
        "for device point-to-point: " + fixes.PYPI_UCX,
        CUDA,
    )


def check_device_probe(name: str, test: str, outcome: ProbeOutcome, run: ProbeRun | None) -> Check:
    if outcome.status == "skipped":
        return Check(name, "n/a", outcome.detail, "", CUDA)
    rate = f", {outcome.gbps:.1f} GB/s" if outcome.gbps else ""
    if outcome.ok:
        return Check(name, "ok", f"correct data{rate}", "", CUDA)
    if test == "device_p2p":
        fix = "device point-to-point needs a CUDA-aware path: " + fixes.PYPI_UCX
    elif test == "device_allreduce":
        fix = (
            "MPI's own collectives cannot take device buffers on this stack: cudampi uses its "
            "gpu-ring path (device p2p) or the staged path automatically; for torch use NCCL"
        )
    else:
        fix = "host staging itself failed: check the GPU and the host probes"
    argv = f" [argv: {' '.join(run.argv)}]" if run else ""
    # MPI's own device collectives failing is expected even on CUDA-aware stacks (Open MPI
    # reduces on the CPU): cudampi does not need them, so it warns; broken device p2p or
    # broken host staging leave no fast path and fail.
    status = "warn" if test == "device_allreduce" else "fail"
    return Check(name, status, f"{outcome.status}: {outcome.detail}{argv}", fix, CUDA)


def check_ipc(outcome: ProbeOutcome, run: ProbeRun | None, mps: bool) -> Check:
    """cudampi's ipc engine (GPU kernels over CUDA IPC; MPI only on the host): correct data,
    its 4 KiB latency and bandwidth, and whether `auto` takes it here (ranks sharing a GPU take
    it only under the MPS daemon: without it their contexts time-slice and it loses)."""
    from cudampi.comm.paths import mpi_support, verdicts
    from cudampi.config import Config
    from cudampi.probe.capabilities import Capabilities

    name = "ipc engine"
    if outcome.status == "skipped":
        fix = "pip install 'cudampi[cu13]' (or [cu12])" if "CuPy" in outcome.detail else ""
        return Check(name, "n/a", outcome.detail, fix, CUDA)
    rep = (run.report if run is not None else None) or {}
    shared = rep.get("shared_gpu")
    if not outcome.ok:
        return _engine_failed(
            name,
            outcome,
            run,
            "cudampi runs device collectives on gpu-ring or staged instead; rerun the argv to "
            "see the whole output (CuPy and NVRTC must be importable: 'cudampi[cu13]')",
        )
    facts = _engine_facts(outcome, run)
    facts.append(
        ("ranks shared one GPU" if shared else "one GPU per rank")
        + (", MPS on" if rep.get("mps") else ", MPS off")
    )
    caps = Capabilities(
        "", "", device_ipc=outcome, ipc_shared_gpu=shared if isinstance(shared, bool) else None
    )
    cfg = Config.load({}, env={})
    v = verdicts(cfg, caps, mpi_support(cfg, caps), mps)[0]["ipc"]
    taken, why = v.ok, v.why
    if taken:
        return Check(name, "ok", f"{'; '.join(facts)}: auto takes it", "", CUDA)
    return Check(
        name,
        "warn",
        f"{'; '.join(facts)}: auto does not take it ({why})",
        "start the MPS daemon (nvidia-cuda-mps-control -d) before the job, or give each rank "
        "its own GPU",
        CUDA,
    )


def check_nccl_engine(
    caps_support: tuple[bool, str, tuple[int, int]], outcome: ProbeOutcome, run: ProbeRun | None
) -> Check:
    """cudampi's nccl engine (NCCL bootstrapped over MPI, a GPU per rank): correct data, its
    4 KiB latency and bandwidth, and the sizes where auto takes it over ipc
    (``caps_support``: :func:`cudampi.comm.paths.verdicts` of this host's probe)."""
    name = "nccl engine"
    if outcome.status == "skipped":
        no_lib = "finds no NCCL library" in outcome.detail
        fix = "pip install nvidia-nccl-cu13 (or -cu12)" if no_lib else ""
        return Check(name, "n/a", outcome.detail, fix, CUDA)
    if not outcome.ok:
        return _engine_failed(
            name,
            outcome,
            run,
            "auto keeps ipc (or gpu-ring); rerun the argv to see the whole output, and check "
            "the NCCL_* settings above",
        )
    taken, why, _ = caps_support
    verdict = why if taken else f"auto does not take it ({why})"
    return Check(name, "ok", f"{'; '.join(_engine_facts(outcome, run))}: {verdict}", "", CUDA)


def _engine_failed(name: str, outcome: ProbeOutcome, run: ProbeRun | None, fix: str) -> Check:
    """The row of a cudampi engine whose probe job failed: what happened and its argv."""
    argv = f" [argv: {' '.join(run.argv)}]" if run else ""
    return Check(name, "warn", f"{outcome.status}: {outcome.detail}{argv}", fix, CUDA)


def _engine_facts(outcome: ProbeOutcome, run: ProbeRun | None) -> list[str]:
    """What an engine's passing probe job measured: its 4 KiB latency and its bandwidth."""
    latency = ((run.report if run is not None else None) or {}).get("latency_us")
    facts = [f"correct data, {latency:.0f} us per 4 KiB allreduce" if latency else "correct data"]
    if outcome.gbps:
        facts.append(f"{outcome.gbps:.1f} GB/s")
    return facts


def check_silent_staging(p2p: ProbeOutcome, copy: ProbeRun | None) -> Check:
    """Device p2p no faster than one pinned host<->device copy means it goes through host memory."""
    if p2p.status == "skipped":
        return Check("silent host staging", "n/a", f"no device probe ran: {p2p.detail}", "", CUDA)
    if not p2p.ok:
        return Check("silent host staging", "n/a", "device p2p did not run correctly", "", CUDA)
    if copy is None or not copy.outcome.ok:
        why = copy.outcome.detail if copy else "copy-rate test not run"
        return Check("silent host staging", "n/a", f"no copy rate to compare with: {why}", "", CUDA)
    rep = copy.report or {}
    copy_gbps = copy.outcome.gbps
    verdict = staging_verdict(p2p.gbps, copy_gbps)
    detail = (
        f"device p2p {p2p.gbps or 0:.1f} GB/s vs pinned copy D2H {rep.get('d2h_gbps', 0):.1f} / "
        f"H2D {rep.get('h2d_gbps', 0):.1f} GB/s"
    )
    if verdict:
        return Check(
            "silent host staging",
            "warn",
            detail
            + ": device p2p is no faster than a host copy, so it is staged through host memory",
            "a direct path needs UCX cuda_ipc (same node) or GPUDirect RDMA (nvidia_peermem, "
            "across nodes): " + fixes.PYPI_UCX,
            CUDA,
        )
    return Check("silent host staging", "ok", detail + ": direct device path", "", CUDA)


def check_cuda_aware(
    build: Check, ucx: Check, p2p: ProbeOutcome, allreduce: ProbeOutcome, runtime_ran: bool
) -> Check:
    """The verdict from the three independent signals; what the runtime probes allow is read as
    the communicators read it (:func:`cudampi.comm.paths.mpi_support`, settings at auto)."""
    from cudampi.comm.paths import mpi_support
    from cudampi.config import Config
    from cudampi.probe.capabilities import Capabilities

    proved = mpi_support(
        Config.load({}, env={}), Capabilities("", "", device_p2p=p2p, device_allreduce=allreduce)
    )
    sig = f"build: {build.status}, UCX: {ucx.status}, runtime device p2p: {p2p.status}, device allreduce: {allreduce.status}"
    if proved.p2p and proved.collectives:
        return Check(
            "CUDA-aware MPI", "ok", f"yes: device p2p and collectives work ({sig})", "", CUDA
        )
    if proved.p2p:
        return Check(
            "CUDA-aware MPI",
            "ok",
            f"point-to-point only ({sig}); cudampi runs device collectives on its gpu-ring path",
            "",
            CUDA,
        )
    if p2p.status == "skipped":
        proven = "not proven (no device probe ran)"
        if build.status == "ok":
            return Check(
                "CUDA-aware MPI",
                "warn",
                f"{proven}; the build says yes ({sig})",
                "run the doctor where a GPU is visible",
                CUDA,
            )
        return Check(
            "CUDA-aware MPI",
            "warn",
            f"no, by its build and UCX ({sig}); {proven} here; cudampi stages device "
            "buffers through host memory",
            fixes.ALL_RECIPES,
            CUDA,
        )
    return Check(
        "CUDA-aware MPI",
        "warn",
        f"no: device buffers do not pass through this MPI ({sig}); cudampi stages them "
        "through host memory",
        fixes.ALL_RECIPES,
        CUDA,
    )


RECIPE_WORDS = "the libucx recipe, which `cudampi launch` applies"


def with_recipe(plain: Check, outcome: ProbeOutcome, run: ProbeRun | None) -> Check:
    """The device p2p row when the doctor also probed the libucx recipe by itself."""
    if outcome.ok:
        rate = f", {outcome.gbps:.1f} GB/s" if outcome.gbps else ""
        return Check(
            plain.name,
            "ok",
            f"works with {RECIPE_WORDS}: correct data{rate}; without it (plain mpirun, no "
            f"preload) {plain.status.upper()}: {plain.detail}",
            "",
            CUDA,
        )
    argv = f" [argv: {' '.join(run.argv)}]" if run else ""
    return Check(
        plain.name,
        plain.status,
        f"{plain.detail}; with {RECIPE_WORDS}, {outcome.status} too: {outcome.detail}{argv}",
        plain.fix,
        CUDA,
    )


def ucx_with_recipe(ucx: Check, outcome: ProbeOutcome) -> Check:
    if not outcome.ok:
        return ucx
    return Check(
        ucx.name,
        "ok",
        f"{ucx.detail}; the doctor probed {RECIPE_WORDS}: device p2p correct (for plain "
        "mpirun add it yourself: cudampi doctor --preload-ucx shows the flags)",
        "",
        CUDA,
    )
