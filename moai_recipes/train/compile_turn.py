"""The processes of one CPU flavor compile their layers once: the first compiles, the others read its graphs.

Every process of cpu-2 or cpu-4 compiles the same layer graph (FSDP2's hooks stay outside it, so each sees the whole
layer), and they share the host's cores and inductor's cache folder. Compiling at once, each pays the whole cold
compile; waiting for the first, the others find its graphs in inductor's and AOTAutograd's caches and only trace
(a tiny LoRA model's cpu-2 run, its layer compiled cold, forward and backward: 81 CPU-seconds at once, 58 in turn,
the same wall time and losses, 2026-11-28). Only on one host: another has a cache folder of its own.
The backward is lowered with the forward (functorch's force_non_lazy_backward_lowering), so the first training
call holds the whole compile: the others wait for that call to end on a gloo group of their own, which no other
collective shares.

Only where every process is a data-parallel one (FSDP2 shards or replicas): a tensor, context or expert cut puts
collectives in the graph, where the first process would wait for the others' part while they wait for it, and a
pipeline's later stages reach their first call only once the first process has sent them its activations, after
it waited for them at the barrier. Not on GPUs, whose processes compile on cores of their own. Only the first call
with gradients: one that computes none (sampling before training) compiles its own, smaller graph, and every
process makes the same calls in the same order.

Not for torchao's 8-bit AdamW step (optimizer.states=int8), which compiles a graph per parameter shape: taken in
turn, the second process read all six of its graphs from the caches, yet the cpu-2 run took 55.6 CPU-seconds
against 51.8 at once, and 55.6 s of wall against 37.5 (processes compiling at once already share inductor's
kernels, each built once under its lock; what is left is small graphs' tracing, which both pay either way).
"""

import socket

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from moai_recipes.planner.plan import Plan
from moai_recipes.train.world import World


_TURN = None  # this process's, where its run compiles in turn


class CompileTurn:
    def __init__(self, group, first: bool):
        self.group = group
        self.first = first
        self.taken = False
        self.cache_hits: int | None = None  # a waiting process: graphs its first call read from the caches

    @classmethod
    def for_plan(cls, plan: Plan, world: World) -> "CompileTurn | None":
        """A turn for this process, or None where its layers compile as they are called. Called by every process
        at the same point (it makes a process group)."""
        global _TURN
        _TURN = None  # an earlier run's in this process counts no more
        if (not plan.compile or world.device.type != "cpu" or world.world_size == 1
                or max(plan.pipeline_stages, plan.tensor_parallel, plan.context_parallel, plan.expert_parallel) > 1):
            return None
        group = dist.new_group(backend="gloo")
        hosts = [None] * world.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:  # another host has a cache folder of its own: nothing there to read
            return None
        _TURN = cls(group, first=world.rank == 0)
        return _TURN

    def call(self, compiled, *args, **kwargs):
        """`compiled(*args, **kwargs)`, in turn if it is this process's first call with gradients."""
        if self.taken or not torch.is_grad_enabled():
            return compiled(*args, **kwargs)
        self.taken = True
        if not self.first:
            dist.barrier(group=self.group)  # until the first process has compiled (and run) its first call
        before = _cache_hits()
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            out = compiled(*args, **kwargs)
        if self.first:
            dist.barrier(group=self.group)
        else:
            self.cache_hits = _cache_hits() - before
        return out


def _cache_hits() -> int:
    return counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]


def read_from_cache() -> int:
    """1 if this process waited for the first one's compile and then read graphs from the caches, else 0 (summed
    over the processes at the end of a run: how many did not compile again)."""
    return int(_TURN is not None and bool(_TURN.cache_hits))
