"""Parallelise a model in one place and one order (`parallelize`): activation checkpointing, then
compilation, then expert parallelism, then tensor parallelism, then pipeline stages, then FSDP2, then memory on
the device.

torchtitan's order: recomputation wraps each transformer layer first, then each layer is compiled
(around its recomputation), then `fully_shard` shards every layer and finally the root, so each
layer's parameters are all-gathered just in time.
FSDP2 is applied only where it does something (Plan.sharded): one fp32 process keeps a plain module.
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from moai_recipes.train.compile_turn import CompileTurn
from moai_recipes.train.world import World
from moai_recipes.models.attention import keep_attention_eager
from moai_recipes.models.build import init_buffers, is_nf4
from moai_recipes.models.moe import MoE
from moai_recipes.models.activation_offload import ActivationOffload
from moai_recipes.models.recompute import apply_recompute
from moai_recipes.models.tiled_mlp import apply_tiled_mlp
from moai_recipes.planner.plan import Plan
from moai_recipes.train.expert_parallel import apply_expert_parallel, apply_transformers_expert_parallel
from moai_recipes.train.pipeline import pipeline_stages
from moai_recipes.train.tensor_parallel import apply_tensor_parallel


def apply_compile(layers: nn.ModuleList, turn: CompileTurn | None = None) -> None:
    """torch.compile each layer's `forward` (plan.compile), as torchtitan compiles each block.

    The forward, not the module: FSDP2's hooks stay outside the graph (as with recomputation, models/recompute.py) and the
    parameter names stay the same (torch.compile(module) would prefix them with `_orig_mod.`). Every layer
    runs the same code, so one graph serves them all, dynamic in what changes from micro-batch to micro-batch (its
    rows and tokens: _mark_token_dims). Packed attention stays eager (models/attention.py). With a `turn`, the
    processes of a CPU flavor compile once (train/compile_turn.py).
    """
    keep_attention_eager()
    # No duck shapes: dynamo otherwise gives a row's length and a weight's dimension of the same size one symbol, and
    # the first row as long as the hidden size (a tiny model's 128 tokens, Llama's 4096) pins every later row to
    # that length: a recompile for each other one (seen: four compiles of one layer in four steps).
    torch.fx.experimental._config.use_duck_shape = False
    # What this process compiled before (an earlier run in the same process) is dropped, so that compiled_graphs()
    # counts this model's graphs alone; nothing of this run is compiled yet (graphs are captured at the first call).
    torch._dynamo.reset()
    for layer in layers:
        _COMPILED_CODE.add(layer.forward.__code__)
        layer.forward = _one_graph_for_every_layer(torch.compile(layer.forward), turn)


def _one_graph_for_every_layer(compiled, turn: CompileTurn | None = None):
    """The first layer's input made to require a gradient as every later layer's does: with frozen embeddings (LoRA)
    it requires none, and torch.compile would trace and compile the layer twice, once for it and once for the rest
    (a guard on requires_grad). Its gradient, computed and then dropped at the embeddings, is one layer's input
    gradient: less than a second compile costs (a tiny LoRA model's compiled run, cold: 25.6 s -> 21.0 s packed,
    23.1 s -> 20.4 s padded and recomputed, the same losses)."""
    def forward(x, *args, **kwargs):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not x.requires_grad and torch.is_grad_enabled():
            x = x.detach().requires_grad_()
        _mark_token_dims(x, args, kwargs)
        if turn is not None:
            return turn.call(compiled, x, *args, **kwargs)
        return compiled(x, *args, **kwargs)
    return forward


def _mark_token_dims(x, args: tuple, kwargs: dict) -> None:
    """Make dynamic, for torch.compile, the dimensions of a layer's inputs that change from micro-batch to
    micro-batch: the hidden states' rows and tokens (not their width) and every dimension of the other tensors handed
    to the layer (positions, a padded batch's mask). Nothing else: compiled with dynamic=True, every input was
    symbolic, the hidden size and the layer's float attributes too (its norms' eps, LoRA's alpha, attention's
    dropout: 8 symbols in a tiny LoRA layer against these 2), and dynamo's shape reasoning over them cost a sixth of
    a cold compile (one process, padded and recomputed: 52.7 CPU-seconds against 44.5; cpu-2's packed rows 84 against
    72; the same losses, one graph). Marked at every call, as only dynamo knows which call it traces."""
    if isinstance(x, torch.Tensor):
        for dim in range(x.dim() - 1):
            torch._dynamo.maybe_mark_dynamic(x, dim)
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            for dim in range(t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, dim)


_COMPILED_CODE: set = set()  # the code objects apply_compile compiled in this process


def compiled_graphs() -> int:
    """Graphs torch.compile captured of the layers apply_compile compiled (dynamo's cache entries of their code):
    theirs alone, not what else compiles in the process (torchao's 8-bit AdamW compiles its own step)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return sum(len(_debug_get_cache_entry_list(code)) for code in _COMPILED_CODE)


def parallelize(model: nn.Module, plan: Plan, world: World, spec=None) -> nn.Module:
    """Recompute, compile, cut, shard and give memory to a model built on the meta device, as `plan` says: each
    layer's MLP tiled (plan.tiled_mlp) and its recomputation first (its saved input offloaded to the host:
    plan.offload_activations), its compilation (plan.compile), a sparse layer's experts split over the expert
    dimension (plan.expert_parallel), then the tensor-parallel cut of its heads and MLP (plan.tensor_parallel),
    this device's pipeline stages (plan.pipeline_stages: the model returned holds
    only those; `spec`, the model's, tells them a Mixture-of-Experts model's routing to pass on), FSDP2 on each layer
    and each stage's root over the data x context devices (where Plan.sharded), then memory on the world's
    device (the CPU for what FSDP offloads) and the RoPE buffers. The weights come next
    (models.hf_format.load_weights). A LoRA model's base is frozen before: FSDP2 keeps requires_grad per
    parameter. `world` must be laid out for the plan (World.laid_out)."""
    apply_tiled_mlp(model.layers, plan.tiled_mlp)
    apply_recompute(model.layers, plan.recompute, ActivationOffload() if plan.offload_activations else None)
    if plan.compile:
        apply_compile(model.layers, CompileTurn.for_plan(plan, world))
    if plan.expert_parallel > 1:  # before the tensor cut, which keeps split experts as they are
        split = apply_expert_parallel if spec is None or spec.native else apply_transformers_expert_parallel
        split(model, world.dim("expert"))
    if plan.tensor_parallel > 1:
        apply_tensor_parallel(model, world.dim("tensor"))
    roots = [model]
    if plan.pipeline_stages > 1:
        model = pipeline_stages(model, plan, world, spec)
        roots = model.stages
    if plan.sharded:
        experts = world.dim("expert_shard") if plan.expert_parallel > 1 else None
        for root in roots:
            shard_model(root, mesh=world.dim("shard"), param_dtype=getattr(torch, plan.param_dtype),
                        reshard_after_forward=plan.reshard_after_forward, cpu_offload=plan.cpu_offload,
                        experts_mesh=experts)
    materialize(model, device=world.device, cpu_offload=plan.cpu_offload)
    init_buffers(model, device=world.device)
    return model


def shard_model(model: nn.Module, *, mesh: DeviceMesh, param_dtype: torch.dtype, reshard_after_forward: bool = True,
                cpu_offload: bool = False, experts_mesh: DeviceMesh | None = None) -> None:
    """FSDP2: shard each transformer layer (model.layers), then the root (embeddings, final norm, output; a
    pipeline stage's, train/pipeline.py).

    Experts split over the mesh's expert dimension (train/expert_parallel.py) are sharded over `experts_mesh`, what
    is left of the data-parallel devices (and the context devices that share their rows), as a group of their own.

    NF4 weights (QLoRA) are sharded like the others through torchao's FSDP2 all-gather hooks, except
    in a single process: FSDP2's world-size-1 shortcut passes only the first of NF4's three all-gather
    tensors to its post-all-gather hook (seen with torch 2.13), so there FSDP leaves
    them alone (nothing to shard in one process anyway).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    ignored = {p for p in model.parameters() if is_nf4(p)} if mesh.size() == 1 else set()
    layers = list(model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers)
    for i, layer in enumerate(layers):
        # The last layer is all-gathered again at once by the backward pass: keeping it saves a gather.
        last = i == len(layers) - 1
        experts = _experts(layer) if experts_mesh is not None else None
        if experts is not None:
            fully_shard(experts, mesh=experts_mesh, mp_policy=mp, offload_policy=offload,
                        reshard_after_forward=reshard_after_forward and not last, ignored_params=ignored)
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward and not last, ignored_params=ignored)
    # The root (embeddings, final norm, output) takes FSDP2's own default: gathered from the forward to
    # the backward, which needs it at once. Passing a bool would reshard it after the forward and gather
    # the largest group again at the start of every backward.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=None,
                ignored_params=ignored)


def _experts(layer: nn.Module) -> nn.Module | None:
    """A sparse layer's experts (ours: its MoE's GroupedExperts; transformers': its experts module), or None."""
    if isinstance(getattr(layer, "mlp", None), MoE):
        return layer.mlp.experts
    from moai_recipes.models.transformers_model import experts_of

    return experts_of(layer)


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: torch 2.13 keeps a list of them, 2.11 and 2.12 at most one."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        groups = [group] if group is not None else []
    return groups


@contextlib.contextmanager
def gathered(model: nn.Module, keep: bool = True):
    """Inside, each of the model's FSDP2 layers that reshards after its forward stays gathered from its first forward
    until the end, when they are sharded again: recipes.grpo's sampling gathers each layer once for a round of
    completions (plan.gather_for_generation), not again at every decode step. The root, and the layers of a plan that
    does not reshard after the forward, stay gathered from their forward anyway (no backward comes to reshard them).
    `keep=False`, or a plain module: nothing changes.

    FSDP2's own switch (set_reshard_after_forward, made for evaluation) would restore a layer to a plain true or
    false; the state it changes is put back as it was (the groups' post-forward mesh, the automatic choice)."""
    layers = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model
              and any(group.post_forward_mesh_info is not None for group in _param_groups(m._get_fsdp_state()))
              ] if keep else []
    before = []
    for layer in layers:
        state = layer._get_fsdp_state()
        before.append((state, state._auto_reshard_after_forward,
                       [(group, group.post_forward_mesh_info) for group in _param_groups(state)]))
        layer.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for state, auto, groups in before:
            state._auto_reshard_after_forward = auto
            for group, mesh_info in groups:
                group.post_forward_mesh_info = mesh_info
        for layer in layers:
            layer.reshard()


def materialize(model: nn.Module, *, device: torch.device, cpu_offload: bool) -> None:
    """Give the sharded meta model (uninitialised) memory: on `device`, or on the CPU where FSDP offloads.

    Parameters FSDP leaves alone (NF4 in a single process, see shard_model) are never offloaded:
    FSDP would not bring them to `device` for the forward pass.
    """
    model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                if not isinstance(p, DTensor):
                    moved = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                    setattr(module, name, moved)


def all_reduce_gradients(model: nn.Module) -> None:
    """Sum a replicated model's gradients over the processes, in one collective over one flat copy of them.
    Every trainable parameter takes part (a zero gradient where it has none), so that every rank sends the
    same buffer."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    for p, reduced in zip(params, _unflatten_dense_tensors(flat, grads)):
        p.grad = reduced
