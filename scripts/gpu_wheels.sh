#!/usr/bin/env bash
# The wheels a bare GPU machine of the lent kind lacks, downloaded here into DIR (default .whl, ignored by git): our
# package, built here, and what it needs beyond the machine's image (CPython 3.12 on manylinux x86_64, with torch 2.11
# for CUDA 13, transformers 5.17 and the packages /work/.library/device/KINDS.md lists: IMAGE below), for that
# platform. transformers is carried too: 5.17 is older than the oldest we declare (5.24, docs/gpu.md). The versions
# are those of this machine's venv (make's), whose closure of requirements is walked; under 64 MiB in all (what the
# device tool carries a call), checked at the end.
#
#     bash scripts/gpu_wheels.sh [DIR]
#     TARGET_PYTHON=3.11 bash scripts/gpu_wheels.sh DIR    # for another Python (this machine's, to try them here)
#     # then, on the device (the run tool's carry=[".whl"]):
#     python3 scripts/gpu_check.py --wheels .whl --out $OUT
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/.whl}
py=${PYTHON:-$root/.venv/bin/python}
version=${TARGET_PYTHON:-3.12}  # the device image's Python
rm -rf "$dir"
mkdir -p "$dir"
# What the image holds (2026-11-17's reading). transformers is left out of it on purpose: carried newer.
IMAGE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
# Our requirements' closure as this venv resolved it, less the image: NAME==VERSION lines.
wanted=$(IMAGE="$IMAGE" VERSION="$version" "$py" - <<'PY'
import os, re
from importlib.metadata import PackageNotFoundError, distribution
from packaging.requirements import Requirement

image = set(os.environ["IMAGE"].split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
target = {"python_version": os.environ["VERSION"], "python_full_version": os.environ["VERSION"] + ".0",
          "sys_platform": "linux", "os_name": "posix",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
found, todo = {}, [r for r in distribution("moai-recipes").requires if "extra ==" not in r]
while todo:
    req = Requirement(todo.pop())
    if (req.marker and not req.marker.evaluate(target)) or norm(req.name) in found:
        continue
    try:
        dist = distribution(req.name)
    except PackageNotFoundError:
        continue  # not needed on this platform's resolution
    found[norm(req.name)] = dist.version
    todo += [r for r in dist.requires or [] if "extra ==" not in r]
print("\n".join(f"{n}=={v}" for n, v in sorted(found.items()) if n not in image))
PY
)
platform=(--only-binary=:all: --python-version "$version" --implementation cp --abi "cp${version/./}" --abi abi3 --abi none
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for spec in $wanted; do
    # A wheel for the device's platform, or (a package published as a source archive only, pure Python: Hydra's
    # antlr4 runtime) one built here.
    "$py" -m pip download --quiet --disable-pip-version-check --no-deps "${platform[@]}" -d "$dir" "$spec" 2>/dev/null \
        || "$py" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$dir" "$spec"
done
"$py" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$dir" "$root"
size=$(du -sb "$dir" | cut -f1)
echo "== $(ls "$dir" | wc -l) wheels in $dir: $((size / 1024 / 1024)) MiB"
ls "$dir"
if [ "$size" -ge $((64 * 1024 * 1024)) ]; then
    echo "more than the 64 MiB the device tool carries a call" >&2
    exit 1
fi
