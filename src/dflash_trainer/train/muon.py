"""Muon for the drafter's weight matrices (`train.optimizer=muon`), stepped beside AdamW as one optimizer.

Muon keeps a Nesterov momentum of each matrix's gradient and steps along that momentum orthogonalised: a quintic
Newton-Schulz iteration in bf16 brings its singular values near 1 (Keller Jordan's Muon, the algorithm of
`torch.optim.Muon`, whose step ours equals on whole tensors; tests/test_optim_muon.py). The step is scaled by
0.2 * sqrt(max(rows, cols)) so that its RMS is about AdamW's (Moonshot's "match_rms_adamw").

Ours rather than `torch.optim.Muon` for FSDP2: the orthogonalisation needs the whole matrix, so a sharded (DTensor)
matrix's momentum is gathered, orthogonalised whole on every rank and the rank keeps its own rows of the result;
the momentum and the weights stay sharded. On unsharded matrices nothing is gathered.

`MuonAdamW` holds torch's AdamW and our Muon under one `torch.optim.Optimizer`: one lr scheduler scales every
group of both, and one state dict (the groups in order, the state by parameter) saves and restores both,
sharded or not.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic's (a, b, c): its slope at zero as steep as still converges near 1 (Keller Jordan's)."""
NS_STEPS = 5
NS_EPS = 1e-7


def orthogonalize(matrix: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """(A, B) -> (A, B) bf16, about U V^T of the matrix's SVD U S V^T (singular values in about [0.7, 1.2])."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T  # (B, A): the Gram matrix below is the smaller side's
    x = x / x.norm().clamp(min=NS_EPS)  # Frobenius norm >= spectral norm: singular values <= 1
    for _ in range(steps):
        gram = x @ x.T  # (n, n), n = min(A, B)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x.T if tall else x


def _orthogonalize_whole(update: torch.Tensor) -> torch.Tensor:
    """`orthogonalize` of the whole matrix; for a DTensor (FSDP2) gathered first, and this rank's shard returned."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(update, DTensor):
        return orthogonalize(update)
    mesh = update.device_mesh
    whole = orthogonalize(update.full_tensor())  # a collective: every rank steps every matrix
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, update.placements)  # this rank's rows (a local slice, no communication)


def update_scale(shape: torch.Size) -> float:
    """The lr multiplier of a (rows, cols) matrix's orthogonalised step: its RMS becomes about AdamW's."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


def _evaluate(closure) -> Optional[torch.Tensor]:
    """An optimizer's `closure` (recomputes the loss) run with gradients on, or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters (whole or FSDP2-sharded); weight decay decoupled, as AdamW's."""

    def __init__(self, params, *, lr: float, momentum: float = 0.95, weight_decay: float = 0.0,
                 nesterov: bool = True) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov))
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon steps 2-D matrices only, got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)  # (A, B), or this rank's rows of it: the momentum
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf  # (A, B): Nesterov's look-ahead
                update = _orthogonalize_whole(update)  # (A, B) bf16
                p.mul_(1 - lr * decay)
                p.add_(update, alpha=-lr * update_scale(p.shape))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """AdamW's groups, then Muon's, as one optimizer: its `param_groups` are the parts' group dicts themselves and
    its `state` is theirs, so a scheduler or a state-dict load reaches both. Each group names its part
    (`group["optimizer"]`: adamw | muon); `step` steps both."""

    def __init__(self, adamw_groups: list[dict], muon_groups: list[dict], *, betas: tuple[float, float],
                 fused: Optional[bool], momentum: float) -> None:
        self.parts: dict[str, torch.optim.Optimizer] = {}
        if adamw_groups:
            self.parts["adamw"] = torch.optim.AdamW(adamw_groups, betas=betas, fused=fused)
        if muon_groups:
            self.parts["muon"] = Muon(muon_groups, lr=muon_groups[0]["lr"], momentum=momentum)
        groups = []
        for name, part in self.parts.items():
            for group in part.param_groups:
                group["optimizer"] = name
                groups.append(group)
        super().__init__(groups, {})
        self._link()

    def _link(self) -> None:
        """Point each part at this optimizer's groups (by their `optimizer` tag) and its state."""
        for name, part in self.parts.items():
            part.param_groups = [g for g in self.param_groups if g["optimizer"] == name]
            part.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for part in self.parts.values():
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: the parts follow
        self._link()


def is_vocabulary_table(name: str, p: nn.Parameter, *, vocab_size: int, embeddings: set[str]) -> bool:
    """A parameter indexed by the vocabulary (a dimension of `vocab_size`, or an nn.Embedding's weight): DFlash2's
    codebooks, DSpark's Markov factors, any embedding-like table a variant adds."""
    return name in embeddings or vocab_size in tuple(p.shape)


def route_parameters(model: nn.Module, vocab_size: int) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The trainable parameters by where `train.optimizer=muon` steps them: `muon` (2-D matrices, both sides > 1),
    `tables` (vocabulary tables: AdamW at Muon's lr, since orthogonalising a table is meaningless and at AdamW's
    lr they barely train) and `adamw` (norms, 1-D and 3-D parameters, degenerate matrices: AdamW at train.lr)."""
    embeddings = {f"{m}.weight" if m else "weight" for m, module in model.named_modules()
                  if isinstance(module, nn.Embedding)}
    routes: dict[str, list[tuple[str, nn.Parameter]]] = {"muon": [], "tables": [], "adamw": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_vocabulary_table(name, p, vocab_size=vocab_size, embeddings=embeddings):
            routes["tables"].append((name, p))
        elif p.ndim == 2 and min(p.shape) > 1:
            routes["muon"].append((name, p))
        else:
            routes["adamw"].append((name, p))
    return routes
