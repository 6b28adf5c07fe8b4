"""An action-token VLA (OpenVLA / OpenVLA-OFT style) on a Qwen-VL backbone, trained with
trajectory-level GRPO (SimpleVLA-RL, SRPO).

Actions: each of the A dims is cut into `n_bins` (256) uniform bins over [low, high] (per dim, e.g.
dataset statistics) and each bin is one reserved token id, so an action chunk of K steps is K*A
tokens decoded autoregressively. The reserved ids are either added special tokens `<act_0>` ...
(`action_tokens="special"`, what the tiny models use) or the last `n_bins` rows of the output
embedding (`"vocab_tail"`, OpenVLA's choice; on Qwen checkpoints these are padded rows no text
token uses). Sampling and training both take the softmax over the action ids only (logits / T), so
the sampler's log-probs are exactly the teacher-forced ones. A sampled token maps back to its bin
centre.

Trajectory-level GRPO: `sample(contexts, G)` runs whole episodes. A context is a task initial state:

    {"task": "push", "init_state_id": 3, ...}                 (MuJoCo tabletop, mmrl.envs.tabletop)
    {"suite": "libero_spatial", "task_id": 0, "init_state_id": 3}                  (LIBERO)

optionally with "seed". G copies of each go into a vector env (mmrl.envs.vector), and the loop
observation -> `act` -> `step_chunk` runs until every env is done or `max_chunks` is hit. The
Rollout's units are all action tokens of a trajectory ([N, chunks*K*A]); the mask covers the
chunks that were executed (tokens of sub-steps after the episode ended inside a chunk are
masked); `extras["obs_images"]` keeps, per trajectory, the uint8 camera images at every decision
step plus the final one ([chunks+1, cameras, H, W, 3]), from which `logprobs` re-encodes each
chunk's prompt and recomputes every chunk's token log-probs in one batched forward. `decode` gives
{"success", "frames" (first camera), "length" (env steps), "instruction"} per trajectory, what the
`success` and `srpo_progress` rewards read.

SFT contexts (`sft_loss`) hold the observation images ("images": {camera: HxWx3}, or "frame"), the
language task ("instruction", or "prompt") and the expert chunk ("actions" or "action": [K, A],
with an optional "action_is_pad" [K] as lerobot datasets give it).
"""

from __future__ import annotations

import atexit
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmrl.policies.base import apply_lora
from mmrl.policies.qwen_vl import (
    QwenVLPolicy,
    VLStepper,
    _rope_owner,
    rope_positions,
    vision_inputs,
)
from mmrl.rollout import Rollout, token_logprobs

ACTION_TOKEN_MODES = ("special", "vocab_tail")
DEFAULT_PROMPT = "What action should the robot take to {instruction}?"
CONFIG_NAME = "action_vla.json"
# model.params keys this adapter reads (besides the Qwen-VL build keys).
POLICY_PARAMS = {"action_dim", "chunk_size", "n_bins", "action_low", "action_high", "action_tokens", "cameras",
                 "prompt_template", "max_chunks", "env", "system_prompt", "min_image_tokens", "max_image_tokens"}
BUILD_PARAMS = {"arch", "freeze_vision"}


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


@dataclass
class ActOutput:
    actions: torch.Tensor  # float [B, K, A], bin centres
    tokens: torch.Tensor  # long [B, K*A], absolute token ids
    logp: torch.Tensor  # float [B, K*A], log-probs under softmax over the action ids of logits / T


# ----------------------------------------------------------------------------- environments


