"""Flavors: virtual accelerators of a given size, resolved to a device type and a device count.

A MoAI flavor is a total memory on a device type (`4xlarge` = 2048 GB of MI250 = 16 cards, which
PyTorch sees as 32 devices of 64 GB). `flavor.device=h100` re-expresses the same total memory on
other hardware. The CPU flavors run a given number of processes on this machine with gloo.
"""

import functools
import math
import os
import sys
from dataclasses import dataclass, replace

import psutil

from moai_recipes.errors import UserError


@dataclass(frozen=True)
class Device:
    """One device as PyTorch sees it (an MI250 card is two of these), with peak figures for planning."""

    name: str
    kind: str  # "gpu" or "cpu"
    memory_gb: float  # per device; the CPU's is the host memory, shared by its processes
    per_card: int  # devices per physical card (MI250: 2 GCDs)
    per_node: int  # devices per node
    bf16_tflops: float  # dense peak per device
    fp32_tflops: float
    hbm_gbps: float  # memory bandwidth per device, GB/s
    intra_node_gbps: float  # per-device bandwidth to its peers in a node (NVLink / Infinity Fabric), GB/s
    inter_node_gbps: float  # per-device network bandwidth across nodes, GB/s
    host_memory_gb: float = 0  # host (CPU) memory of a node of per_node devices; the CPU's is measured


def _host_memory_gb() -> float:
    return psutil.virtual_memory().total / 2**30


# Host memory per node, from data sheets: an MI250 node of 4 cards (8 devices) as HPE Cray EX235a, 512 GB;
# MI300X as Azure ND MI300X v5, 1850 GB; A100 as DGX A100, 1 TB; H100 and H200 as DGX H100 / H200, 2 TB.
# Workstation cards (torchtune's README measures on them): RTX 4090 (Ada whitepaper: 165.2 bf16 TFLOPS dense with fp32
# accumulation, 82.6 fp32, 1,008 GB/s) and RTX A6000 (154.8 bf16 dense, 38.7 fp32, 768 GB/s), peers over PCIe 4.0
# x16 (no NVLink beyond a pair), as 8-GPU servers of 512 GB.
DEVICES = {
    "mi250": Device("mi250", "gpu", 64, 2, 8, 191.5, 47.9, 1638, 100, 25, host_memory_gb=512),
    "mi300x": Device("mi300x", "gpu", 192, 1, 8, 1307, 163.4, 5300, 64, 50, host_memory_gb=1850),
    "a100": Device("a100", "gpu", 80, 1, 8, 312, 19.5, 2039, 300, 25, host_memory_gb=1024),
    "h100": Device("h100", "gpu", 80, 1, 8, 989, 67, 3350, 450, 50, host_memory_gb=2048),
    "rtx4090": Device("rtx4090", "gpu", 24, 1, 8, 165.2, 82.6, 1008, 25, 12.5, host_memory_gb=512),
    "a6000": Device("a6000", "gpu", 48, 1, 8, 154.8, 38.7, 768, 25, 12.5, host_memory_gb=512),
    "h200": Device("h200", "gpu", 141, 1, 8, 989, 67, 4800, 450, 50, host_memory_gb=2048),
    # The CPU's compute and memory speed are measured on the machine (planner/cpu_speed.py); its "link" is
    # gloo between processes of one machine, fitted with bench/planner_accuracy.py --processes 2.
    "cpu": Device("cpu", "cpu", 0, 1, 1, 0.01, 0.025, 20, 0.83, 0.83),
}


@dataclass(frozen=True)
class Flavor:
    name: str  # display name, e.g. 4xLarge.2048GB
    device: Device
    num_devices: int
    device_memory_gb: float  # the per-device budget the planner must respect

    @property
    def total_memory_gb(self) -> float:
        return self.num_devices * self.device_memory_gb

    @property
    def processes_per_node(self) -> int:
        return min(self.num_devices, self.device.per_node)

    @property
    def host_memory_gb(self) -> float:
        """Host memory of one node: the data sheet's for GPU nodes, this machine's for the CPU."""
        return self.device.host_memory_gb or _host_memory_gb()

    @property
    def backend(self) -> str:
        # NCCL on NVIDIA, RCCL behind the same name on ROCm; gloo on the CPU. On GPUs gloo too, for what lives on the
        # host: FSDP2 keeps CPU-offloaded state's gradients there (plan.cpu_offload), and the gradient norm reduces
        # them (NCCL takes device tensors only), as torchtitan's cuda:nccl,cpu:gloo.
        return "cuda:nccl,cpu:gloo" if self.device.kind == "gpu" else "gloo"

    def describe(self) -> str:
        cards = ""
        if self.device.per_card > 1:  # Small.64GB is half an MI250 card
            count = self.num_devices / self.device.per_card
            cards = f" ({count:g} {self.device.name.upper()} card{'' if count == 1 else 's'})"
        return (f"{self.name}: {self.num_devices} x {self.device.name} device{'s' if self.num_devices > 1 else ''}"
                f"{cards}, {self.device_memory_gb:.4g} GB each, {self.total_memory_gb:.5g} GB in all")


