#!/usr/bin/env bash
# The oldest versions pyproject.toml declares, proven on this CPU: a throwaway venv with torch 2.11.0 (PyPI's wheel,
# a CUDA 13 build: it runs on a machine without a GPU, about 3 GB with its CUDA libraries; what the lent GPU machines
# hold), transformers 5.24.0, torchtune 0.6.1 and torchao 0.14.1, then the test suite in it (llama-cpp-python left
# out: it builds llama.cpp from source; its tests skip).
#
#     bash scripts/oldest_versions.sh [VENV_DIR]      # default: a temporary folder, removed at the end
#
# About 2 minutes to install (from the package index) and the suite's time on top. Exit status: the suite's.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-}
if [ -z "$venv" ]; then
    venv=$(mktemp -d -t moai-oldest-XXXXXX)
    trap 'rm -rf "$venv"' EXIT
fi
python3 -m venv "$venv"
py="$venv/bin/python"
pip_install() { "$py" -m pip install --quiet --disable-pip-version-check --no-compile "$@"; }
echo "== oldest versions: torch 2.11.0 (PyPI's CUDA build), transformers 5.24.0, torchtune 0.6.1, torchao 0.14.1 in $venv"
# torch first and exact: a CPU build of 2.13 where one is at hand (make's) would otherwise satisfy the range.
pip_install "torch==2.11.0"
# torchvision beside it, as the GPU machines have it (PyPI's torchvision is built for PyPI's torch, which this one
# is; it is not for the CPU build of 2.13 that make installs).
pip_install "transformers==5.24.0" "torchtune==0.6.1" "torchao==0.14.1" "torchvision==0.26.0"
# The rest as pyproject.toml declares it (its torch pin left aside: --no-deps, then its other requirements), and the
# test extras the suite needs without building llama.cpp (scipy: a sampler test's chi-square; setuptools: the wheel
# test builds without isolation, and setuptools 70.1 builds wheels by itself).
pip_install --no-deps -e "$root"
"$py" - "$root/pyproject.toml" > "$venv/requirements.txt" <<'PY'
import sys
import tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith(("torch>", "torch=", "torchtune", "torchao", "transformers"))))
PY
pip_install -r "$venv/requirements.txt" "pytest>=8" "pytest-xdist>=3.6" "peft>=0.13,<0.19" "trl>=1.16,<1.17" \
    "lm-eval>=0.4.8,<0.5" scipy "setuptools>=70.1"
"$py" - <<'PY'
import torch, torchao, torchtune, transformers
print(f"== installed: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"torchtune {torchtune.__version__}, torchao {torchao.__version__}")
assert torch.__version__.startswith("2.11.0") and transformers.__version__ == "5.24.0", "not the oldest versions"
PY
cd "$root"
exec "$py" -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -p no:cacheprovider
