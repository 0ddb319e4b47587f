#!/usr/bin/env bash
# Every check that needs a GPU, in one run (sized for an H200 lease of a few minutes).
# Usage (repo root, on the GPU machine): OUT=/some/dir bash bench/gpu_check.sh
# Needs torch + triton on the machine; the other Python packages come from .gpu_wheels/ when
# present (made with `pip download` for the machine's Python) and go to a private folder.
set -uo pipefail
OUT=${OUT:-/tmp/kvhandoff_gpu}
mkdir -p "$OUT"
if [ -d .gpu_wheels ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kvh_extra .gpu_wheels/*.whl
  export PYTHONPATH=/tmp/kvh_extra:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Without a GPU only the CPU-only parts run (the NIXL DRAM row), so the script can be checked
# anywhere: `bash -n bench/gpu_check.sh`, then `OUT=/tmp/x bash bench/gpu_check.sh`.
if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/env.txt"
  ALL_STEPS="kernels gpu_tests e2e_gpu decode_throughput capacity nixl_vram service_sizing"
else
  echo "no GPU here: only the CPU-only steps run" | tee "$OUT/env.txt"
  ALL_STEPS="nixl_vram"
fi
python3 -c "import nixl_cu12" 2>/dev/null && echo "nixl-cu12 importable" | tee -a "$OUT/env.txt" \
  || echo "nixl-cu12 missing (put its wheel in .gpu_wheels/): the nixl_vram rows will say why" | tee -a "$OUT/env.txt"

# STEPS selects steps by name (default: all that this machine can run), e.g. STEPS="kernels gpu_tests"
STEPS=${STEPS:-$ALL_STEPS}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { local name=$1 limit=$2; shift 2; want "$name" || return 0
  echo "=== $name (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  tail -n 60 "$OUT/$name.txt"; echo "=== $name rc=$rc in $((SECONDS - t0))s"; }

step kernels 240 python3 bench/kernels.py --json "$OUT/kernels.json"
step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/unit/test_capacity.py
step e2e_gpu 240 python3 -m pytest -q -p no:cacheprovider -x tests/e2e/test_triton_services.py tests/e2e/test_matches_transformers.py
[ -f bench/decode_throughput.py ] && step decode_throughput 90 python3 bench/decode_throughput.py --device cuda
[ -f bench/capacity_report.py ] && step capacity 60 python3 bench/capacity_report.py
# NIXL on the device (issue 24 item 5): host->host, host->VRAM (a decode pool on cuda: the READ
# lands in VRAM, no staging copy) and VRAM->VRAM READs over UCX's cuda transports
# (UCX_TLS=sm,tcp,self,cuda_copy,cuda_ipc unless set), and prefill's GPU-pool packing: .cpu()
# into pageable memory vs pinned buffers filled on a side stream. Rows with GB/s and CPU s/GB.
step nixl_vram 180 python3 -m bench.nixl_vram --sizes 64MiB,1GiB --repeats 3 --json "$OUT/nixl_vram.json"
echo "all steps done in ${SECONDS}s"
# The real service sizing its pool from device memory (demo model), read from its start-up log.
want service_sizing && {
echo "=== service_sizing"
(timeout 90 python3 -m kvhandoff_cli.main prefill --model demo --pool-tokens 0 --memory-fraction 0.5 \
   --allow-context-beyond-pool --port 0 > "$OUT/service_sizing.txt" 2>&1 &)
for i in $(seq 1 80); do grep -q '"event": "serving"' "$OUT/service_sizing.txt" 2>/dev/null && break; sleep 1; done
grep runtime_ready "$OUT/service_sizing.txt"; pkill -f "kvhandoff_cli.main prefill" || true
}
echo "finished in ${SECONDS}s"