class VectorEnvFactory:
    """Builds the vector env for a list of per-trajectory contexts and caches the last
    `cache_size` of them (worker processes and MuJoCo models are slow to start), keyed by the env
    each row needs. `kind` "tabletop" (context "task") or "libero" (context "suite", "task_id");
    `num_workers` 0 steps the envs in this process (SyncVectorEnv), > 0 in worker processes.

    `upcoming(rows)`, if given, names the rows of the rollout that will follow one of `rows` (or
    None): `rollout_done` then starts those envs' reset at once, so the worker processes reset while
    the policy trains, and the next rollout finds its first observations ready."""

    def __init__(self, kind: str = "tabletop", num_workers: int = 0, image_size: int = 64,
                 cameras: Sequence[str] | None = None, cache_size: int = 2,
                 upcoming: Callable[[list[dict]], list[dict] | None] | None = None, **env_kwargs):
        if kind not in ("tabletop", "libero"):
            raise ValueError(f"unknown env kind {kind!r}; valid: tabletop, libero")
        self.kind, self.num_workers, self.cache_size, self.upcoming = kind, num_workers, cache_size, upcoming
        self.env_kwargs = {"image_size": image_size, **({"cameras": tuple(cameras)} if cameras else {}), **env_kwargs}
        self._cache: OrderedDict[str, Any] = OrderedDict()
        # Close cached envs before interpreter teardown: renderers freed after their GL module is
        # gone raise noisy errors, and worker processes should not outlive the run.
        atexit.register(self.close)

    def spec(self, context: dict, i: int) -> dict[str, Any]:
        need = ("task",) if self.kind == "tabletop" else ("suite", "task_id")
        missing = [k for k in need if k not in context]
        if missing:
            raise KeyError(f"context {i} lacks {missing} for a {self.kind} env; its keys: {sorted(context)}")
        return {**{k: context[k] for k in need}, **self.env_kwargs}

    def __call__(self, rows: list[dict]):
        from mmrl.envs.vector import SyncVectorEnv, VectorEnv

        specs = [self.spec(c, i) for i, c in enumerate(rows)]
        key = json.dumps(specs, sort_keys=True, default=str)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if self.kind == "tabletop":
            from mmrl.envs.tabletop import make_tabletop_env as factory
        else:
            from mmrl.envs.libero_env import make_libero_env as factory
        env = (VectorEnv(factory=factory, specs=specs, num_workers=self.num_workers) if self.num_workers > 0
               else SyncVectorEnv(factory=factory, specs=specs))
        self._cache[key] = env
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)[1].close()
        return env

    def prefetch(self, rows: list[dict]) -> None:
        """Start resetting the env set of `rows` to their initial states without waiting."""
        self(rows).reset_async(*_init_ids(rows))

    def rollout_done(self, rows: list[dict]) -> None:
        """`run_episodes` calls this when the episodes of `rows` have ended."""
        following = self.upcoming(rows) if self.upcoming is not None else None
        if following:
            self.prefetch(following)

    def close(self) -> None:
        while self._cache:
            self._cache.popitem()[1].close()


def task_env_factory(task) -> Callable[[list[dict]], Any] | None:
    """The env hook a task offers policies: its `env_factory` (a VectorEnvFactory that can also
    prefetch resets), else its `make_vector_env(rows)` method, else None."""
    return getattr(task, "env_factory", None) or getattr(task, "make_vector_env", None)


def _init_ids(rows: list[dict]) -> tuple[list[int | None], list[int | None]]:
    seeds = [c.get("seed") for c in rows]
    ids = [c.get("init_state_id", c.get("init_id")) for c in rows]
    return seeds, ids


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@dataclass
class Episodes:
    """What `run_episodes` recorded: per chunk step s, `steps[s] = (rows that acted, the act output,
    env sub-steps each ran)`; per trajectory the camera images and proprio state at every decision
    step plus the final one."""

    rows: list[dict]  # one context per trajectory, "instruction" filled in from the env
    steps: list[tuple[np.ndarray, Any, np.ndarray]]
    images: list[np.ndarray]  # N x uint8 [S_i + 1, C, H, W, 3]
    states: list[np.ndarray]  # N x float32 [S_i + 1, D]
    done: np.ndarray  # bool [N]
    success: np.ndarray  # bool [N]
    env_steps: np.ndarray  # int [N]

    def extras(self, device) -> dict[str, Any]:
        """Rollout extras: ragged per-trajectory observations as lists (concat never pads them)."""
        return {"obs_images": [torch.from_numpy(x) for x in self.images],
                "obs_state": [torch.from_numpy(x) for x in self.states],
                "success": torch.as_tensor(self.success, device=device),
                "env_steps": torch.as_tensor(self.env_steps, device=device)}


