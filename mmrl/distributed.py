"""Several processes, one run: torch.distributed under torchrun (gloo on CPU, nccl on GPU).

Each rank samples its own whole groups, so group statistics never cross ranks. What must be
global is made so here: the batch the advantage estimator sees (gathered), the loss normaliser
(all-reduced), the gradient (averaged: all-reduced in replicate mode, reduce-scattered by FSDP2
when `train.fsdp`), the metrics (what one process logs on the union batch) and the held-out
evaluation (each rank scores its block; the scores are gathered). Each rank's loss is scaled so
that the average over ranks of the per-rank gradients is the gradient of one process on the whole
batch.

With one process every helper is the identity, so a single-process run is unchanged bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Collection
from typing import Any, Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    fsdp: bool = False
    comm_device: str = "cpu"  # where collective buffers live: cpu for gloo, cuda for nccl

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


SINGLE = Dist()

# Rank r's random streams are seeded seed + r * RANK_SEED_STRIDE (rank 0: the single-process seeds).
RANK_SEED_STRIDE = 1_000_003


def launched() -> bool:
    """Whether torchrun (or another launcher setting RANK / WORLD_SIZE) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and launched():  # under torchrun: this rank's GPU
        return torch.device("cuda", local_rank())
    return torch.device(name)


def setup(device: str, timeout_s: float, fsdp: bool = False) -> Dist:
    """Join the process group that the launcher describes in the environment; one process otherwise.
    `timeout_s` bounds every collective, so a rank that hangs ends the run with an error instead of
    blocking the others forever."""
    if not launched():
        return SINGLE
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(local_rank())
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return current(fsdp)


