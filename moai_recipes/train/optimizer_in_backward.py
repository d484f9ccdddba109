"""AdamW applied in the backward (plan.optimizer_in_backward): each parameter is updated as soon as its gradient of the
step is complete, and the gradient freed at once, so a step never holds the whole model's gradients (torchtune's
`optimizer_in_bwd`).

To everything else (the schedule, step checkpoints, the memory tracker) it is one AdamW over all the parameters, in
one parameter group: its `state_dict` is a plain AdamW's, so a checkpoint written with the optimizer in the backward
resumes without it and the other way round. Inside, one engine per parameter (torch's fused AdamW, or torchao's 8-bit
one: train/optim.build_optimizer) shares that state; a hook steps a parameter's engine when its gradient arrives in
the step's last micro-batch (FSDP2: the sharded gradient, after its reduce-scatter; a plain module computing on bf16
copies: once the copy's gradient is added to its fp32 master, train/mixed_precision.py). Earlier micro-batches
accumulate as without it. `step()` then applies what is left (a parameter that got no gradient in the last
micro-batch), and only if the loss was finite.

What the backward cannot do: clip. The total norm is known only after the last gradient, when the others are applied
already, so the planner offers it only with optimizer.max_grad_norm=null. The norm is still measured, as each gradient
goes by. A gradient that is not finite is not applied (torch's fused AdamW skips it on the device, `found_inf`, with
no synchronisation; the 8-bit AdamW checks it on the host): a NaN loss leaves every weight as it was, as without it.
A step whose gradients are finite in part (an overflow in the first layers: their gradients come last) has applied
the finite ones by the time the bad one comes, where a step after the backward applies none; the loop then redoes the
steps since the last checkpoint with that one skipped whole (`discarding`; errors.RedoSkipping), so that the run is
the one a step after the backward makes.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moai_recipes.planner.plan import Plan


class AdamWInBackward(torch.optim.Optimizer):
    def __init__(self, params, plan: Plan, engine):
        """`engine(params)`: the AdamW that updates one parameter (train/optim.build_optimizer's)."""
        params = [p for p in params if p.requires_grad]
        self._engines = {p: engine([p]) for p in params}
        super().__init__(params, dict(next(iter(self._engines.values())).defaults))
        self._share()
        # torch's fused AdamW takes a device tensor saying "skip": no host synchronisation per parameter
        self._skips_on_device = plan.optimizer_states != "int8"
        self.armed = False  # set by the loop before the step's last micro-batch's backward
        self.applied = 0  # parameters updated in this step's backward so far
        # The step is one to skip whole (redone after it was partly applied: errors.RedoSkipping): its gradients
        # are measured and dropped, none applied. Set by the loop.
        self.discarding = False
        self._finite = None  # this rank's count of the step's gradients the backward applied, all finite ones
        self.applied_some = False  # the last step's backward applied a gradient on some rank (gradient_norm)
        self._squares = None  # this rank's sum of squared gradient values of the step, each counted once in the world
        for p in params:
            p.register_post_accumulate_grad_hook(self.gradient_ready)

    def _share(self) -> None:
        """Every engine keeps its moments in this optimizer's state (one dict, keyed by parameter)."""
        for engine in self._engines.values():
            engine.state = self.state

    def gradient_ready(self, param: torch.Tensor) -> None:
        """A parameter's gradient is complete for this micro-batch: applied and freed when it is the step's last."""
        if not self.armed:
            return
        self._apply(param, in_backward=True)
        self.applied += not self.discarding

    def _apply(self, param: torch.Tensor, *, in_backward: bool) -> None:
        grad = param.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        squares = torch.linalg.vector_norm(local, dtype=torch.float32).square() / _copies(grad)
        self._squares = squares if self._squares is None else self._squares + squares
        if self.discarding:
            param.grad = None
            return
        if in_backward:  # applied below where finite: counted on the device, read with the norm
            finite = torch.isfinite(squares).float()
            self._finite = finite if self._finite is None else self._finite + finite
        engine = self._engines[param]
        group = engine.param_groups[0]
        lr = self.param_groups[0]["lr"]  # the schedule sets it on the one group (the others stay as built)
        if isinstance(group["lr"], torch.Tensor) and not isinstance(lr, torch.Tensor):
            group["lr"].fill_(lr)  # torchao keeps its learning rate in a tensor
        else:
            group["lr"] = lr
        if in_backward and self._skips_on_device:
            engine.found_inf = (~torch.isfinite(squares)).float()
            engine.step()
            engine.found_inf = None
        elif not in_backward or math.isfinite(float(squares)):
            engine.step()
        param.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        """Apply the gradients the backward did not (none when every parameter had one in the last micro-batch)."""
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                self._apply(p, in_backward=False)
        self._squares, self._finite, self.applied, self.armed = None, None, 0, False

    def gradient_norm(self) -> float:
        """The step's total gradient norm: of what the backward applied and what is left, over every rank's shards;
        and whether the backward applied any gradient on any rank (`applied_some`). Every rank calls it (a collective
        where there are several)."""
        zero = torch.zeros((), device=self.param_groups[0]["params"][0].device)
        squares = zero if self._squares is None else self._squares
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                squares = squares + torch.linalg.vector_norm(local, dtype=torch.float32).square() / _copies(p.grad)
        both = torch.stack([squares, zero if self._finite is None else self._finite]).double()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both)
        self._squares = self._finite = None
        squares, applied = both.tolist()
        self.applied_some = applied > 0
        return math.sqrt(squares) if squares >= 0 else math.nan

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=True)
        self._squares, self._finite, self.applied, self.armed = None, None, 0, False

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._share()  # the loaded state is a new dict


def _copies(grad: torch.Tensor) -> int:
    """On how many ranks this rank's part of a gradient is held: the mesh dimensions it is replicated over (a norm's
    weight under tensor parallelism), so that summing every rank's squares counts each value once."""
    if not isinstance(grad, DTensor):
        return 1
    mesh = grad.device_mesh
    return math.prod(mesh.size(i) for i, placement in enumerate(grad.placements) if placement.is_replicate())