def run_episodes(env_factory: Callable[[list[dict]], Any] | None, rows: list[dict],
                 act: Callable[[np.ndarray, np.ndarray, list[str]], tuple[Any, Any]], max_chunks: int,
                 cameras: Sequence[str] | None = None) -> Episodes:
    """Roll out one episode per row: reset the vector env at each row's initial state, then
    `act(images [B, C, H, W, 3] uint8, states [B, D], instructions) -> (actions [B, n, A], out)` on the
    rows still running and `step_chunk` until every env is done or `max_chunks` chunks have run.
    Done envs are not stepped again (the vector env keeps their last observation)."""
    if env_factory is None:
        raise RuntimeError("this policy has no env_factory: pass one (e.g. VectorEnvFactory()) to roll out episodes")
    N = len(rows)
    env = env_factory(rows)
    if env.num_envs != N:
        raise ValueError(f"env_factory gave {env.num_envs} envs for {N} trajectories")
    obs = env.reset(*_init_ids(rows))
    cams = list(cameras) if cameras else list(obs.images)
    missing = [c for c in cams if c not in obs.images]
    if missing:
        raise KeyError(f"the env renders cameras {list(obs.images)}, not {missing}")
    for r, ins in zip(rows, obs.instruction):
        r["instruction"] = ins or r.get("instruction", "")
    instructions = [r["instruction"] for r in rows]

    def snapshot(o) -> tuple[np.ndarray, np.ndarray]:
        return (np.stack([_np(o.images[c]) for c in cams], 1).astype(np.uint8, copy=False),
                np.asarray(o.state, np.float32))

    images, states = snapshot(obs)
    hist_img = [[images[i]] for i in range(N)]
    hist_state = [[states[i]] for i in range(N)]
    done, success, env_steps = np.zeros(N, bool), np.zeros(N, bool), np.zeros(N, np.int64)
    steps: list[tuple[np.ndarray, Any, np.ndarray]] = []
    while len(steps) < max_chunks and not done.all():
        idx = np.nonzero(~done)[0]
        actions, out = act(images[idx], states[idx], [instructions[i] for i in idx])
        actions = _np(actions).astype(np.float32)
        full = np.zeros((N, *actions.shape[1:]), np.float32)
        full[idx] = actions
        step = env.step_chunk(full)
        executed = np.array([int(step.info[i].get("steps_executed", actions.shape[1])) for i in idx])
        steps.append((idx, out, executed))
        env_steps[idx] += executed
        images, states = snapshot(step.obs)
        for i in idx:
            hist_img[i].append(images[i])
            hist_state[i].append(states[i])
        done, success = np.asarray(step.done, bool), np.asarray(step.success, bool)
    hook = getattr(env_factory, "rollout_done", None)
    if hook is not None:  # e.g. start the next batch's resets, to overlap the policy update
        hook(rows)
    return Episodes(rows=rows, steps=steps, images=[np.stack(h) for h in hist_img],
                    states=[np.stack(h) for h in hist_state], done=done, success=success, env_steps=env_steps)


# ----------------------------------------------------------------------------- the policy


