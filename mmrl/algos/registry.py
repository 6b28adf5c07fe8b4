"""Name -> function registries for advantage estimators, policy losses and KL estimators.

Every name a user can put in a config lives in one of these tables, so the CLI can list them
(`list_algorithms`) and a typo fails early with the full list of valid names.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = [
    "AlgorithmError",
    "check_known_params",
    "AGG_MODES",
    "LossSpec",
    "AdvantageSpec",
    "register_loss",
    "register_advantage",
    "register_kl",
    "get_loss_spec",
    "get_advantage_spec",
    "get_kl_spec",
    "list_algorithms",
    "unknown_name_error",
]

# Aggregation modes (see `mmrl.algos.losses.aggregate`).
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

# Parameters every loss accepts on top of its own `defaults`: aggregation, and per-unit weights (policy_loss).
COMMON_LOSS_PARAMS: tuple[str, ...] = ("agg", "max_response_len", "denominator", "weights")


class AlgorithmError(ValueError):
    """Bad algorithm name, parameter or input (NaN, shape). A ValueError so config code can catch it."""


def unknown_name_error(kind: str, name: Any, valid: list[str] | tuple[str, ...]) -> AlgorithmError:
    return AlgorithmError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(valid))}")


@dataclass(frozen=True)
class LossSpec:
    """A registered policy loss.

    `fn(logp, old_logp, advantages, mask, **params) -> per_token | (per_token, metrics)` where
    `logp`/`old_logp` are [N,T] with masked-out positions already replaced by 0, `advantages` is
    [N,T] (a per-sequence advantage is broadcast; 0 at masked-out positions), `mask` is bool [N,T]
    and `params` are the loss's `defaults` overridden by the caller. `policy_loss` aggregates the
    returned per-token term with `agg` (default `default_agg`).
    """

    name: str
    fn: Callable[..., Any]
    default_agg: str
    citation: str
    defaults: Mapping[str, Any]
    aliases: tuple[str, ...] = ()
    description: str = ""
    sequence_advantage: bool = False  # needs one advantage per sequence (token weights are an error)

    @property
    def accepted_params(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.defaults) | set(COMMON_LOSS_PARAMS)))


@dataclass(frozen=True)
class AdvantageSpec:
    """A registered advantage estimator.

    `fn(rewards, groups, **params) -> Tensor[N]` with `rewards` float [N] and `groups` a
    `mmrl.algos.advantages.Groups` (vectorised per-group sum/mean/std/max helpers). `params` are the
    keyword-only arguments of `fn`; anything else is rejected.
    """

    name: str
    fn: Callable[..., Any] | None
    citation: str
    description: str = ""
    params: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class SimpleSpec:
    name: str
    fn: Callable[..., Any]
    citation: str
    description: str = ""


_LOSSES: dict[str, LossSpec] = {}
_LOSS_ALIASES: dict[str, str] = {}
_ADVANTAGES: dict[str, AdvantageSpec] = {}
_KL: dict[str, SimpleSpec] = {}


def _first_doc_line(fn: Callable[..., Any] | None) -> str:
    doc = inspect.getdoc(fn) if fn is not None else None
    return doc.strip().splitlines()[0] if doc else ""


def _check_new_name(name: str, taken: Mapping[str, Any], kind: str) -> None:
    if not isinstance(name, str) or not name:
        raise AlgorithmError(f"{kind} name must be a non-empty string, got {name!r}")
    if name in taken:
        raise AlgorithmError(f"{kind} {name!r} is already registered")


def register_loss(
    name: str,
    *,
    default_agg: str,
    citation: str,
    defaults: Mapping[str, Any] | None = None,
    aliases: tuple[str, ...] | list[str] = (),
    description: str | None = None,
    sequence_advantage: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make `fn` available as `policy_loss(name, ...)` (see `LossSpec` for its signature)."""
    if default_agg not in AGG_MODES:
        raise unknown_name_error("aggregation", default_agg, AGG_MODES)
    defaults = dict(defaults or {})
    clash = set(defaults) & set(COMMON_LOSS_PARAMS)
    if clash:
        raise AlgorithmError(f"loss defaults may not redefine common params {sorted(clash)}")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        taken = {**_LOSSES, **_LOSS_ALIASES}
        for n in (name, *aliases):
            _check_new_name(n, taken, "loss")
        spec = LossSpec(
            name=name,
            fn=fn,
            default_agg=default_agg,
            citation=citation,
            defaults=defaults,
            aliases=tuple(aliases),
            description=description if description is not None else _first_doc_line(fn),
            sequence_advantage=sequence_advantage,
        )
        _LOSSES[name] = spec
        for a in aliases:
            _LOSS_ALIASES[a] = name
        return fn

    return deco


