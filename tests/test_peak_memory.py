"""The CPU's peak tensor memory as a run measures it (train/peak_memory.py): our MemTracker keeps only the process's
peak, and that peak is the one PyTorch's own MemTracker measures, to the byte, on the same step.
Run: python -m pytest tests/test_peak_memory.py -q
"""

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from moai_recipes.models.build import build_model, init_buffers
from moai_recipes.models.loss import token_loss_sum
from moai_recipes.train.peak_memory import _MemTracker
from tests.helpers import setup


def _measured(tracker_class, spec, tokens) -> int:
    """The peak of a second training step (the optimizer state made by a first) as `tracker_class` counts it."""
    torch.manual_seed(0)
    model = build_model(spec, max_seq_len=64)
    init_buffers(model, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        token_loss_sum(model, tokens, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = tracker_class()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    return sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())


def test_the_lean_tracker_measures_what_pytorchs_measures():
    _, spec, _ = setup("model=tiny", "flavor=cpu")
    torch.manual_seed(1)
    tokens = torch.randint(0, spec.vocab_size, (2, 48))
    ours, theirs = _measured(_MemTracker, spec, tokens), _measured(MemTracker, spec, tokens)
    assert ours == theirs and ours > 0, (ours, theirs)
    # More than the weights, their gradients and AdamW's two moments (fp32) held at once: activations counted too.
    weights = sum(p.numel() for p in build_model(spec, max_seq_len=64).parameters()) * 4
    assert ours > 4 * weights, (ours, weights)