class ActionTokenVLAPolicy(QwenVLPolicy):
    PARAMS = frozenset(POLICY_PARAMS | BUILD_PARAMS)
    def __init__(self, model: nn.Module, processor, *, action_dim: int = 7, chunk_size: int = 8, n_bins: int = 256,
                 action_low: float | Sequence[float] = -1.0, action_high: float | Sequence[float] = 1.0,
                 action_tokens: str = "special", cameras: Sequence[str] | None = None,
                 prompt_template: str = DEFAULT_PROMPT, max_chunks: int = 64, temperature: float = 1.0,
                 env_factory: Callable[[list[dict]], Any] | None = None, system_prompt: str | None = None,
                 min_image_tokens: int | None = None, max_image_tokens: int | None = None):
        super().__init__(model, processor, temperature=temperature, max_new_tokens=chunk_size * action_dim,
                         system_prompt=system_prompt, min_image_tokens=min_image_tokens,
                         max_image_tokens=max_image_tokens)
        if action_tokens not in ACTION_TOKEN_MODES:
            raise ValueError(f"unknown action_tokens {action_tokens!r}; valid: {', '.join(ACTION_TOKEN_MODES)}")
        if chunk_size < 1 or action_dim < 1 or max_chunks < 1:
            raise ValueError(f"need chunk_size, action_dim, max_chunks >= 1; got {chunk_size}, {action_dim}, {max_chunks}")
        if "{instruction}" not in prompt_template:
            raise ValueError(f"prompt_template must contain {{instruction}}, got {prompt_template!r}")
        self.action_dim, self.chunk_size, self.n_bins = action_dim, chunk_size, n_bins
        self.bins = ActionBins(action_low, action_high, n_bins, action_dim)
        self.action_tokens = action_tokens
        self.token_start = self._action_token_start()
        self.cameras = list(cameras) if cameras else None
        self.prompt_template = prompt_template
        self.max_chunks = max_chunks
        self.env_factory = env_factory

    def _action_token_start(self) -> int:
        n_rows = self.model.get_output_embeddings().weight.shape[0]
        if self.action_tokens == "vocab_tail":
            if n_rows < self.n_bins:
                raise ValueError(f"vocab_tail needs >= {self.n_bins} vocabulary rows, the model has {n_rows}")
            return n_rows - self.n_bins
        vocab = self.tokenizer.get_vocab()
        names = action_token_names(self.n_bins)
        missing = [t for t in names if t not in vocab]
        if missing:
            raise ValueError(f"the tokenizer lacks {len(missing)} action tokens (e.g. {missing[0]}); call "
                             "add_action_tokens(tokenizer) and resize the model's embeddings, or use "
                             "action_tokens='vocab_tail'")
        ids = [vocab[t] for t in names]
        if ids != list(range(ids[0], ids[0] + self.n_bins)) or ids[-1] >= n_rows:
            raise ValueError(f"action tokens must have contiguous ids inside the model's {n_rows} rows; "
                             f"got {ids[0]}..{ids[-1]}")
        return ids[0]

    @property
    def tokens_per_chunk(self) -> int:
        return self.chunk_size * self.action_dim

    def tokens_to_actions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Absolute token ids [B, K*A] -> continuous actions [B, K, A] (bin centres)."""
        bins = (tokens - self.token_start).view(tokens.shape[0], self.chunk_size, self.action_dim)
        return self.bins.to_actions(bins)

    def actions_to_tokens(self, actions: torch.Tensor) -> torch.Tensor:
        """Continuous [B, K, A] -> absolute token ids [B, K*A]."""
        return (self.bins.to_bins(actions) + self.token_start).flatten(1)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg, task, device="cpu") -> ActionTokenVLAPolicy:
        """`model.source: tiny` builds a tiny Qwen-VL (`model.params.arch`, sizes in `model.tiny`) with
        a local tokenizer plus `<act_i>` tokens; `pretrained` loads `model.path` (a directory saved by
        `save`, or a plain Qwen-VL checkpoint with `action_tokens: vocab_tail`). The env comes from
        the task when it has one (`task_env_factory`), else from `model.params.env` (VectorEnvFactory
        kwargs)."""
        m, params = cfg.model, dict(cfg.model.params)
        cls.check_params(params)
        dtype = getattr(torch, m.dtype)
        arch = params.pop("arch", "qwen2_5_vl")
        freeze_vision = params.pop("freeze_vision", False)
        env_cfg = params.pop("env", {})
        saved = {}
        if m.source == "pretrained":
            model, processor = cls.load_pretrained(m.path, dtype)
            cfg_file = Path(m.path) / CONFIG_NAME
            saved = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        else:
            from mmrl.tiny import (
                build_qwen_vl_processor,
                build_tiny_qwen_vl,
                build_tokenizer,
            )

            n_bins = params.get("n_bins", 256)
            tokenizer = add_action_tokens(build_tokenizer(_corpus(task, params), vocab_size=m.tokenizer_vocab_size),
                                          n_bins)
            processor = build_qwen_vl_processor(tokenizer, arch, params.get("min_image_tokens", 4),
                                                params.get("max_image_tokens", 16))
            model = build_tiny_qwen_vl(tokenizer, arch, seed=cfg.train.seed, **m.tiny).to(dtype)
        if freeze_vision:
            _rope_owner(model).visual.requires_grad_(False)
        model = apply_lora(model, m).to(device)
        env_factory = task_env_factory(task) or VectorEnvFactory(**env_cfg)
        return cls(model, processor, temperature=cfg.sampling.temperature, env_factory=env_factory,
                   **{**saved, **params})

    @classmethod
    def from_pretrained(cls, path: str | Path, device="cpu", dtype: torch.dtype = torch.float32,
                        **kwargs) -> ActionTokenVLAPolicy:
        model, processor = cls.load_pretrained(path, dtype)
        cfg_file = Path(path) / CONFIG_NAME
        saved = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        return cls(model.to(device), processor, **{**saved, **kwargs})

    def save(self, directory: str | Path) -> None:
        super().save(directory)
        cfg = {"action_dim": self.action_dim, "chunk_size": self.chunk_size, "n_bins": self.n_bins,
               "action_low": self.bins.low.tolist(), "action_high": self.bins.high.tolist(),
               "action_tokens": self.action_tokens, "cameras": self.cameras, "prompt_template": self.prompt_template}
        (Path(directory) / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))

    # ------------------------------------------------------------------ observations -> prompts

    def _camera_list(self, images: dict) -> list[str]:
        cams = self.cameras or list(images)
        missing = [c for c in cams if c not in images]
        if missing:
            raise KeyError(f"observation lacks camera(s) {missing}; it has {list(images)}")
        return cams

    def _prompt(self, instruction: str) -> str:
        return self.prompt_template.format(instruction=instruction)

    def _vl_contexts(self, images: list[list[np.ndarray]], instructions: Sequence[str]) -> list[dict]:
        return [{"frame": list(imgs), "prompt": self._prompt(str(ins))} for imgs, ins in zip(images, instructions)]

    @staticmethod
    def _obs_images(images: dict, cams: list[str]) -> np.ndarray:
        """camera -> [B, H, W, 3] as one uint8 [B, C, H, W, 3] array."""
        return np.stack([_np(images[c]) for c in cams], 1).astype(np.uint8, copy=False)

    # ------------------------------------------------------------------ acting

    @torch.no_grad()
    def act(self, observations: dict | Any, instructions: Sequence[str], generator: torch.Generator | None = None,
            temperature: float | None = None) -> ActOutput:
        """One action chunk per row. `observations` holds "images" {camera: uint8 [B, H, W, 3]} (a
        dict, or an object with an `images` attribute such as the vector env's ObsBatch)."""
        images = observations["images"] if isinstance(observations, dict) else observations.images
        cams = self._camera_list(images)
        arr = self._obs_images(images, cams)
        if len(arr) != len(instructions):
            raise ValueError(f"{len(arr)} observations but {len(instructions)} instructions")
        return self._act_images(arr, instructions, generator, temperature)

    def _act_images(self, images: np.ndarray, instructions: Sequence[str], generator, temperature) -> ActOutput:
        temperature = self.temperature if temperature is None else temperature
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        enc = self.encode(self._vl_contexts(list(images), instructions))
        stepper = VLStepper(self.model, enc["mm_token_type_ids"], vision_inputs(enc["pixel_values"],
                                                                                enc["image_grid_thw"]), 1)
        was_training = self.model.training
        self.model.eval()
        # Inference mode costs less per op than no_grad; the outputs are cloned out of it below.
        try:
            with torch.inference_mode():
                tokens_t, logp_t = self._decode_chunk(stepper, enc, temperature, generator)
        finally:
            self.model.train(was_training)
        tokens_t, logp_t = tokens_t.clone(), logp_t.clone()
        return ActOutput(actions=self.tokens_to_actions(tokens_t), tokens=tokens_t, logp=logp_t)

    def _decode_chunk(self, stepper: VLStepper, enc: dict[str, Any], temperature: float,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K*A action tokens with a KV cache, drawn from softmax(logits / T) over the action ids only."""
        lo, L = self.token_start, self.tokens_per_chunk
        logits = stepper.prefill(enc["prompt_ids"], enc["prompt_mask"])
        tokens, logps = [], []
        for j in range(L):
            z = logits[:, lo:lo + self.n_bins]
            if temperature == 0:
                drawn = z.argmax(-1)
                logp_all = z.log_softmax(-1)
            else:
                logp_all = (z / temperature).log_softmax(-1) if temperature != 1.0 else z.log_softmax(-1)
                drawn = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)
            tokens.append(drawn + lo)
            logps.append(logp_all.gather(-1, drawn[:, None]).squeeze(-1))
            if j < L - 1:
                logits = stepper.step(tokens[-1])
        return torch.stack(tokens, 1), torch.stack(logps, 1)

    # ------------------------------------------------------------------ teacher forcing

    def _chunk_logprobs(self, model: nn.Module, enc: dict[str, Any], tokens: torch.Tensor, with_entropy: bool,
                        temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [M, K*A] of action chunks `tokens` after the encoded prompts, over the action ids."""
        L = tokens.shape[1]
        ids = torch.cat([enc["prompt_ids"], tokens], 1)
        attn = torch.cat([enc["prompt_mask"], torch.ones_like(tokens)], 1)
        mm = torch.cat([enc["mm_token_type_ids"], torch.zeros_like(tokens)], 1)
        vision = vision_inputs(enc["pixel_values"], enc["image_grid_thw"])
        pos = rope_positions(model, ids, attn, mm, vision.get("image_grid_thw"))
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, mm_token_type_ids=mm, use_cache=False,
                       logits_to_keep=L + 1, **vision).logits[:, :-1].float()
        z = logits[..., self.token_start:self.token_start + self.n_bins]
        t = self.temperature if temperature is None else temperature
        if t not in (0.0, 1.0):  # greedy rollouts are scored at temperature 1 (their logp is informational)
            z = z / t
        return token_logprobs(z, tokens - self.token_start, None, with_entropy)

    def logprobs_of(self, observations: dict | Any, instructions: Sequence[str], tokens: torch.Tensor,
                    with_entropy: bool = False, model: nn.Module | None = None):
        """Teacher-forced log-probs [B, K*A] of action tokens for one observation per row."""
        images = observations["images"] if isinstance(observations, dict) else observations.images
        arr = self._obs_images(images, self._camera_list(images))
        enc = self.encode(self._vl_contexts(list(arr), instructions))
        return self._chunk_logprobs(model or self.model, enc, tokens.to(self.device), with_entropy)

    def _rollout_logprobs(self, model: nn.Module, rollout: Rollout, with_entropy: bool):
        N, L = len(rollout), self.tokens_per_chunk
        S = rollout.units.shape[1] // L
        chunks = rollout.units.view(N, S, L)
        acted = rollout.mask.view(N, S, L).any(-1)
        rows, steps = acted.nonzero(as_tuple=True)
        out = torch.zeros(N, S, L, device=self.device)
        ent_out = torch.zeros(N, S, L, device=self.device) if with_entropy else None
        if len(rows):
            obs = rollout.extras["obs_images"]
            imgs = [obs[n][s].cpu().numpy() for n, s in zip(rows.tolist(), steps.tolist())]
            instr = [rollout.contexts[n]["instruction"] for n in rows.tolist()]
            enc = self.encode(self._vl_contexts(imgs, instr))
            logp, ent = self._chunk_logprobs(model, enc, chunks[rows, steps], with_entropy)
            out = out.index_put((rows, steps), logp)
            if with_entropy:
                ent_out = ent_out.index_put((rows, steps), ent)
        # Unexecuted sub-steps of a final chunk were scored with it; report 0 there, like unacted chunks.
        m = rollout.mask
        out = torch.where(m, out.view(N, S * L), 0.0)
        return out, None if ent_out is None else torch.where(m, ent_out.view(N, S * L), 0.0)

    def logprobs(self, rollout: Rollout, with_entropy: bool = False):
        return self._rollout_logprobs(self.model, rollout, with_entropy)

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        with self.reference_module() as ref:
            return self._rollout_logprobs(ref, rollout, False)[0]

    # ------------------------------------------------------------------ episodes

    @torch.no_grad()
    def sample(self, contexts: list[dict], group_size: int, generator: torch.Generator | None = None,
               group_offset: int = 0, temperature: float | None = None) -> Rollout:
        G, n = group_size, len(contexts)
        K, A, L = self.chunk_size, self.action_dim, self.tokens_per_chunk

        def act(images: np.ndarray, states: np.ndarray, instructions: list[str]):
            out = self._act_images(images, instructions, generator, temperature)
            return out.actions, out

        ep = run_episodes(self.env_factory, [dict(c) for c in contexts for _ in range(G)], act, self.max_chunks,
                          self.cameras)
        N, S, dev = len(ep.rows), len(ep.steps), self.device
        tokens = torch.full((N, S, L), self.token_start, dtype=torch.long, device=dev)
        logp = torch.zeros(N, S, L, device=dev)
        mask = torch.zeros(N, S, L, dtype=torch.bool, device=dev)
        for s, (idx, out, executed) in enumerate(ep.steps):
            rows = torch.as_tensor(idx, device=dev)
            tokens[rows, s], logp[rows, s] = out.tokens, out.logp
            # Tokens of sub-steps the env never ran (the episode ended inside the chunk) are not trained.
            sub_ok = torch.as_tensor(np.arange(K)[None] < executed[:, None], device=dev)
            mask[rows, s] = sub_ok.repeat_interleave(A, 1)
        return Rollout(
            group_ids=torch.arange(group_offset, group_offset + n, device=dev).repeat_interleave(G),
            units=tokens.view(N, S * L), logp_old=logp.view(N, S * L), mask=mask.view(N, S * L),
            truncated=torch.as_tensor(~ep.done, device=dev),  # cut by max_chunks, not ended by the env
            contexts=ep.rows, extras=ep.extras(dev))

    def decode(self, rollout: Rollout) -> list[dict[str, Any]]:
        obs, success, steps = rollout.extras["obs_images"], rollout.extras["success"], rollout.extras["env_steps"]
        return [{"success": bool(success[i]), "frames": obs[i][:, 0].cpu().numpy(), "length": int(steps[i]),
                 "instruction": rollout.contexts[i].get("instruction", "")} for i in range(len(rollout))]

    # ------------------------------------------------------------------ SFT

    def _sft_images(self, c: dict, i: int) -> list[np.ndarray]:
        if "images" in c:
            cams = self.cameras or list(c["images"])
            return [_np(c["images"][cam]) for cam in cams]
        prefixed = {k[len("observation.images."):]: v for k, v in c.items() if k.startswith("observation.images.")}
        if prefixed:
            cams = self.cameras or sorted(prefixed)
            return [_image_hwc(prefixed[cam]) for cam in cams]
        if "frame" in c:
            f = c["frame"]
            return [_np(x) for x in f] if isinstance(f, (list, tuple)) else [_np(f)]
        raise KeyError(f"SFT context {i} has no images ('images', 'observation.images.<camera>' or 'frame'); "
                       f"its keys: {sorted(c)}")

    def sft_loss(self, contexts: list[dict]) -> torch.Tensor:
        """Mean cross-entropy of the discretised expert chunks (over the action ids, temperature 1)."""
        K, A = self.chunk_size, self.action_dim
        images, instructions, chunks, valid = [], [], [], []
        for i, c in enumerate(contexts):
            act = c.get("actions", c.get("action"))
            if act is None:
                raise KeyError(f"SFT context {i} has no 'actions' (or 'action') chunk; its keys: {sorted(c)}")
            act = torch.as_tensor(_np(act), dtype=torch.float32).reshape(-1, A)
            pad = torch.as_tensor(_np(c["action_is_pad"]), dtype=torch.bool).reshape(-1) if "action_is_pad" in c \
                else torch.zeros(len(act), dtype=torch.bool)
            # Shorter chunks repeat their last action, masked; longer ones are cut to K.
            ok = torch.cat([~pad, torch.zeros(max(0, K - len(act)), dtype=torch.bool)])[:K]
            act = torch.cat([act, act[-1:].expand(max(0, K - len(act)), A)])[:K]
            ins = c.get("instruction", c.get("prompt"))
            if ins is None:
                raise KeyError(f"SFT context {i} has no 'instruction' (or 'prompt'); its keys: {sorted(c)}")
            images.append(self._sft_images(c, i))
            instructions.append(str(ins))
            chunks.append(act)
            valid.append(ok)
        tokens = self.actions_to_tokens(torch.stack(chunks)).to(self.device)
        m = torch.stack(valid).repeat_interleave(A, 1).to(self.device)
        enc = self.encode(self._vl_contexts(images, instructions))
        logp, _ = self._chunk_logprobs(self.model, enc, tokens, False, temperature=1.0)
        return -torch.where(m, logp, 0.0).sum() / m.sum().clamp_min(1)


def _image_hwc(x) -> np.ndarray:
    """A uint8 HxWx3 image from lerobot's float CxHxW in [0, 1] or an HxWx3 uint8 array."""
    a = _np(x)
    if a.ndim == 3 and a.shape[0] == 3 and a.shape[-1] != 3:
        a = a.transpose(1, 2, 0)
    if a.dtype != np.uint8:
        a = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
    return a


def _corpus(task, params: dict) -> list[str]:
    """Text for the tiny tokenizer: the task's corpus, else its instructions, plus the prompt."""
    template = params.get("prompt_template", DEFAULT_PROMPT)
    texts = list(task.corpus()) or [str(c.get("instruction", "")) for c in task.eval_batch(64)]
    return [template.format(instruction=t) for t in texts] + [template.format(instruction="")]


__all__ = [
    "ACTION_TOKEN_MODES",
    "ActOutput",
    "ActionBins",
    "ActionTokenVLAPolicy",
    "Episodes",
    "VectorEnvFactory",
    "action_token_names",
    "add_action_tokens",
    "run_episodes",
    "task_env_factory",
]
