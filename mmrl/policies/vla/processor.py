"""What turns data into a VLA's inputs and its outputs back, shared by every VLA backbone.

- actions <-> tokens: `ActionBins` cuts each of the A action dims into `n_bins` uniform bins over
  [low, high] (a bin maps back to its centre); `action_token_names` / `add_action_tokens` are the
  `<act_i>` special tokens an action-token VLA decodes them as.
- observations: `observation_images` stacks a batch's camera images as one uint8
  [B, cameras, H, W, 3] array (`select_cameras` names a missing camera).
- SFT contexts: `parse_sft_context` is the one reader of expert data, whatever its source:

      images       "images" {camera: HxWx3}, lerobot's "observation.images.<camera>" (CxHxW float
                   in [0, 1] or HxWx3 uint8), or "frame" (one image or a list)
      instruction  "instruction", or "prompt"
      actions      "actions" or "action" [K, A], cut or padded (last action repeated) to the chunk,
                   with lerobot's optional "action_is_pad" [K]
      state        "state", or "observation.state"

- rollouts: `acted_chunks` finds the chunks a window of a trajectory rollout's units touches (units
  are chunk-major, `per_chunk` per chunk), `decode_episodes` gives what the robot rewards read;
  `denoising_rollout` / `denoising_inputs` pack and unpack the denoising chains of a generative
  action head (SmolVLA's flow expert, the Diffusion policy) as units.
- text: `instruction_corpus` is what a tiny local tokenizer is trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmrl.episodes import as_numpy, image_hwc
from mmrl.policies.vla.configuration import DEFAULT_PROMPT
from mmrl.rollout import Rollout

IMAGE_PREFIX = "observation.images."

# ----------------------------------------------------------------------------- actions <-> tokens


def action_token_names(n_bins: int) -> list[str]:
    return [f"<act_{i}>" for i in range(n_bins)]


def add_action_tokens(tokenizer, n_bins: int = 256):
    """Add `<act_0>` ... `<act_{n-1}>` as special tokens (contiguous ids at the end); returns the tokenizer."""
    missing = [t for t in action_token_names(n_bins) if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    return tokenizer


class ActionBins:
    """Uniform bins per action dim: continuous [..., A] <-> bin indices [..., A] (bin centres back)."""

    def __init__(self, low: float | Sequence[float], high: float | Sequence[float], n_bins: int, action_dim: int):
        lo = np.broadcast_to(np.asarray(low, np.float64), (action_dim,)).copy()
        hi = np.broadcast_to(np.asarray(high, np.float64), (action_dim,)).copy()
        if n_bins < 2 or not (hi > lo).all():
            raise ValueError(f"need n_bins >= 2 and high > low in every dim; got n_bins={n_bins}, "
                             f"low={lo.tolist()}, high={hi.tolist()}")
        self.low, self.high, self.n_bins, self.action_dim = lo, hi, n_bins, action_dim

    def _t(self, x: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.float32, device=like.device)

    def to_bins(self, actions: torch.Tensor) -> torch.Tensor:
        """Values outside [low, high] fall in the edge bins."""
        actions = torch.as_tensor(actions, dtype=torch.float32)
        if actions.shape[-1] != self.action_dim:
            raise ValueError(f"actions have {actions.shape[-1]} dims, the policy {self.action_dim}")
        lo, hi = self._t(self.low, actions), self._t(self.high, actions)
        return ((actions - lo) / (hi - lo) * self.n_bins).floor().long().clamp(0, self.n_bins - 1)

    def to_actions(self, bins: torch.Tensor) -> torch.Tensor:
        lo, hi = self._t(self.low, bins), self._t(self.high, bins)
        return lo + (bins.float() + 0.5) * (hi - lo) / self.n_bins

    def normalise(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions scaled so that [low, high] maps to [-1, 1] in every dim."""
        actions = torch.as_tensor(actions, dtype=torch.float32)
        lo, hi = self._t(self.low, actions), self._t(self.high, actions)
        return 2 * (actions - lo) / (hi - lo) - 1


# ----------------------------------------------------------------------------- observations


def observation_field(observations: Mapping | Any, key: str) -> Any:
    """`observations[key]` of a dict, else the attribute (e.g. the vector env's ObsBatch)."""
    return observations[key] if isinstance(observations, Mapping) else getattr(observations, key)


