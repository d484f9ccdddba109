"""Global batches do not depend on the number of ranks; the Plan splits them. Run: pytest tests/test_batching.py"""

from moai_recipes.data.batches import GlobalBatches
from moai_recipes.planner.plan import Plan


def plan(*, batch_size: int, num_devices: int, micro_batch_size: int = 1) -> Plan:
    per_device = -(-batch_size // num_devices)
    return Plan(batch_size=batch_size, num_devices=num_devices, micro_batch_size=micro_batch_size,
                accumulation_steps=-(-per_device // micro_batch_size), recompute="none", reshard_after_forward=True,
                cpu_offload=False, chunked_loss=False, param_dtype="float32", master_dtype="float32")


def test_the_global_batch_is_the_same_set_whatever_the_world_size():
    b = GlobalBatches(num_samples=37, batch_size=10, epochs=2, seed=3)
    assert b.steps_per_epoch == 4 and b.total_steps == 8
    for step in range(b.total_steps):
        expected = b.global_indices(step)
        for world in (1, 2, 3, 4, 16):
            shares = [plan(batch_size=10, num_devices=world).rank_share(expected, r) for r in range(world)]
            assert len({len(s) for s in shares}) == 1  # same number of slots on every rank
            assert [i for s in shares for i in s if i is not None] == expected


def test_each_epoch_is_a_new_permutation_of_all_samples():
    b = GlobalBatches(num_samples=20, batch_size=8, epochs=2, seed=0)
    epoch = lambda e: [i for s in range(e * 3, e * 3 + 3) for i in b.global_indices(s)]
    assert sorted(epoch(0)) == sorted(epoch(1)) == list(range(20))
    assert epoch(0) != epoch(1)
    assert GlobalBatches(num_samples=20, batch_size=8, epochs=2, seed=0).global_indices(4) == b.global_indices(4)


def test_micro_batches_cover_the_share_in_order():
    p = plan(batch_size=10, num_devices=2, micro_batch_size=2)
    assert p.accumulation_steps == 3
    assert p.micro_batches([1, 2, 3, 4, 5]) == [[1, 2], [3, 4], [5]]
    assert p.micro_batches([1, 2, 3]) == [[1, 2], [3]]  # the short last batch of an epoch: fewer micro-batches
