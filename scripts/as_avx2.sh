#!/usr/bin/env bash
# Run a command as it runs on an AVX2-only CPU, on a host with AVX-512: PyTorch's own kernels, oneDNN's and MKL's are
# held to AVX2, so bf16 is emulated (about 3 GFLOP/s at two threads here, against 950 natively) and every reduction
# runs in AVX2's order. What it cannot show is the slower core itself: the AVX2-only EPYC of issue 51 measured fp32
# at 108 GFLOP/s, this host 200 either way. It prints the rates it sees, then runs the command.
#
#     bash scripts/as_avx2.sh .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
#     bash scripts/as_avx2.sh .venv/bin/python -m recipes.plan flavor=48xlarge model=llama3_70b batch_size=512
#
# Inductor's generated C++ (plan.compile=true, torchao's 8-bit AdamW) still targets the host's vector width.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: bash scripts/as_avx2.sh COMMAND [ARGS...]" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
if [ ! -x "$root/.venv/bin/python" ]; then  # make has not installed yet: nothing to measure with
    echo "== as_avx2: kernels held to AVX2 (no .venv yet to measure their rates)" >&2
    exec "$@"
fi
"$root/.venv/bin/python" - <<'PY' >&2
import time

import torch


def rate(dtype, n):
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    start = time.perf_counter()
    a @ b
    return 2 * n**3 / (time.perf_counter() - start) / 1e9


print(f"== as_avx2: ATen dispatches {torch.backends.cpu.get_cpu_capability()} kernels; matmul at "
      f"{torch.get_num_threads()} threads: fp32 {rate(torch.float32, 1024):.0f} GFLOP/s, "
      f"bf16 {rate(torch.bfloat16, 256):.1f} GFLOP/s")
PY
exec "$@"
