#!/usr/bin/env bash
# Run a command as it runs on an AVX2-only CPU, on a host with AVX-512: PyTorch's own kernels, oneDNN's and MKL's are
# held to AVX2, so bf16 is emulated (about 3 GFLOP/s at two threads here, against 950 natively) and every reduction
# runs in AVX2's order. What it cannot show is the slower core itself: the AVX2-only EPYC of issue 51 measured fp32
# at 108 GFLOP/s, this host 200 either way. It prints the rates the planner measures with those kernels
# (moai_recipes/planner/cpu_speed.py, cached apart from the native ones), then runs the command.
#
#     bash scripts/as_avx2.sh .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
#     bash scripts/as_avx2.sh .venv/bin/python -m recipes.plan flavor=48xlarge model=llama3_70b batch_size=512
#
# Inductor's generated C++ (plan.compile=true, torchao's 8-bit AdamW) follows ATEN_CPU_CAPABILITY too: AVX2 code.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: bash scripts/as_avx2.sh COMMAND [ARGS...]" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
# Inductor's compiled graphs in a cache of their own: with ATEN_CPU_CAPABILITY=avx2 it generates AVX2 code, and
# torch 2.13's caches do not tell it from the host's. Sharing the host's cache folder, a native process then ran what
# the emulation compiled (heap corruption: "malloc(): unaligned tcache chunk detected"; passed with a fresh folder)
# and an emulated one what the host compiled (gpu_check's compiled block off by 6e24; 8-bit AdamW's compiled step
# learning nothing): 2026-11-29, on the Xeon.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)}-avx2"
if [ ! -x "$root/.venv/bin/python" ]; then  # make has not installed yet: nothing to measure with
    echo "== as_avx2: kernels held to AVX2 (no .venv yet to measure their rates)" >&2
    exec "$@"
fi
"$root/.venv/bin/python" - <<'PY' >&2
import torch

from moai_recipes.planner.cpu_speed import cpu_speed, process_threads

threads = process_threads(1)
speed = cpu_speed(threads)  # as the planner measures it (and caches it, by instruction set)
print(f"== as_avx2: ATen dispatches {torch.backends.cpu.get_cpu_capability()} kernels; matmul at {threads} threads: "
      f"fp32 {speed.fp32_flops / 1e9:.0f} GFLOP/s, bf16 {speed.bf16_flops / 1e9:.1f} GFLOP/s")
PY
exec "$@"
