"""The visual planner policy (VPRL's visual mode): a causal LM over VQ image codes that sees the
current state as a picture and draws the next state as a picture.

Sequence: ``BOS <h=rows> <w=cols> canvas(current frame) SEP canvas(next frame)``, where
canvas(frame) is the frame's rows x cols codes at the top left of a fixed canvas x canvas grid,
VOID elsewhere, row-major. The generated part has a fixed length (the mask is all ones, no EOS).
On a fixed canvas a code and its copy in the next frame are always the same distance apart and a
move up is always the same offset, whatever the grid size. Decoding crops the frame's region; a
VOID inside it makes the frame unreadable (grey patch), as a garbled image would be. Specials are suppressed while sampling
and masked the same way when log-probs are recomputed, so sampler and trainer share one
distribution. The LM is a Llama-architecture `LlamaForCausalLM` (tiny from a config for tests and
the CPU demo, or `from_pretrained` of a local directory), the tokenizer a `VQTokenizer`. Both live
in one `nn.Module` (`VisualPlannerModel`) so trainer checkpoints carry the (frozen) VQ too.

`plan(contexts, max_steps)` plans closed loop and only in images, as in the paper: each generated
frame is decoded, parsed for the metrics, and fed back re-encoded as the next input.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mmrl.policies.base import PolicyBase, eval_mode
from mmrl.policies.fast_decode import FastDecoder, completion_logprobs
from mmrl.rollout import Rollout, sample_tokens

from .configuration import TINY_LLAMA, VisualPlannerConfig, Vocabulary
from .vq import VQTokenizer, train_vq

VQ_SUBFOLDER = "vq"
VOCAB_NAME = "planner_vocab.json"


class VisualPlannerModel(nn.Module):
    """The trainable LM and the frozen VQ tokenizer, one module for optimizer and checkpoints."""

    def __init__(self, lm: nn.Module, vq: VQTokenizer):
        super().__init__()
        self.lm = lm
        self.vq = vq.requires_grad_(False)

    def train(self, mode: bool = True):
        super().train(mode)
        self.vq.eval()
        return self


class VisualPlannerPolicy(PolicyBase):
    CONFIG = VisualPlannerConfig

    def __init__(self, lm: nn.Module, vq: VQTokenizer, vocab: Vocabulary, *, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, fast_decode: bool = True):
        if vocab.codebook_size != vq.config.codebook_size:
            raise ValueError(f"vocabulary has {vocab.codebook_size} codes but the VQ {vq.config.codebook_size}")
        if lm.config.vocab_size < vocab.size:
            raise ValueError(f"LM vocab_size {lm.config.vocab_size} < planner vocabulary {vocab.size}")
        self.model = VisualPlannerModel(lm, vq)
        self.vocab = vocab
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        # everything that is neither a code nor VOID, including any LM rows beyond the vocabulary
        self.suppress_token_ids = vocab.special_ids + list(range(vocab.size, lm.config.vocab_size))
        self._suppress = torch.tensor(self.suppress_token_ids, dtype=torch.long)
        self.reference: nn.Module | None = None
        self._fast = None
        if fast_decode:
            self._fast = FastDecoder.maybe(lm)

    @property
    def lm(self) -> nn.Module:
        return self.model.lm

    @property
    def vq(self) -> VQTokenizer:
        return self.model.vq

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg, task, device="cpu") -> VisualPlannerPolicy:
        pc = VisualPlannerConfig.from_params(cfg.model.params)
        s = cfg.sampling
        sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                    "fast_decode": pc.fast_decode and cfg.model.fast_decode}
        if cfg.model.source == "pretrained":
            return cls.from_pretrained(cfg.model.path, device=device, **sampling)
        cell = int(getattr(task, "cell_size", 16))
        if hasattr(task, "tokenizer_frames"):
            frames = task.tokenizer_frames(pc.vq_layouts)
        else:  # any task with frames in its SFT contexts
            ctx = task.sft_batch(max(64, pc.vq_layouts), np.random.default_rng(cfg.train.seed))
            frames = [c["frame"] for c in ctx] + [c["target_frame"] for c in ctx]
        vq = train_vq(frames, steps=pc.vq_steps, config=pc.vq_config(cell), lr=pc.vq_lr,
                      batch_size=pc.vq_batch_size, seed=cfg.train.seed)
        canvas = pc.canvas
        if canvas is None:  # the largest train frame's side, in codes
            canvas = max(max(vq.grid_shape(s)) for s in {f.shape[:2] for f in frames})
        vocab = Vocabulary(pc.codebook_size, pc.max_side, canvas)
        lm = build_tiny_llama(vocab, seed=cfg.train.seed, **cfg.model.tiny).to(getattr(torch, cfg.model.dtype))
        policy = cls(lm, vq, vocab, **sampling)
        policy.model.to(device)
        return policy

    @classmethod
    def from_pretrained(cls, directory: str | Path, device="cpu", **kwargs) -> VisualPlannerPolicy:
        from transformers import AutoModelForCausalLM

        directory = Path(directory)
        for need in ("config.json", VOCAB_NAME, f"{VQ_SUBFOLDER}/vq_config.json"):
            if not (directory / need).is_file():
                raise FileNotFoundError(f"{directory} has no {need}: not a saved visual planner "
                                        f"(expected the LM's save_pretrained files, {VOCAB_NAME} and {VQ_SUBFOLDER}/)")
        lm = AutoModelForCausalLM.from_pretrained(directory)
        vq = VQTokenizer.from_pretrained(directory / VQ_SUBFOLDER)
        policy = cls(lm, vq, Vocabulary.load(directory / VOCAB_NAME), **kwargs)
        policy.model.to(device)
        return policy

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.lm.save_pretrained(directory)
        self.vq.save_pretrained(directory / VQ_SUBFOLDER)
        self.vocab.save(directory / VOCAB_NAME)

    def enable_reference(self) -> None:
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    # ------------------------------------------------------------------ frames <-> tokens

    def encode_frames(self, frames: Sequence[np.ndarray]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Codes [h*w] and code grid (h, w) of each frame; frames of one shape share a VQ pass."""
        codes: list[torch.Tensor | None] = [None] * len(frames)
        grids: list[tuple[int, int]] = [(0, 0)] * len(frames)
        by_shape: dict[tuple, list[int]] = {}
        for i, f in enumerate(frames):
            by_shape.setdefault(tuple(np.shape(f)), []).append(i)
        for shape, idx in by_shape.items():
            enc = self.vq.encode(np.stack([frames[i] for i in idx]))
            grid = self.vq.grid_shape(shape)
            for k, i in enumerate(idx):
                codes[i], grids[i] = enc[k], grid
        return codes, grids  # type: ignore[return-value]

    def to_canvas(self, codes: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Codes [h*w] -> the canvas [ch*cw] (VOID outside the frame)."""
        ch, cw = self.vocab.canvas_shape(h, w)
        out = torch.full((ch, cw), self.vocab.void, dtype=torch.long, device=codes.device)
        out[:h, :w] = codes.reshape(h, w)
        return out.flatten()

    def prompts(self, frames: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask [B, L], and code grids [B, 2] of the input frames."""
        codes, grids = self.encode_frames(frames)
        v = self.vocab
        rows = []
        for c, (h, w) in zip(codes, grids):
            head = torch.tensor([v.bos, v.height_token(h), v.width_token(w)], device=c.device)
            rows.append(torch.cat([head, self.to_canvas(c, h, w), torch.tensor([v.sep], device=c.device)]))
        L = max(len(r) for r in rows)
        ids = torch.full((len(rows), L), v.pad, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(rows), L), dtype=torch.long, device=self.device)
        for i, r in enumerate(rows):
            ids[i, L - len(r):] = r
            mask[i, L - len(r):] = 1
        return ids, mask, torch.tensor(grids, dtype=torch.long, device=self.device).reshape(-1, 2)

    def decode_units(self, units: torch.Tensor, grids: torch.Tensor) -> list[np.ndarray]:
        """Generated canvases [N, T] -> uint8 frames of each row's grid (h, w)."""
        frames: list[np.ndarray | None] = [None] * len(units)
        by_grid: dict[tuple[int, int], list[int]] = {}
        for i, hw in enumerate(grids.tolist()):
            by_grid.setdefault(tuple(hw), []).append(i)
        K, P = self.vocab.codebook_size, self.vq.config.patch_size
        for (h, w), idx in by_grid.items():
            ch, cw = self.vocab.canvas_shape(h, w)
            codes = units[idx, : ch * cw].reshape(len(idx), ch, cw)[:, :h, :w].reshape(len(idx), h * w)
            bad = codes >= K  # VOID where a cell should be: no picture there
            out = self.vq.decode(torch.where(bad, 0, codes), (h, w))
            if bad.any():
                cells = bad.reshape(len(idx), h, w).cpu().numpy()
                grey = np.repeat(np.repeat(cells, P, axis=1), P, axis=2)
                out[grey] = 128
            for k, i in enumerate(idx):
                frames[i] = out[k]
        return frames  # type: ignore[return-value]

    def decode(self, rollout: Rollout) -> list[np.ndarray]:
        return self.decode_units(rollout.units, rollout.extras["grids"])

    # ------------------------------------------------------------------ sampling

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, grids: torch.Tensor,
                  temperature: float, generator: torch.Generator | None):
        """Exactly one canvas of codes per row. Rows with the same canvas are sampled together
        (their prompts then need no padding); outputs are right-padded to the longest."""
        n_codes = [int(np.prod(self.vocab.canvas_shape(h, w))) for h, w in grids.tolist()]
        N, T = len(n_codes), max(n_codes)
        units = torch.zeros((N, T), dtype=torch.long, device=self.device)
        logp = torch.zeros((N, T), dtype=torch.float32, device=self.device)
        mask = torch.zeros((N, T), dtype=torch.bool, device=self.device)
        kwargs = {"eos_token_ids": [self.vocab.eos], "pad_token_id": 0, "temperature": temperature,
                  "top_k": self.top_k, "top_p": self.top_p, "suppress_token_ids": self.suppress_token_ids,
                  "generator": generator}
        with eval_mode(self.model):
            for n in sorted(set(n_codes)):
                idx = torch.tensor([i for i, k in enumerate(n_codes) if k == n], device=self.device)
                L = int(prompt_mask[idx].sum(1).max())
                ids, pm = prompt_ids[idx, -L:], prompt_mask[idx, -L:]
                if self._fast is not None:
                    out = self._fast.sample(ids, pm, max_new_tokens=n, **kwargs)
                else:
                    out = sample_tokens(self.lm, ids, pm, max_new_tokens=n, **kwargs)
                units[idx, :n], logp[idx, :n], mask[idx, :n] = out.tokens, out.logp, out.mask
        return units, logp, mask

    def sample(self, contexts: list[dict], group_size: int, generator: torch.Generator | None = None,
               temperature: float | None = None) -> Rollout:
        prompt_ids, prompt_mask, grids = self.prompts([c["frame"] for c in contexts])
        prompt_ids = prompt_ids.repeat_interleave(group_size, 0)
        prompt_mask = prompt_mask.repeat_interleave(group_size, 0)
        grids = grids.repeat_interleave(group_size, 0)
        temp = self.temperature if temperature is None else temperature
        units, logp, mask = self._generate(prompt_ids, prompt_mask, grids, temp, generator)
        return Rollout(
            units=units,
            logp_old=logp,
            mask=mask,
            truncated=torch.zeros(len(units), dtype=torch.bool, device=self.device),  # a frame is always whole
            max_units=units.shape[1],  # the largest frame's codes (the canvas's, when frames sit on one)
            contexts=[c for c in contexts for _ in range(group_size)],
            extras={"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "grids": grids},
        )

    # ------------------------------------------------------------------ teacher forcing

    def _token_logprobs(self, lm: nn.Module, prompt_ids, prompt_mask, units, with_entropy: bool,
                        temperature: float | None = None, window: slice | None = None):
        # The lean decoder for the policy's own LM (the bulk of every GRPO update and SFT step);
        # the frozen reference copy takes the HF forward.
        return completion_logprobs(lm, self._fast, prompt_ids, prompt_mask, units,
                                   temperature=self.temperature if temperature is None else temperature,
                                   suppress=self._suppress, with_entropy=with_entropy, window=window,
                                   chunk=self.logprob_chunk)

    def logprobs(self, rollout: Rollout, with_entropy: bool = False, units: slice | None = None):
        e = rollout.extras
        return self._token_logprobs(self.lm, e["prompt_ids"], e["prompt_mask"], rollout.units, with_entropy,
                                    window=units)

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError("reference_logprobs needs enable_reference() first (algo.beta > 0 does it)")
        e = rollout.extras
        return self._token_logprobs(self.reference.lm, e["prompt_ids"], e["prompt_mask"], rollout.units, False)[0]

    def sft_loss(self, contexts: list[dict]) -> torch.Tensor:
        """Mean next-frame code cross-entropy of `target_frame` given `frame`."""
        prompt_ids, prompt_mask, grids = self.prompts([c["frame"] for c in contexts])
        codes, tgrids = self.encode_frames([c["target_frame"] for c in contexts])
        if [tuple(g) for g in grids.tolist()] != [tuple(g) for g in tgrids]:
            raise ValueError("a context's target_frame differs in size from its frame")
        targets = [self.to_canvas(c, h, w) for c, (h, w) in zip(codes, tgrids)]
        T = max(len(t) for t in targets)
        units = torch.zeros((len(targets), T), dtype=torch.long, device=self.device)
        mask = torch.zeros((len(targets), T), dtype=torch.bool, device=self.device)
        for i, t in enumerate(targets):
            units[i, : len(t)], mask[i, : len(t)] = t, True
        logp, _ = self._token_logprobs(self.lm, prompt_ids, prompt_mask, units, False, temperature=1.0)
        return -torch.where(mask, logp, 0.0).sum() / mask.sum()

    # ------------------------------------------------------------------ closed-loop planning

    @torch.no_grad()
    def plan(self, contexts: list[dict], max_steps: int | Sequence[int], temperature: float = 0.0,
             generator: torch.Generator | None = None) -> list[dict[str, Any]]:
        """Plan from each context's frame, feeding every generated frame back as the next input.

        Stops a plan at the goal, at an unparseable or invalid step, or after its `max_steps`.
        Returns per context {"states": int64 [T+1, 5] (parsed; the start first), "frames":
        [T generated uint8 frames], "stop": "goal" | "invalid" | "unparseable" | "max_steps"}.
        """
        from mmrl.envs.planning.render import parse_batch_array
        from mmrl.envs.planning.judge import StepKind, classify_steps

        B = len(contexts)
        budget = np.full(B, max_steps) if np.isscalar(max_steps) else np.asarray(max_steps, np.int64)
        if len(budget) != B:
            raise ValueError(f"{len(budget)} max_steps for {B} contexts")
        layouts = [c["layout"] for c in contexts]
        frames = [c["frame"] for c in contexts]
        states = np.stack([np.asarray(c["state"], np.int64) for c in contexts])
        traces = [{"states": [states[i].copy()], "frames": [], "stop": "max_steps"} for i in range(B)]
        active = np.ones(B, bool)
        for t in range(int(budget.max(initial=0))):
            active &= budget > t
            idx = np.flatnonzero(active)
            if len(idx) == 0:
                break
            ids, pm, grids = self.prompts([frames[i] for i in idx])
            units, _, _ = self._generate(ids, pm, grids, temperature, generator)
            new_frames = self.decode_units(units, grids)
            lays = [layouts[i] for i in idx]
            parsed = parse_batch_array(new_frames, lays)
            judge = classify_steps(states[idx], parsed, lays)
            for k, i in enumerate(idx):
                traces[i]["states"].append(parsed[k])
                traces[i]["frames"].append(new_frames[k])
                frames[i], states[i] = new_frames[k], parsed[k]
                if judge.kind[k] == StepKind.UNPARSEABLE:
                    traces[i]["stop"], active[i] = "unparseable", False
                elif judge.kind[k] >= StepKind.UNPARSEABLE:
                    traces[i]["stop"], active[i] = "invalid", False
                elif judge.dist_next[k] == 0:
                    traces[i]["stop"], active[i] = "goal", False
        for tr in traces:
            tr["states"] = np.stack(tr["states"])
        return traces


def build_tiny_llama(vocab: Vocabulary, seed: int = 0, **overrides) -> nn.Module:
    """A Llama-architecture causal LM with random weights over the planner vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    params = {**TINY_LLAMA, **overrides}
    config = LlamaConfig(vocab_size=vocab.size, bos_token_id=vocab.bos, eos_token_id=vocab.eos,
                         pad_token_id=vocab.pad, **params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)
