"""Muon for the drafter's weight matrices (`train.optimizer=muon`), stepped beside AdamW as one optimizer.

Muon keeps a Nesterov momentum of each matrix's gradient and steps along that momentum orthogonalised: a quintic
Newton-Schulz iteration in bf16 brings its singular values near 1 (Keller Jordan's Muon, the algorithm of
`torch.optim.Muon`, whose step ours equals on whole tensors; tests/test_optim_muon.py). The step is scaled by
0.2 * sqrt(max(rows, cols)) so that its RMS is about AdamW's (Moonshot's "match_rms_adamw").

Ours rather than `torch.optim.Muon` for FSDP2: the orthogonalisation needs the whole matrix, so a sharded (DTensor)
matrix's momentum is gathered and the rank keeps its own rows of the orthogonalised result; the momentum and the
weights stay sharded. On unsharded matrices nothing is gathered.

Split across data-parallel ranks (`group` of more than one rank): every rank holds the same momentum (the gradients
were averaged), so each matrix is orthogonalised by one rank, its owner (matrices dealt out by their Newton-Schulz
FLOPs, largest first, to the least loaded rank), and broadcast from it: each rank does about 1/world of the work,
and every rank applies the same bits it would have computed itself.

`MuonAdamW` holds torch's AdamW and our Muon under one `torch.optim.Optimizer`: one lr scheduler scales every
group of both, and one state dict (the groups in order, the state by parameter) saves and restores both,
sharded or not.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
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


def ns_flops(shape: torch.Size, steps: int = NS_STEPS) -> int:
    """Multiply-adds x 2 of `orthogonalize` on an (A, B) matrix: per step two (n, n, m) products and one (n, n, n),
    n = min(A, B), m = max(A, B)."""
    n, m = min(shape[0], shape[1]), max(shape[0], shape[1])
    return steps * 2 * (2 * n * n * m + n * n * n)


def deal_owners(shapes: list[torch.Size], world: int) -> list[int]:
    """The rank that orthogonalises each matrix: largest first, each to the rank with the fewest FLOPs so far (ties to
    the lowest rank). The same on every rank (it depends on the shapes alone)."""
    load = [0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i]), i)):
        owners[i] = min(range(world), key=lambda r: (load[r], r))
        load[owners[i]] += ns_flops(shapes[i])
    return owners


def _whole(update: torch.Tensor) -> torch.Tensor:
    """The whole matrix of an update: a DTensor (FSDP2) gathered (a collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return update.full_tensor() if isinstance(update, DTensor) else update


Layout = Optional[tuple[Any, tuple]]
"""A sharded (DTensor) matrix's (device mesh, placements); None for a plain tensor."""


def _layout(update: torch.Tensor) -> Layout:
    from torch.distributed.tensor import DTensor

    return (update.device_mesh, tuple(update.placements)) if isinstance(update, DTensor) else None


def _laid_out(whole: torch.Tensor, layout: Layout) -> torch.Tensor:
    """An orthogonalised whole matrix in `layout`: for a sharded one, this rank's rows (a local slice)."""
    from torch.distributed.tensor import DTensor, Replicate

    if layout is None:
        return whole
    mesh, placements = layout
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements)


IN_FLIGHT_BYTES = 1 << 30
"""Orthogonalised matrices a rank holds before it applies the oldest (with several ranks): enough to keep every
owner computing while the broadcasts arrive, a bound on the memory they take."""


def orthogonalized(params: list[torch.Tensor], update_of: Callable[[int], torch.Tensor],
                   group: Optional[dist.ProcessGroup]) -> Iterator[tuple[int, torch.Tensor]]:
    """(i, the orthogonalised update of params[i], laid out as the parameter) for each matrix in order; `update_of(i)`
    makes that update (A, B) on demand, so that no more than one exists at a time on one rank. With a `group` of more
    than one rank, whose ranks all hold the same updates, each matrix is computed by its owner alone (`deal_owners`)
    and broadcast to the others, at most about IN_FLIGHT_BYTES of results held at once; every rank must go through
    the same list (the collectives, and when each result is handed out, follow the shapes alone: the same order on
    every rank)."""
    from torch.distributed.tensor import DTensor

    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        for i in range(len(params)):
            update = update_of(i)
            yield i, _laid_out(orthogonalize(_whole(update)), _layout(update))
        return
    rank = dist.get_rank(group)
    pending: collections.deque = collections.deque()
    held = 0  # bytes of the results in `pending`

    def handed(entry) -> tuple[int, torch.Tensor]:
        i, out, work, layout = entry
        work.wait()  # the owner's result has arrived (on CUDA: the compute stream waits for the copy)
        return i, _laid_out(out, layout)

    for i, owner in enumerate(deal_owners([p.shape for p in params], world)):
        sharded = isinstance(params[i], DTensor)
        # a sharded update is gathered by a collective that every rank joins; a whole one only its owner needs
        update = update_of(i) if owner == rank or sharded else None
        layout = _layout(update) if sharded else None
        if owner == rank:
            out = orthogonalize(_whole(update)).contiguous()  # (A, B) bf16
        else:
            if sharded:
                _whole(update)  # the gather's collective, joined (its result is the owner's to use)
            device = params[i].to_local().device if sharded else params[i].device
            out = torch.empty(params[i].shape, dtype=torch.bfloat16, device=device)  # (A, B), the owner's result
        del update
        work = dist.broadcast(out, src=dist.get_global_rank(group, owner), group=group, async_op=True)
        if sharded:  # the next matrix's gather is a functional collective: gloo may run it on another thread
            work.wait()  # beside an async one on the same group, which it does not support
        pending.append((i, out, work, layout))
        held += out.numel() * out.element_size()
        while held > IN_FLIGHT_BYTES and len(pending) > 1:  # the oldest first: their owners are furthest ahead
            entry = pending.popleft()
            held -= entry[1].numel() * entry[1].element_size()
            yield handed(entry)
    while pending:
        yield handed(pending.popleft())


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
                 nesterov: bool = True, group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov))
        self.group = group
        """Data-parallel ranks holding the same gradients, which split the orthogonalisations (None: this rank alone)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon steps 2-D matrices only, got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        stepped = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                state["momentum_buffer"].lerp_(p.grad, 1 - group["momentum"])  # (A, B), or this rank's rows of it
                stepped.append((p, group))

        def update_of(i: int) -> torch.Tensor:  # (A, B): the step's direction before orthogonalising
            p, group = stepped[i]
            buf = self.state[p]["momentum_buffer"]
            return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf  # Nesterov's look-ahead

        for i, update in orthogonalized([p for p, _ in stepped], update_of, self.group):  # (A, B) bf16
            p, group = stepped[i]
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-group["lr"] * update_scale(p.shape))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """AdamW's groups, then Muon's, as one optimizer: its `param_groups` are the parts' group dicts themselves and
    its `state` is theirs, so a scheduler or a state-dict load reaches both. Each group names its part
    (`group["optimizer"]`: adamw | muon); `step` steps both."""

    def __init__(self, adamw_groups: list[dict], muon_groups: list[dict], *, betas: tuple[float, float],
                 fused: Optional[bool], momentum: float, group: Optional[dist.ProcessGroup] = None) -> None:
        self.parts: dict[str, torch.optim.Optimizer] = {}
        if adamw_groups:
            self.parts["adamw"] = torch.optim.AdamW(adamw_groups, betas=betas, fused=fused)
        if muon_groups:
            self.parts["muon"] = Muon(muon_groups, lr=muon_groups[0]["lr"], momentum=momentum, group=group)
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
