"""Global batches do not depend on the number of ranks. Run: pytest tests/test_batching.py"""

from moai_recipes.data.batches import GlobalBatches, split_micro_batches


def test_the_global_batch_is_the_same_set_whatever_the_world_size():
    b = GlobalBatches(num_samples=37, batch_size=10, epochs=2, seed=3)
    assert b.steps_per_epoch == 4 and b.total_steps == 8
    for step in range(b.total_steps):
        expected = b.global_indices(step)
        for world in (1, 2, 3, 4, 16):
            shares = [b.rank_slots(step, rank=r, world_size=world) for r in range(world)]
            assert len({len(s) for s in shares}) == 1  # same number of slots on every rank
            assert [i for s in shares for i in s if i is not None] == expected


def test_each_epoch_is_a_new_permutation_of_all_samples():
    b = GlobalBatches(num_samples=20, batch_size=8, epochs=2, seed=0)
    epoch = lambda e: [i for s in range(e * 3, e * 3 + 3) for i in b.global_indices(s)]
    assert sorted(epoch(0)) == sorted(epoch(1)) == list(range(20))
    assert epoch(0) != epoch(1)
    assert GlobalBatches(num_samples=20, batch_size=8, epochs=2, seed=0).global_indices(4) == b.global_indices(4)


def test_micro_batches_cover_the_share_in_order():
    assert split_micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
