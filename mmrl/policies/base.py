"""The contracts between the trainer and a domain. Structural (Protocols): nothing to subclass.

A domain is an env/task (contexts) + a policy adapter (model) + reward adapters + an eval,
joined by config. The trainer calls only what is written here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Protocol

import numpy as np
import torch
from torch import nn

from mmrl.config_checks import ConfigError, build_dataclass, check_names
from mmrl.rollout import Rollout, unit_spans


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode (no dropout, no augmentation) for the block, its mode restored after,
    also on error; gradients still flow. Sampling and re-scoring use it so that the log-probs of
    the rollout and of the update see the same network."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


class Policy(Protocol):
    model: nn.Module  # the trainable module (optimizer, checkpoints)
    reference: nn.Module | None  # set by enable_reference() when algo.beta > 0

    @property
    def device(self) -> torch.device: ...

    def sample(self, contexts: list[Any], group_size: int, generator: torch.Generator | None = None,
               temperature: float | None = None) -> Rollout:
        """G samples per context, the G rows of a context adjacent (the trainer stamps group ids).
        `logp_old` is the sampler's log-prob of each unit under the same distribution `logprobs`
        recomputes (temperature 0 = greedy); `max_units` is the sampler's unit budget."""

    def logprobs(self, rollout: Rollout, with_entropy: bool = False,
                 units: slice | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced `[N, T]` log-probs of `rollout.units[:, units]` (default: all; with
        gradient), and per-unit entropy when asked. A window computes only what its units need
        (`train.unit_chunk` back-propagates one window at a time)."""

    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor: ...

    def enable_reference(self) -> None: ...

    def decode(self, rollout: Rollout) -> list[Any]:
        """What reward adapters read: text, frames, trajectories."""

    def sft_loss(self, contexts: list[Any]) -> torch.Tensor:
        """Supervised loss on the contexts' targets (warm start, VPFT-style baselines)."""

    def save(self, directory: str | Path) -> None:
        """`save_pretrained`-style export that `from_pretrained(directory)` loads back."""


class Task(Protocol):
    def next_batch(self, n: int) -> list[Any]: ...  # training contexts; advances the cursor

    def eval_batch(self, n: int) -> list[Any]: ...  # fixed held-out contexts

    def sft_batch(self, n: int, rng: np.random.Generator) -> list[Any]: ...  # contexts with targets

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    # Optional: `corpus() -> list[str]` to train a tiny local tokenizer, and
    # `evaluate(policy, n) -> dict[str, float]` for a domain metric beyond the mean reward.


class PolicyBase:
    """What every adapter shares: device, the frozen reference for the KL term, LoRA wrapping."""

    model: nn.Module
    reference: nn.Module | None = None
    # The dataclass of `model.params` (its keys, types, defaults and, in `__post_init__`, value
    # checks): every adapter declares one, checked when the config loads, before a model is built.
    CONFIG: type | None = None
    can_mask_images = False  # `mask_images` works on its rollouts (PAPO, VL-Calibration)
    logprob_chunk = 0  # tokens per chunk of the output head's log-probs (train.logprob_chunk; 0: sized to the vocabulary)
    GRADIENT_CHECKPOINTING = False  # `enable_gradient_checkpointing` works (train.gradient_checkpointing)

    @classmethod
    def check_params(cls, params: dict) -> None:
        """Raise ValueError (one line) naming a `model.params` key this adapter does not read, a value
        of the wrong type or one its config refuses (at config load)."""
        if cls.CONFIG is None:
            raise TypeError(f"{cls.__name__} declares no CONFIG dataclass of its model.params")
        check_names(params, cls.param_names(), f"model.params ({cls.__name__})", kind="key")
        try:
            build_dataclass(cls.CONFIG, params, "model.params")
        except ConfigError as exc:
            raise ValueError(f"{exc} ({cls.__name__})") from None

    @classmethod
    def param_names(cls) -> list[str]:
        """The `model.params` keys this adapter reads."""
        return [f.name for f in dataclasses.fields(cls.CONFIG) if f.init]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def mask_images(self, rollout: Rollout, prob: float, generator: torch.Generator | None = None) -> Rollout:
        """The same rollout (same units) with every image patch blacked with probability `prob`, to
        score it again under a perturbed context (PAPO, VL-Calibration). Policies that see images
        override it."""
        raise NotImplementedError(f"{type(self).__name__} cannot mask its images (can_mask_images is False)")

    def enable_gradient_checkpointing(self) -> None:
        """Keep no transformer block's activations for the backward; recompute them there instead
        (train.gradient_checkpointing). Hugging Face models: their own switch, non-reentrant (so LoRA
        and frozen inputs work), which covers a Qwen-VL's language model and vision tower alike.
        Teacher forcing then takes the HF forward: the lean decoder keeps its activations."""
        hf = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        if hasattr(hf, "activation_checkpointing_enable"):  # transformers 5.2x's name (the old one is deprecated)
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def enable_reference(self) -> None:
        """A frozen copy of the current weights for the KL term; under LoRA the model with its
        adapter disabled is the reference, so nothing is copied."""
        if hasattr(self.model, "disable_adapter"):
            return
        import copy

        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    def reference_module(self):
        """A context manager yielding the module to run for reference log-probs."""
        if self.reference is not None:
            return contextlib.nullcontext(self.reference)
        if not hasattr(self.model, "disable_adapter"):
            raise RuntimeError("reference log-probs need enable_reference() first (algo.beta > 0 calls it)")

        @contextlib.contextmanager
        def disabled():
            with self.model.disable_adapter():
                yield self.model

        return disabled()


class UnitSteps(NamedTuple):
    """What a flow policy's teacher-forced pass gives per unit (one Gaussian denoising step): the
    log-prob [N, T], and on request the exact per-element KL to reference means [N, T] and the
    step means themselves [N, T, *unit_shape] (a unit's own slice of the latent or action chunk)."""

    logp: torch.Tensor
    kl: torch.Tensor | None = None
    means: torch.Tensor | None = None


class FlowPolicyBase(PolicyBase):
    """What the flow-matching policies share (SmolVLA's action expert, the video generator, the
    diffusion policy): each unit is a Gaussian step (`mmrl.flow`) whose log-prob a subclass's
    `_unit_steps(model, rollout, window, ref_means, with_means)` recomputes teacher-forced.

    `algo.kl_kind: gaussian` (Flow-GRPO's KL) takes the exact KL of each step to the reference's
    step from the same state, (mean - mean_ref)^2 / (2 std^2) averaged over the unit's elements
    (`mmrl.flow.gaussian_kl`), from the means of the same forward that gives the log-probs: the
    reference pass keeps its step means per unit (`reference_means`, [N, T, *unit_shape]: the
    rollout's size in latents once more), the update reads them (`logprobs_and_kl`)."""

    GAUSSIAN_UNITS = True  # every unit is a Gaussian step with a mean: algo.kl_kind gaussian applies

    @classmethod
    def supports_gaussian_kl(cls, params: dict) -> bool:
        """Whether the units under these `model.params` are Gaussian steps."""
        return True

    def _unit_steps(self, model: nn.Module, rollout: Rollout, window: slice | None = None,
                    ref_means: torch.Tensor | None = None, with_means: bool = False) -> UnitSteps:
        raise NotImplementedError

    def _rollout_logprobs(self, model: nn.Module, rollout: Rollout, window: slice | None = None) -> torch.Tensor:
        return self._unit_steps(model, rollout, window).logp

    def logprobs(self, rollout: Rollout, with_entropy: bool = False,
                 units: slice | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logp = self._rollout_logprobs(self.model, rollout, window=units)
        # A Gaussian step's entropy does not depend on the policy's mean: report zeros (logged only).
        return logp, (torch.zeros_like(logp) if with_entropy else None)

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        with self.reference_module() as ref:
            return self._rollout_logprobs(ref, rollout)

    @torch.no_grad()
    def reference_means(self, rollout: Rollout) -> torch.Tensor:
        """The reference's step mean of every unit [N, T, *unit_shape] (0 where a unit is not scored)."""
        with self.reference_module() as ref:
            return self._unit_steps(ref, rollout, with_means=True).means

    def logprobs_and_kl(self, rollout: Rollout, ref_means: torch.Tensor,
                        units: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and the exact KL to `ref_means` (`reference_means` of these rows) [N, T] of
        the units `units`, both with gradient, from one forward."""
        steps = self._unit_steps(self.model, rollout, window=units, ref_means=ref_means)
        return steps.logp, steps.kl


class TextPolicyBase(PolicyBase):
    """What the adapters that sample text tokens share (causal LM, Qwen-VL): sampling settings, the
    rollout around the sampler, teacher-forced log-probs of it, decode, SFT loss and save.

    A subclass sets `eos_token_ids` and `suppress_token_ids` and writes `encode(contexts)` (prompt
    tensors, and lists that the G samples of a context share), `_generate` (the sampler call),
    `_token_logprobs` (reading what `encode` gave) and `target_text`; `engine_prompts` when a
    rollout engine (`rollout.engine: vllm`, set as `engine`) may sample for it.
    """

    engine = None  # mmrl.policies.vllm_engine.VLLMEngine, else the in-process sampler
    GRADIENT_CHECKPOINTING = True  # Hugging Face models (causal LMs, Qwen-VLs and the action-token VLA)
    TOKEN_BUDGET = True  # rows are left-padded prompts + right-padded replies (train.max_tokens_per_micro)
    PROMPT_COLUMNS = ("prompt_ids", "prompt_mask")  # the extras [N, P] of the left-padded prompt

    def __init__(self, model: nn.Module, tokenizer, *, processor=None, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, max_new_tokens: int = 16):
        self.model = model
        self.tokenizer = tokenizer
        self.processor = tokenizer if processor is None else processor  # what `save` writes beside the weights
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens

    @property
    def pad_token_id(self) -> int:
        """What the sampler writes after a row's EOS: the tokenizer's pad token, else the first EOS."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.eos_token_ids[0]

    @torch.no_grad()
    def sample(self, contexts: list[Any], group_size: int, generator: torch.Generator | None = None,
               temperature: float | None = None) -> Rollout:
        enc = self.encode(contexts)
        rows = repeat_rows(enc, group_size)
        kwargs = dict(max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos_token_ids,
                      pad_token_id=self.pad_token_id,
                      temperature=self.temperature if temperature is None else temperature, top_k=self.top_k,
                      top_p=self.top_p, suppress_token_ids=self.suppress_token_ids, generator=generator)
        if self.engine is not None:
            out = self.engine.sample(self.model, self.engine_prompts(contexts), group_size, **kwargs)
            # The engine's log-probs are the behaviour policy's; the trainer recomputes logp_old.
            return Rollout(units=out.tokens, logp_old=out.logp, logp_beh=out.logp, mask=out.mask,
                           truncated=out.truncated, max_units=self.max_new_tokens,
                           contexts=repeat_rows(contexts, group_size), extras=rows)
        with eval_mode(self.model):
            out = self._generate(enc, rows, group_size, kwargs)
        return Rollout(units=out.tokens, logp_old=out.logp, mask=out.mask, truncated=out.truncated,
                       max_units=self.max_new_tokens, contexts=repeat_rows(contexts, group_size), extras=rows)

    def engine_prompts(self, contexts: list[Any]) -> list[dict[str, Any]]:
        """The contexts as a rollout engine's prompts (vLLM's `TokensPrompt` / `TextPrompt` dicts)."""
        raise NotImplementedError(f"{type(self).__name__} cannot sample with a rollout engine")

    def logprobs(self, rollout: Rollout, with_entropy: bool = False, units: slice | None = None):
        return self._token_logprobs(self.model, rollout.extras, rollout.units, with_entropy, window=units)

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        with self.reference_module() as ref:
            return self._token_logprobs(ref, rollout.extras, rollout.units, False)[0]

    def row_tokens(self, rollout: Rollout) -> torch.Tensor:
        """Long [N, 2]: each row's prompt tokens and reply span (up to its last trained unit)."""
        return torch.stack([rollout.extras["prompt_mask"].sum(1), unit_spans(rollout.mask)], 1)

    def trim_padding(self, part: Rollout) -> Rollout:
        """`part` without the prompt columns that are padding in every row (prompts are left-padded)
        nor the unit columns after its longest reply: the same scores for a causal model, on fewer
        positions."""
        keep = part.extras["prompt_mask"].any(0).long()
        first = int(keep.argmax()) if bool(keep.any()) else keep.numel()
        T = max(1, int(unit_spans(part.mask).max())) if len(part) else part.units.shape[1]
        cut = lambda t: None if t is None else t[:, :T]  # noqa: E731
        extras = {k: v[:, first:] if k in self.PROMPT_COLUMNS else v for k, v in part.extras.items()}
        return replace(part, units=cut(part.units), logp_old=cut(part.logp_old), mask=cut(part.mask),
                       logp_beh=cut(part.logp_beh), extras=extras)

    def decode(self, rollout: Rollout) -> list[str]:
        rows = [u[m].tolist() for u, m in zip(rollout.units.cpu(), rollout.mask.cpu())]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    def sft_loss(self, contexts: list[Any]) -> torch.Tensor:
        """Token-mean negative log-likelihood of the target text + EOS after each prompt."""
        enc = self.encode(contexts)
        eos = self.tokenizer.eos_token or self.tokenizer.convert_ids_to_tokens(self.eos_token_ids[0])
        targets = self.tokenizer([self.target_text(c, i) + eos for i, c in enumerate(contexts)],
                                 return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        units, mask = targets.input_ids.to(self.device), targets.attention_mask.bool().to(self.device)
        logp, _ = self._token_logprobs(self.model, enc, units, False, temperature=1.0)
        return -torch.where(mask, logp, 0.0).sum() / mask.sum()

    def save(self, directory: str | Path) -> None:
        self.model.save_pretrained(directory)
        without_call_state(self.processor)
        self.processor.save_pretrained(directory)


def without_call_state(tokenizer) -> None:
    """Clear the padding and truncation that a fast tokenizer's backend keeps from its last call
    (`padding=True` sets them; each call sets what it needs again), so that `save_pretrained` writes
    the tokenizer as loaded: a run's export is then byte for byte the same whether or not it sampled
    before saving, as a resumed run has not. Takes a tokenizer or a processor that holds one."""
    backend = getattr(getattr(tokenizer, "tokenizer", tokenizer), "backend_tokenizer", None)
    if backend is not None:  # a slow tokenizer keeps no such state
        backend.no_padding()
        backend.no_truncation()


def repeat_rows(batch, group_size: int):
    """Each row `group_size` times, adjacent: tensors along dim 0; list entries are repeated, not
    copied (the G samples of a context share its vision tensors); a dict, value by value."""
    if isinstance(batch, dict):
        return {k: repeat_rows(v, group_size) for k, v in batch.items()}
    if isinstance(batch, torch.Tensor):
        return batch.repeat_interleave(group_size, 0)
    return [x for x in batch for _ in range(group_size)]


def sampling_settings(s) -> dict[str, Any]:
    """The `sampling` config values a text policy's constructor takes."""
    return dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_new_tokens=s.max_new_tokens)


def checkpoint_dir(path: str | Path) -> Path:
    """`model.path` as a Path, checked to be a saved checkpoint (a clear error instead of a hub lookup)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path {path} has no config.json: not a saved checkpoint directory")
    return path


def apply_lora(model: nn.Module, model_cfg) -> nn.Module:
    """Wrap `model` with LoRA adapters when `model.lora_rank > 0` (peft); otherwise return it."""
    if model_cfg.lora_rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha,
                                            target_modules=model_cfg.lora_target_modules))