def register_advantage(
    name: str, *, citation: str, description: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make `fn(rewards, groups, **params)` available as `compute_advantages(name, ...)`."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _check_new_name(name, _ADVANTAGES, "advantage")
        sig = inspect.signature(fn)
        params = tuple(
            p.name
            for p in list(sig.parameters.values())[2:]
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
        _ADVANTAGES[name] = AdvantageSpec(
            name=name,
            fn=fn,
            citation=citation,
            description=description if description is not None else _first_doc_line(fn),
            params=params,
        )
        return fn

    return deco


def register_kl(name: str, *, citation: str, description: str | None = None):
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _check_new_name(name, _KL, "kl")
        _KL[name] = SimpleSpec(name, fn, citation, description or _first_doc_line(fn))
        return fn

    return deco


def check_known_params(kind: str, name: str, params: Any, accepted: Any) -> None:
    """Raise AlgorithmError naming the parameters of `params` that the `kind` `name` does not accept."""
    bad = sorted(set(params) - set(accepted))
    if bad:
        raise AlgorithmError(f"unknown parameter(s) {', '.join(bad)} for {kind} {name!r}; "
                             f"accepted: {', '.join(accepted) or '(none)'}")


def get_loss_spec(name: str) -> LossSpec:
    """The registered spec of loss `name` (aliases resolve to their target)."""
    key = _LOSS_ALIASES.get(name, name) if isinstance(name, str) else name
    try:
        return _LOSSES[key]
    except (KeyError, TypeError):
        raise unknown_name_error("loss", name, [*_LOSSES, *_LOSS_ALIASES]) from None


def get_advantage_spec(name: str) -> AdvantageSpec:
    try:
        return _ADVANTAGES[name]
    except (KeyError, TypeError):
        raise unknown_name_error("advantage", name, list(_ADVANTAGES)) from None


def get_kl_spec(name: str) -> SimpleSpec:
    try:
        return _KL[name]
    except (KeyError, TypeError):
        raise unknown_name_error("kl estimator", name, list(_KL)) from None


def list_algorithms() -> dict[str, list[tuple[str, str, str]]]:
    """`{kind: [(name, citation, description), ...]}` for kinds advantage, loss, kl.

    Loss aliases appear as their own rows ("alias of X").
    """
    losses = [(s.name, s.citation, s.description) for s in _LOSSES.values()]
    losses += [
        (a, _LOSSES[t].citation, f"alias of {t}: {_LOSSES[t].description}") for a, t in _LOSS_ALIASES.items()
    ]
    return {
        "advantage": sorted((s.name, s.citation, s.description) for s in _ADVANTAGES.values()),
        "loss": sorted(losses),
        "kl": sorted((s.name, s.citation, s.description) for s in _KL.values()),
    }


# ---------------------------------------------------------------------------------------------
# Input checks shared by advantages, losses and shaping. They sync with the host (`.item()`),
# which is cheap next to a forward pass and turns silent NaN training into an immediate error.
# ---------------------------------------------------------------------------------------------


def check_finite(name: str, x: Any, mask: Any = None) -> None:
    """Raise AlgorithmError if `x` has NaN/inf where `mask` is True (everywhere if mask is None)."""
    import torch

    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask
    n_bad = int(bad.sum().item())
    if n_bad:
        where = "masked positions" if mask is not None else "positions"
        raise AlgorithmError(f"{name} contains NaN/inf at {n_bad} {where}")


def as_bool_mask(mask: Any, shape: Any, name: str = "mask") -> Any:
    import torch

    if not isinstance(mask, torch.Tensor):
        raise AlgorithmError(f"{name} must be a tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise AlgorithmError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    return mask if mask.dtype == torch.bool else mask != 0
