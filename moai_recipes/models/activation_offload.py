"""The inputs a recomputed layer keeps for its backward, offloaded to host memory (plan.offload_activations).

Full recomputation keeps one tensor per layer and micro-batch through the forward: the layer's input, from which the
backward recomputes the rest (torch's checkpoint saves it through the saved-tensor hooks around it; inside the
checkpoint its own hooks keep nothing). Those are what a long row's activations are made of (32 layers x 64K tokens x
4,096 x 2 bytes: 17 GB of Llama-3-8B), and what these hooks move to the host: on a GPU each is copied to pinned host
memory on a side stream as soon as the layer has it, and brought back on that stream while the layer after it
(in the backward's order) computes, so the copies hide behind the compute (torchtune's offloading, for checkpoints).

On the CPU the host is the device: the copy is made (the same code runs, and tests check its losses) but saves no
memory, so the planner never chooses it there.
"""

from dataclasses import dataclass, field

import torch
from torch import nn

# Tensors smaller than this stay where they are: the positions or masks a layer takes beside its input; a copy costs
# a transfer's latency whatever its size.
MIN_BYTES = 1 << 16


@dataclass
class _Offloaded:
    key: int
    host: torch.Tensor
    device: torch.device
    copied: object = None  # the side stream's event after the copy to the host (a GPU's)
    fetched: torch.Tensor | None = None  # brought back ahead of its use (a GPU's prefetch)
    fetch_done: object = None


@dataclass
class ActivationOffload:
    """saved_tensors_hooks that keep a layer's saved inputs on the host: `with offload.hooks(): ...` around the
    recomputed layer's checkpoint call (models/recompute.py)."""

    offloaded_bytes: int = 0  # moved to the host so far (tests read it: the path ran)
    _next: int = 0
    _waiting: dict = field(default_factory=dict)  # key -> _Offloaded, not yet brought back
    _stream: object = None

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _side_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, t: torch.Tensor):
        if t.numel() * t.element_size() < MIN_BYTES or isinstance(t, nn.Parameter):
            return t
        key, self._next = self._next, self._next + 1
        if t.device.type == "cuda":
            stream = self._side_stream(t.device)
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # the input is written
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # its memory is not reused before the copy ends
            packed = _Offloaded(key, host, t.device, copied=stream.record_event())
        else:
            packed = _Offloaded(key, t.detach().clone(), t.device)
        self.offloaded_bytes += t.numel() * t.element_size()
        self._waiting[key] = packed
        return packed

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        self._waiting.pop(packed.key, None)
        if packed.device.type != "cuda":
            return packed.host
        current = torch.cuda.current_stream(packed.device)
        if packed.fetched is not None:
            current.wait_event(packed.fetch_done)
            tensor = packed.fetched
            tensor.record_stream(current)
            packed.fetched = None
        else:
            current.wait_event(packed.copied)
            tensor = packed.host.to(packed.device, non_blocking=True)
        # The backward runs the layers in reverse: the input saved just before this one is the next needed. Bring it
        # back on the side stream while this layer's backward computes.
        before = self._waiting.get(packed.key - 1)
        if before is not None and before.fetched is None:
            stream = self._side_stream(packed.device)
            stream.wait_event(before.copied)
            with torch.cuda.stream(stream):
                before.fetched = before.host.to(before.device, non_blocking=True)
            before.fetch_done = stream.record_event()
        return tensor
