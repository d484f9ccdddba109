"""The optimizer, its schedule and gradient clipping, as every recipe builds them."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def build_optimizer(params, *, lr: float, betas, eps: float, weight_decay: float, device: torch.device):
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **impl)


def build_scheduler(optimizer, *, warmup_steps: int, total_steps: int):
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)


def clip_gradients(model: nn.Module, max_norm: float | None) -> float:
    """Clip to `max_norm` (None: measure only) and return the total gradient norm before clipping."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, norm)
    return float(norm)


