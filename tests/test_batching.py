"""Global batches do not depend on the number of ranks; the Plan splits them. Run: pytest tests/test_batching.py"""

from moai_recipes.data.batches import GlobalBatches
from moai_recipes.planner.plan import Plan


def plan(*, batch_size: int, num_devices: int, micro_batch_size: int = 1, packing: bool = False,
         attention_length: int = 0) -> Plan:
    per_device = -(-batch_size // num_devices)
    return Plan(batch_size=batch_size, num_devices=num_devices, max_seq_len=10, micro_batch_size=micro_batch_size,
                accumulation_steps=-(-per_device // micro_batch_size), packing=packing, recompute="none", replicate=False,
                reshard_after_forward=True, cpu_offload=False, chunked_loss=False, param_dtype="float32",
                master_dtype="float32", attention_length=attention_length)


def test_the_global_batch_is_the_same_set_whatever_the_world_size():
    b = GlobalBatches(num_samples=37, batch_size=10, epochs=2, seed=3)
    assert b.steps_per_epoch == 4 and b.total_steps == 8
    length = lambda i: 1 + (i * 7919) % 10  # variable lengths
    for step in range(b.total_steps):
        expected = b.global_indices(step)
        lengths = [length(i) for i in expected]
        for world in (1, 2, 3, 4, 16):
            shares = [plan(batch_size=10, num_devices=world).rank_share(expected, lengths, r) for r in range(world)]
            assert sorted(i for s in shares for i in s) == sorted(expected)  # each sample on exactly one rank
            assert all(s == [i for i in expected if i in s] for s in shares)  # in the global batch's order
            if world == 1:
                assert shares[0] == expected


def test_ranks_get_balanced_tokens_not_balanced_counts():
    indices, lengths = list(range(6)), [100, 10, 10, 10, 10, 60]
    shares = [plan(batch_size=6, num_devices=2).rank_share(indices, lengths, r) for r in range(2)]
    assert shares == [[0], [1, 2, 3, 4, 5]]  # 100 tokens against 100, where halves by count were 130 against 80
    assert [sum(lengths[i] for i in s) for s in shares] == [100, 100]


def test_a_long_document_weighs_its_attention_too():
    # Tokens alone put 160 tokens against 120. Counting each document's attention (n x (1 + n / 40)), the
    # 120-token document is 480 and each 40-token one 80: it goes alone against the other four (480 against 320,
    # where the token split was 560 against 240).
    indices, lengths = list(range(5)), [120, 40, 40, 40, 40]
    by_tokens = [plan(batch_size=5, num_devices=2).rank_share(indices, lengths, r) for r in range(2)]
    by_work = [plan(batch_size=5, num_devices=2, attention_length=40).rank_share(indices, lengths, r) for r in range(2)]
    assert by_tokens == [[0, 4], [1, 2, 3]] and by_work == [[0], [1, 2, 3, 4]]


def test_packed_micro_batches_fill_the_token_budget_in_order():
    p = plan(batch_size=8, num_devices=1, micro_batch_size=2, packing=True)  # budget: 2 x max_seq_len 10 tokens
    assert p.token_budget == 20 and p.row_length == 20
    assert p.micro_batches([10, 5, 5, 9, 3, 10, 1]) == [[0, 1, 2], [3, 4], [5, 6]]


def test_each_epoch_is_a_new_permutation_of_all_samples():
    b = GlobalBatches(num_samples=20, batch_size=8, epochs=2, seed=0)
    epoch = lambda e: [i for s in range(e * 3, e * 3 + 3) for i in b.global_indices(s)]
    assert sorted(epoch(0)) == sorted(epoch(1)) == list(range(20))
    assert epoch(0) != epoch(1)
    assert GlobalBatches(num_samples=20, batch_size=8, epochs=2, seed=0).global_indices(4) == b.global_indices(4)


def test_micro_batches_cover_the_share_in_order():
    p = plan(batch_size=10, num_devices=2, micro_batch_size=2)
    assert p.accumulation_steps == 3
    assert p.micro_batches([7, 7, 7, 7, 7]) == [[0, 1], [2, 3], [4]]  # positions in the share
    assert p.micro_batches([7, 7, 7]) == [[0, 1], [2]]  # the short last batch of an epoch: fewer micro-batches


def test_a_rank_with_fewer_micro_batches_runs_empty_ones_of_two_padding_tokens():
    """FSDP2's collectives need every rank to run as many forwards as the busiest; the others run empty micro-batches.
    Two padding tokens, not one: dynamo specialises a length of 1, and a one-token row had every compiled layer
    compiled again for it (tests/test_compile.py's cpu-2 run with packed rows, whose ranks form unequal rows)."""
    from types import SimpleNamespace

    from moai_recipes.train.micro_batches import model_inputs, rank_micro_batches

    # A sample of 10 tokens alone on one rank, three of 4 on the other: packed into rows of 10 tokens (two rows), or
    # padded rows of one sample (three).
    samples = [{"tokens": [5] * n, "labels": [5] * n} for n in (10, 4, 4, 4)]
    for packing in (True, False):
        p = plan(batch_size=4, num_devices=2, packing=packing)
        mine = [rank_micro_batches(p, samples, SimpleNamespace(data_rank=r)) for r in range(2)]
        assert len(mine[0]) == len(mine[1]) and None in mine[0] + mine[1], mine
        empty = model_inputs(None, p, pad_id=0)
        assert empty["tokens"].shape == (1, 2) and (empty["labels"] == -100).all(), empty
