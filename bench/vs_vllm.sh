#!/usr/bin/env bash
# The side-by-side of docs/benchmarks.md ("Serving against vLLM on the same cores"): the same
# checkpoint, workload and client timing code against our services, then against vLLM CPU's
# OpenAI server, one system at a time, then one table with the ratios.
#
#   bash bench/vs_vllm.sh                 # everything: checkpoint, ours, vLLM, the table
#   VLLM_PID=1234 VLLM_PORT=8000 bash bench/vs_vllm.sh   # a vLLM already serving $CKPT
#   MODES= bash bench/vs_vllm.sh          # vLLM only (and the table of what $OUT holds)
#   DTYPE=bfloat16 bash bench/vs_vllm.sh  # both systems in bf16 (CPUs with AMX/AVX512-BF16)
#   OURS_ARGS=--core-borrowing bash bench/vs_vllm.sh   # extra `bench serve` flags for ours
#
# vLLM lives in its own venv ($VLLM_PY), never in ours: see the doc for how to make it.
set -euo pipefail
cd "$(dirname "$0")/.."

CKPT=${CKPT:-/tmp/kvh-bench-llama}
OUT=${OUT:-/tmp/kvh-bench-vs-vllm}
VLLM_PY=${VLLM_PY:-/work/vllm-venv/bin/python}
VLLM_PORT=${VLLM_PORT:-8011}
LENS=${LENS:-"128 1024"}
CLIENTS=${CLIENTS:-1,8}
PROMPTS=${PROMPTS:-24}
MODES=${MODES-disaggregated,local}
DTYPE=${DTYPE:-float32}
OURS_ARGS=${OURS_ARGS:-}
CPUS=$(python -c "import os; from common.server.cpu_placement import format_cpu_list as f; \
print(f(os.sched_getaffinity(0)))")

mkdir -p "$OUT"
[ -f "$CKPT/config.json" ] || python -m bench.make_bench_checkpoint "$CKPT"
common=(--model "$CKPT" --output-len 64 --num-prompts "$PROMPTS" --max-concurrency "$CLIENTS")
files=()

if [ -n "$MODES" ]; then
  for len in $LENS; do
    echo "ours: $MODES, $len-token prompts" >&2
    # shellcheck disable=SC2086  # OURS_ARGS is flags, split on purpose
    python -m kvhandoff_cli.main bench serve --modes "$MODES" --input-len "$len" "${common[@]}" \
      --server-args "--dtype $DTYPE" $OURS_ARGS --json "$OUT/ours-$len.json" > "$OUT/ours-$len.txt"
  done
fi
for len in $LENS; do [ -f "$OUT/ours-$len.json" ] && files+=("$OUT/ours-$len.json"); done

if [ -z "${VLLM_PID:-}" ]; then
  echo "vLLM: starting on CPUs $CPUS (log $OUT/vllm.log)" >&2
  VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} \
    VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto} \
    "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$CKPT" --host 127.0.0.1 \
    --port "$VLLM_PORT" --dtype "$DTYPE" > "$OUT/vllm.log" 2>&1 &
  VLLM_PID=$!
  trap 'kill "$VLLM_PID" 2>/dev/null || true' EXIT
  python - "$VLLM_PORT" "$VLLM_PID" <<'EOF'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 1200
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
        sys.exit(0)
    except OSError:
        if not os.path.exists(f"/proc/{pid}"):
            sys.exit("vLLM exited before serving: see its log")
        time.sleep(5)
sys.exit("vLLM did not serve within 1200 s")
EOF
fi
for len in $LENS; do
  echo "vLLM: $len-token prompts" >&2
  python -m kvhandoff_cli.main bench serve --backend openai --label vllm \
    --url "http://127.0.0.1:$VLLM_PORT/v1" --server-pids "$VLLM_PID" --input-len "$len" \
    "${common[@]}" --json "$OUT/vllm-$len.json" > "$OUT/vllm-$len.txt"
  files+=("$OUT/vllm-$len.json")
done
python -m kvhandoff_cli.main bench serve --compare "${files[@]}" --ratio-base vllm \
  | tee "$OUT/table.txt"
