#!/usr/bin/env bash
# Everything that needs several GPUs of one host, in one call (issue: multi-GPU validation).
#   bash benchmarks/multigpu.sh DOCLENS_JSON OUT_DIR
# NVLink multicast stays off: the lent machines require it.
set -uo pipefail
doclens=${1:?path to a JSON list of document lengths}
out=${2:?output folder}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "== $n GPUs"
# 1. compiled CP training on NCCL equals one process (fp32: the exact reference kernel on GPU)
for run in "dual_chunk_swap all_gather" "no_load_balance all_gather" "striped all_gather" "dual_chunk_swap ring"; do
  read -r strategy comm <<< "$run"
  timeout 240 torchrun --nproc-per-node "$n" examples/train_packed.py --strategy "$strategy" --comm "$comm" --steps 8 \
    --tokens 2048 --inner aot_eager 2>&1 | tr '\r' '\n' | grep -E "step 8/|graphs|curves|Error|error" | tee -a "$out/train.log"
done
# 2. CP attention step with real communication (all-gather and ring), bf16, checked against one GPU
timeout 300 torchrun --nproc-per-node "$n" benchmarks/cp_step.py --doclens "$doclens" --output "$out/cp_step.md" 2>&1 \
  | grep -v Warning | tee "$out/cp_step.log" | tail -20
# 3. TP overlap: sequential vs ag_gemm vs torch's fused op
timeout 300 python3 benchmarks/tp_overlap.py --output "$out/tp_overlap.md" 2>&1 \
  | grep -v Warning | tee "$out/tp_overlap.log" | tail -15