def select_cameras(images: Mapping[str, Any], cameras: Sequence[str] | None) -> list[str]:
    """`cameras` (default: every camera of `images`), each checked to be there."""
    cams = list(cameras) if cameras else list(images)
    missing = [c for c in cams if c not in images]
    if missing:
        raise KeyError(f"observation lacks camera(s) {missing}; it has {list(images)}")
    return cams


def observation_images(observations: Mapping | Any, cameras: Sequence[str] | None) -> np.ndarray:
    """"images" {camera: [B, H, W, 3]} of a batch of observations as one uint8 [B, C, H, W, 3] array."""
    images = observation_field(observations, "images")
    return np.stack([as_numpy(images[c]) for c in select_cameras(images, cameras)], 1).astype(np.uint8, copy=False)


# ----------------------------------------------------------------------------- SFT contexts


@dataclass
class SFTExample:
    images: list[np.ndarray]  # one HxWx3 image per camera
    instruction: str
    actions: torch.Tensor  # float32 [K, A]
    valid: torch.Tensor  # bool [K]: False where lerobot marks padding and on the repeated tail
    state: np.ndarray | None  # float32 [D]; None when the context has none


def _sft_images(c: Mapping[str, Any], i: int, cameras: Sequence[str] | None) -> list[np.ndarray]:
    if "images" in c:
        return [as_numpy(c["images"][cam]) for cam in select_cameras(c["images"], cameras)]
    prefixed = {k[len(IMAGE_PREFIX):]: v for k, v in c.items() if k.startswith(IMAGE_PREFIX)}
    if prefixed:
        return [image_hwc(prefixed[cam]) for cam in select_cameras(prefixed, cameras or sorted(prefixed))]
    if "frame" in c:
        f = c["frame"]
        return [as_numpy(x) for x in f] if isinstance(f, (list, tuple)) else [as_numpy(f)]
    raise KeyError(f"SFT context {i} has no images ('images', 'observation.images.<camera>' or 'frame'); "
                   f"its keys: {sorted(c)}")


def parse_sft_context(context: Mapping[str, Any], index: int, cameras: Sequence[str] | None, action_dim: int,
                      chunk_size: int, *, default_instruction: str | None = None,
                      need_state: bool = False) -> SFTExample:
    """One expert example (the keys are in the module docstring); `index` names the context in
    errors. A missing instruction is a KeyError unless `default_instruction` is given; a missing
    state one when `need_state`."""
    c, i, K = context, index, chunk_size
    act = c.get("actions", c.get("action"))
    if act is None:
        raise KeyError(f"SFT context {i} has no 'actions' (or 'action') chunk; its keys: {sorted(c)}")
    act = torch.as_tensor(as_numpy(act), dtype=torch.float32).reshape(-1, action_dim)
    pad = torch.as_tensor(as_numpy(c["action_is_pad"]), dtype=torch.bool).reshape(-1) if "action_is_pad" in c \
        else torch.zeros(len(act), dtype=torch.bool)
    # Shorter chunks repeat their last action, masked; longer ones are cut to K.
    extra = max(0, K - len(act))
    valid = torch.cat([~pad, torch.zeros(extra, dtype=torch.bool)])[:K]
    act = torch.cat([act, act[-1:].expand(extra, action_dim)])[:K]
    ins = c.get("instruction", c.get("prompt", default_instruction))
    if ins is None:
        raise KeyError(f"SFT context {i} has no 'instruction' (or 'prompt'); its keys: {sorted(c)}")
    state = c.get("state", c.get("observation.state"))
    if state is None and need_state:
        raise KeyError(f"SFT context {i} has no 'state' (or 'observation.state'); its keys: {sorted(c)}")
    return SFTExample(images=_sft_images(c, i, cameras), instruction=str(ins), actions=act, valid=valid,
                      state=None if state is None else as_numpy(state).astype(np.float32))


# ----------------------------------------------------------------------------- rollouts