@functools.cache  # asked for by every catalog of flavors; the warning is said once
def local_accelerator() -> tuple[Device, int]:
    """What this machine has, as one accelerator: every visible GPU (their type, count and memory as torch reports
    them), or the CPU. A GPU type without a data sheet here gets conservative figures, and a warning says so."""
    if "torch" not in sys.modules and not _gpu_device_files():
        return DEVICES["cpu"], 1  # what torch would say, without its 2 s import (`moai flavors` is a table)
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return DEVICES["cpu"], 1
    props = torch.cuda.get_device_properties(0)
    memory_gb = props.total_memory / 2**30
    compact = props.name.lower().replace(" ", "").replace("-", "")
    known = next((k for k in DEVICES if k != "cpu" and k in compact), None)
    if known:
        return replace(DEVICES[known], memory_gb=memory_gb), torch.cuda.device_count()
    print(f"warning: flavor=auto: no figures for a {props.name}; planning with conservative ones (100 bf16 TFLOP/s, "
          "1 TB/s, 25 GB/s links). Pick a known device with flavor.device=NAME if it is one", file=sys.stderr)
    device = Device(props.name, "gpu", memory_gb, 1, 8, 100, 20, 1000, 25, 12.5, host_memory_gb=_host_memory_gb())
    return device, torch.cuda.device_count()


def _gpu_device_files() -> bool:
    """Whether this machine shows a GPU's device files, which any CUDA or ROCm device needs: NVIDIA's (/dev/nvidiactl),
    AMD's (/dev/kfd), WSL's (/dev/dxg)."""
    return any(os.path.exists(f) for f in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg"))


def resolve_flavor(*, name: str, device: str, memory_gb: float | None, processes: int | None,
                   device_memory_gb: float | None) -> Flavor:
    """Turn a flavor config into a device type, a device count and a per-device memory budget (flavor=auto:
    the devices of this machine)."""
    if device == "auto":
        dev, count = local_accelerator()
        if dev.kind == "cpu":
            n = processes or 1
            return Flavor(name=name, device=dev, num_devices=n, device_memory_gb=device_memory_gb or _host_memory_gb() / n)
        n = processes or count
        return Flavor(name=f"{name} ({n} x {dev.name})", device=dev, num_devices=n,
                      device_memory_gb=device_memory_gb or dev.memory_gb)
    if device not in DEVICES:
        raise UserError(f"flavor.device={device} is not a known device; valid: {', '.join(DEVICES)}")
    dev = DEVICES[device]
    if processes is not None and processes < 1:
        raise UserError(f"flavor.processes={processes} must be at least 1")
    if memory_gb is not None and memory_gb <= 0:
        raise UserError(f"flavor.memory_gb={memory_gb} must be positive")
    if device_memory_gb is not None and device_memory_gb <= 0:
        raise UserError(f"flavor.device_memory_gb={device_memory_gb} must be positive")
    if dev.kind == "cpu":
        n = processes or 1
        per_device = device_memory_gb or _host_memory_gb() / n
    elif processes is not None:
        n, per_device = processes, device_memory_gb or dev.memory_gb
    elif memory_gb is not None:
        # The same total memory on this device type: enough devices to hold it.
        n = max(1, math.ceil(memory_gb / dev.memory_gb - 1e-9))
        per_device = device_memory_gb or dev.memory_gb
    else:
        raise UserError(f"flavor {name} needs memory_gb or processes")
    return Flavor(name=name, device=dev, num_devices=n, device_memory_gb=per_device)


def local_capacity(flavor: Flavor) -> int:
    """How many devices of the flavor's kind this machine offers to one node's processes."""
    if flavor.device.kind == "cpu":
        return os.cpu_count() or 1
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
