#!/usr/bin/env bash
# Everything that needs several GPUs of one host, in one call: compiled CP training on NCCL against one
# process, the CP attention step with communication (cp_step.py) and TP overlap (tp_overlap.py).
# Prints each part's section of BENCHMARKS.md; with --output FILE each part also writes its own there.
#   bash benchmarks/multigpu.sh DOCLENS_JSON [--output BENCHMARKS.md]
# NVLink multicast stays off: the lent machines require it.
set -uo pipefail
doclens=${1:?path to a JSON list of document lengths}
output=-
if [[ "${2:-}" == "--output" ]]; then output=${3:?the file to write the sections into}; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "== $n GPUs" >&2
# 1. compiled CP training on NCCL equals one process (fp32: the exact reference kernel on GPU)
runs=("dual_chunk_swap auto" "no_load_balance auto" "striped auto" "dual_chunk_swap ring" "striped ring")
checks=""
for run in "${runs[@]}"; do
  read -r strategy kv <<< "$run"
  checks+=$(timeout 240 torchrun --nproc-per-node "$n" examples/train_packed.py --strategy "$strategy" --kv "$kv" \
    --steps 8 --tokens 2048 --inner aot_eager 2>&1 | tr '\r' '\n' | grep -E "step 8/|graphs|curves|Error|error" \
    | tee /dev/stderr)$'\n'
done
{
  echo "Compiled CP training (\`examples/train_packed.py --steps 8 --tokens 2048 --inner aot_eager\`, a run per"
  echo "strategy and \`--kv\`, fp32, cp=$n on NCCL) against the same model on one process; last lines per run:"
  echo
  echo '```'
  printf '%s' "$checks"
  echo '```'
  echo
  echo "Runs that compared their loss curves with one process's: $(grep -c '^loss curves' <<< "$checks") of ${#runs[@]}."
} | python3 benchmarks/report.py --heading "## Multi-GPU checks (benchmarks/multigpu.sh)" \
  --command "bash benchmarks/multigpu.sh $*" --output "$output"
# 2. CP attention step with real communication (all-gather, exchange and ring), bf16, checked against one GPU
timeout 300 torchrun --nproc-per-node "$n" benchmarks/cp_step.py --doclens "$doclens" --output "$output" 2>&1 \
  | grep -v Warning
# 3. TP overlap: sequential vs ag_gemm vs torch's fused op
timeout 300 python3 benchmarks/tp_overlap.py --output "$output" 2>&1 | grep -v Warning