def current(fsdp: bool = False) -> Dist:
    """The process group this process is in (one process when none is initialised; it shards
    nothing, `train.fsdp` or not)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return SINGLE
    comm = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), fsdp=fsdp, comm_device=comm)


# ------------------------------------------------------------------ collectives


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()


def exit_rank(code: int):
    """End a launched rank's process: when it succeeded, once every rank has (a barrier), then out
    without the interpreter's teardown of the process group, in which gloo aborts a rank now and
    then ("terminate called without an active exception", SIGABRT, after a run that finished; seen
    about once in 8 two-rank runs on a 2-core machine). Exit handlers and output are flushed first."""
    import atexit
    import sys

    if code == 0:
        barrier(current())
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_gather_ints(d: Dist, values: list[int]) -> list[list[int]]:
    """Every rank's `values` (the same length on every rank), in rank order."""
    if not d.active:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.long, device=d.comm_device)
    out = [torch.empty_like(mine) for _ in range(d.world)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def all_sum(d: Dist, value: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a tensor (a copy; the input is left alone)."""
    if not d.active:
        return value
    out = value.detach().to(d.comm_device, copy=True)
    dist.all_reduce(out)
    return out.to(value.device)


def all_max(d: Dist, value: int) -> int:
    """The largest `value` over ranks."""
    if not d.active:
        return value
    t = torch.tensor([value], dtype=torch.long, device=d.comm_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gather_rows(d: Dist, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], slice]:
    """Concatenate each tensor along dim 0 over ranks (in rank order); a dim 1 of different length
    per rank is right-padded with zeros to the longest. Returns the global tensors and this rank's
    rows in them."""
    if not d.active:
        return tensors, slice(0, len(tensors[0]))
    n = len(tensors[0])
    sizes = [s[0] for s in all_gather_ints(d, [n])]
    start = sum(sizes[: d.rank])
    widths = [all_max(d, t.shape[1]) if t.dim() > 1 else 0 for t in tensors]
    out = []
    for t, width in zip(tensors, widths):
        if t.dim() > 1 and t.shape[1] < width:
            t = torch.cat([t, t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))], 1)
        send = t.to(d.comm_device, torch.uint8 if t.dtype == torch.bool else t.dtype)
        padded = torch.cat([send, send.new_zeros((max(sizes) - n, *send.shape[1:]))]) if n < max(sizes) else send
        parts = [torch.empty_like(padded) for _ in range(d.world)]
        dist.all_gather(parts, padded.contiguous())
        out.append(torch.cat([p[:s] for p, s in zip(parts, sizes)]).to(t.device, t.dtype))
    return out, slice(start, start + n)


def average_gradients(d: Dist, params: list[torch.nn.Parameter]) -> None:
    """Replicate mode: average the accumulated gradients over ranks in one flat all-reduce (a rank
    whose batch had no rows contributes zeros). FSDP2 averages its own in the backward."""
    if not d.active or d.fsdp:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]).to(d.comm_device)
    dist.all_reduce(flat)
    flat = flat.to(params[0].device) / d.world
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset: offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()


def broadcast_parameters(d: Dist, module: torch.nn.Module) -> None:
    """Replicate mode: start every rank from rank 0's weights (the same seed builds the same model,
    but a non-deterministic initialiser must not leave the replicas apart)."""
    if not d.active or d.fsdp:
        return
    for t in [*module.parameters(), *module.buffers()]:
        buf = t.data.to(d.comm_device)
        dist.broadcast(buf, 0)
        t.data.copy_(buf.to(t.device))


def rank_block(n: int, d: Dist) -> slice:
    """This rank's contiguous block of `n` items (the first n % world ranks take one more), so the
    blocks joined in rank order are the items in their order."""
    base, extra = divmod(n, d.world)
    start = d.rank * base + min(d.rank, extra)
    return slice(start, start + base + (d.rank < extra))


def gather_objects(d: Dist, items: list[Any]) -> list[Any]:
    """Every rank's `items` (picklable; tensors travel on the CPU) joined in rank order."""
    if not d.active:
        return items
    every: list[list[Any]] = [[] for _ in range(d.world)]
    dist.all_gather_object(every, [x.cpu() if isinstance(x, torch.Tensor) else x for x in items])
    return [x for part in every for x in part]


def first_message(d: Dist, message: Any) -> Any:
    """The first rank's (in rank order) message (a picklable value) that is not None, on every rank;
    a fault one rank met then ends the step on all of them together instead of leaving the others
    in a collective."""
    if not d.active:
        return message
    every: list[Any] = [None] * d.world
    dist.all_gather_object(every, message)
    return next((m for m in every if m is not None), None)


# Metrics combined over ranks by a sum (counters) instead of a mean.
SUMMED_METRICS = ("sampling/kept_groups", "sampling/short_groups", "replay/pushed", "replay/drawn",
                  "replay/size", "guide/failed_groups", "gen_tokens")
# The loss and its terms (mmrl.stages) are normalised by the whole step over every rank: each
# rank logs world x its share, so one process's value is their mean over every rank, a rank without
# rows (which logs none) counting 0. The trainer names its terms; these are the built-in ones.
STEP_NORMALISED = ("train/loss", "train/entropy", "train/kl_ref", "train/perception_kl", "train/entropy_masked")
_EXTREME = re.compile(r"[/_](max|min)$")  # adv/max, len/max, ratio_min: whatever the separator


def combine(key: str, values: list[float], weights: list[float], world: int, summed: bool = False,
            step_normalised: Collection[str] = STEP_NORMALISED) -> float:
    """One metric's value over the ranks that logged it: extremes by max / min, counters summed,
    step-normalised loss terms averaged over the `world`, else the mean weighted by how many items
    each rank's value is a mean over. Equal values pass through unchanged: a statistic every rank
    computed on the gathered batch is already the one-process value."""
    extreme = _EXTREME.search(key)
    if extreme:
        return max(values) if extreme.group(1) == "max" else min(values)
    if summed or key in SUMMED_METRICS:
        return sum(values)
    if key in step_normalised:
        return sum(values) / world
    if min(values) == max(values):
        return values[0]
    total = sum(weights)
    if total <= 0:  # no rank had an item: the plain mean
        return sum(values) / len(values)
    return sum(v * w for v, w in zip(values, weights)) / total


def reduce_metrics(d: Dist, metrics: dict[str, float], weights: dict[str, float] | None = None,
                   summed: Collection[str] = (), step_normalised: Collection[str] = STEP_NORMALISED
                   ) -> dict[str, float]:
    """Combine every rank's metrics into what one process on the union batch logs (see `combine`);
    `weights[key]` is the number of items this rank's `key` is a mean over (1 for a key without
    one); `summed` names more counters (a reward's `counted_metrics`), `step_normalised` the
    loss and its terms. A key that only some ranks
    logged (a warning's counter) is combined over those."""
    if not d.active:
        return metrics
    weights = weights or {}
    mine = {k: (float(v), float(weights.get(k, 1.0))) for k, v in metrics.items()}
    every: list[dict[str, tuple[float, float]]] = [{} for _ in range(d.world)]
    dist.all_gather_object(every, mine)
    out: dict[str, float] = {}
    for key in sorted({k for m in every for k in m}):
        pairs = [m[key] for m in every if key in m]
        out[key] = combine(key, [v for v, _ in pairs], [w for _, w in pairs], d.world, key in summed, step_normalised)
    return out


# ------------------------------------------------------------------ FSDP2


def shard(module: torch.nn.Module, bf16: bool) -> torch.nn.Module:
    """FSDP2 `fully_shard`: each transformer block of a transformers model (`_no_split_modules`)
    is its own shard group, then the root; parameters become DTensors sharded over the ranks. On
    GPU with `bf16` the forward runs in bf16 and gradients are reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if bf16 and torch.cuda.is_available():
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    block_names = set(getattr(module, "_no_split_modules", None) or [])
    for sub in module.modules():
        if sub is not module and type(sub).__name__ in block_names:
            fully_shard(sub, **kwargs)
    fully_shard(module, **kwargs)
    return module


def fsdp_modules(module: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


_unsharded_depth = 0  # full_parameters nests (evaluation samples through the trainer): only the outermost acts


@contextlib.contextmanager
def full_parameters(*modules: torch.nn.Module | None) -> Iterator[None]:
    """While entered, FSDP modules hold their whole parameters and do no collectives in forward, so
    ranks may run different numbers of forwards (sampling to different lengths, evaluation)."""
    global _unsharded_depth
    groups = [] if _unsharded_depth else [m for module in modules if module is not None for m in fsdp_modules(module)]
    for m in groups:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    _unsharded_depth += 1
    try:
        yield
    finally:
        _unsharded_depth -= 1
        for m in groups:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


@contextlib.contextmanager
def consolidated(d: Dist, module: torch.nn.Module) -> Iterator[None]:
    """While entered, rank 0's `module.state_dict()` is the whole, unsharded state (on the CPU), so a
    policy's own `save` (save_pretrained, torch.save) writes what a single process writes. Every
    rank must enter it (gathering the shards is collective)."""
    if not d.fsdp:
        yield
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    module.state_dict = lambda *args, **kwargs: full  # an instance attribute shadows the method
    try:
        yield
    finally:
        del module.state_dict