def acted_chunks(mask: torch.Tensor, per_chunk: int, window: slice | None = None):
    """(rows, chunk steps, start, stop) of a chunk-major rollout's `mask` [N, S * per_chunk]: the
    chunks that acted and that the unit window [start, stop) (default: all) touches."""
    N = mask.shape[0]
    S = mask.shape[1] // per_chunk
    start, stop, _ = (window or slice(None)).indices(S * per_chunk)
    acted = mask.view(N, S, per_chunk).any(-1)
    acted[:, :start // per_chunk] = False
    acted[:, -(-stop // per_chunk):] = False
    rows, steps = acted.nonzero(as_tuple=True)
    return rows, steps, start, stop


def denoising_rollout(ep, num_steps: int, chunk_shape: tuple[int, ...], max_chunks: int, device) -> Rollout:
    """Episodes whose `act` outputs hold each chunk's denoising chain ("states" [B, K+1, *chunk_shape],
    "logp" [B, K]) as a Rollout of denoising steps: `units[n, s*K + k]` is the state after step k of
    chunk s, `extras["x_init"][n][s]` the chunk's starting noise."""
    N, S, K = len(ep.rows), len(ep.steps), num_steps
    units = torch.zeros(N, S, K, *chunk_shape, device=device)
    logp = torch.zeros(N, S, K, device=device)
    mask = torch.zeros(N, S, K, dtype=torch.bool, device=device)
    x_init: list[list[torch.Tensor]] = [[] for _ in range(N)]
    for s, (idx, out, _) in enumerate(ep.steps):
        rows = torch.as_tensor(idx, device=device)
        units[rows, s], logp[rows, s], mask[rows, s] = out["states"][:, 1:], out["logp"], True
        for j, i in enumerate(idx.tolist()):
            x_init[i].append(out["states"][j, 0])
    extras = ep.extras(device)
    extras["x_init"] = [torch.stack(x) if x else torch.zeros(0, *chunk_shape, device=device) for x in x_init]
    return Rollout(units=units.view(N, S * K, *chunk_shape), logp_old=logp.view(N, S * K), mask=mask.view(N, S * K),
                   truncated=torch.as_tensor(~ep.done, device=device), max_units=max_chunks * K, contexts=ep.rows,
                   extras=extras)


def denoising_inputs(rollout: Rollout, rows: torch.Tensor, steps: torch.Tensor, num_steps: int, device):
    """What re-scores chunks (rows[i], steps[i]) of a `denoising_rollout`: their observations
    (uint8 images [M, C, H, W, 3], states [M, D], instructions) and chains [M, K+1, *chunk_shape]."""
    r, s = rows.tolist(), steps.tolist()
    images = np.stack([rollout.extras["obs_images"][n][k].cpu().numpy() for n, k in zip(r, s)])
    states = np.stack([rollout.extras["obs_state"][n][k].cpu().numpy() for n, k in zip(r, s)])
    instructions = [rollout.contexts[n].get("instruction", "") for n in r]
    x_init = torch.stack([rollout.extras["x_init"][n][k] for n, k in zip(r, s)]).to(device)
    N, chunk_shape = len(rollout), rollout.units.shape[2:]
    chains = rollout.units.view(N, -1, num_steps, *chunk_shape)[rows, steps]
    return images, states, instructions, torch.cat([x_init[:, None], chains], 1)


def decode_episodes(rollout) -> list[dict[str, Any]]:
    """{"success", "frames" (first camera), "length" (env steps), "instruction"} per trajectory,
    what the `success` and `srpo_progress` rewards read."""
    obs, success, steps = rollout.extras["obs_images"], rollout.extras["success"], rollout.extras["env_steps"]
    return [{"success": bool(success[i]), "frames": obs[i][:, 0].cpu().numpy(), "length": int(steps[i]),
             "instruction": rollout.contexts[i].get("instruction", "")} for i in range(len(rollout))]


# ----------------------------------------------------------------------------- text


def instruction_corpus(task, prompt_template: str = DEFAULT_PROMPT) -> list[str]:
    """Text for a tiny tokenizer: the task's corpus, else its instructions, each in the prompt."""
    texts = list(task.corpus()) or [str(c.get("instruction", "")) for c in task.eval_batch(64)]
    return [prompt_template.format(instruction=t) for t in texts] + [prompt_template.format(instruction="")]


__all__ = [
    "ActionBins",
    "SFTExample",
    "acted_chunks",
    "action_token_names",
    "add_action_tokens",
    "decode_episodes",
    "denoising_inputs",
    "denoising_rollout",
    "instruction_corpus",
    "observation_field",
    "observation_images",
    "parse_sft_context",
    "select_cameras",
]
