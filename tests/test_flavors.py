"""Flavors resolve to devices as the MoAI reference says. Run: pytest tests/test_flavors.py"""

import pytest

from moai_recipes.config.compose import load_config
from moai_recipes.errors import UserError
from moai_recipes.flavors import resolve_flavor
from moai_recipes.env import GivenWorld
from moai_recipes.launch.elastic import check_capacity
from moai_recipes.launch.entry import check_world


def flavor(*overrides):
    return resolve_flavor(**load_config("full_finetune", list(overrides)).flavor)


@pytest.mark.parametrize("name, display, devices", [
    ("small", "Small.64GB", 1), ("medium", "Medium.128GB", 2), ("xlarge", "xLarge.512GB", 8),
    ("1.5xlarge", "1.5xLarge.768GB", 12), ("4xlarge", "4xLarge.2048GB", 32), ("8xlarge", "8xLarge.4096GB", 64),
    ("48xlarge", "48xLarge.24576GB", 384),
])
def test_moai_flavors_are_mi250_devices_of_64gb(name, display, devices):
    f = flavor(f"flavor={name}")
    assert (f.name, f.device.name, f.num_devices, f.device_memory_gb) == (display, "mi250", devices, 64)
    assert f.total_memory_gb == devices * 64 and f.backend == "cuda:nccl,cpu:gloo"  # gloo for host tensors (offload)


def test_4xlarge_is_16_cards_and_the_same_memory_on_h100():
    f = flavor("flavor=4xlarge")
    assert "16 MI250 cards" in f.describe() and "2048 GB in all" in f.describe()
    h = flavor("flavor=4xlarge", "flavor.device=h100")
    assert h.device.name == "h100" and h.num_devices == 26 and h.device_memory_gb == 80  # ceil(2048 / 80)
    assert flavor("flavor=4xlarge", "flavor.device=mi300x").num_devices == 11


def test_auto_is_this_machines_devices():
    import torch

    auto = flavor("flavor=auto")
    assert auto.name.startswith("auto")
    if torch.cuda.is_available():
        assert auto.device.kind == "gpu" and auto.num_devices == torch.cuda.device_count()
        assert auto.device_memory_gb == pytest.approx(torch.cuda.get_device_properties(0).total_memory / 2**30)
    else:  # one process on the CPU, as flavor=cpu; more with flavor.processes
        assert (auto.device.kind, auto.num_devices, auto.backend) == ("cpu", 1, "gloo")
        assert auto.device_memory_gb == flavor("flavor=cpu").device_memory_gb
        assert flavor("flavor=auto", "flavor.processes=2").num_devices == 2
    assert flavor().name == auto.name  # the default of every recipe


@pytest.mark.parametrize("name, n", [("cpu", 1), ("cpu-2", 2), ("cpu-4", 4)])
def test_cpu_flavors_run_processes_with_gloo(name, n):
    f = flavor(f"flavor={name}")
    assert f.num_devices == n and f.backend == "gloo" and f.device.kind == "cpu"
    assert flavor(f"flavor={name}", "flavor.device_memory_gb=0.5").device_memory_gb == 0.5


def test_a_flavor_this_machine_cannot_provide_is_a_clear_error():
    with pytest.raises(UserError) as e:
        check_capacity(flavor("flavor=4xlarge"))
    msg = str(e.value)
    assert "32 mi250 devices" in msg and "recipes.plan" in msg and "torchrun" in msg


def test_a_world_of_the_wrong_size_is_refused():
    with pytest.raises(UserError, match="3 processes"):
        check_world(flavor("flavor=cpu-2"), GivenWorld(rank=0, world_size=3, local_rank=0, init_method="env://"))
    check_world(flavor("flavor=cpu-2"), GivenWorld(rank=0, world_size=2, local_rank=0, init_method="env://"))


def test_unknown_device_is_refused():
    with pytest.raises(UserError, match="h100"):
        flavor("flavor=4xlarge", "flavor.device=tpu")
