"""The typed run configuration (`RunConfig` and its sections), built from YAML data and overrides,
and the checks of its values that need no registry above core (`check_values`). Core: every layer
reads a RunConfig. Loading a config with all its checks is `mmrl.config.load_config`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mmrl.config_checks import ConfigError, build_dataclass, check, check_names, check_params, coerce


# train.logprob_chunk: 0 (the default) sizes a chunk of the output head to this many logits, 32M
# (128 MiB in float32, two such buffers alive): 220 tokens at Qwen2.5's 151,936-token vocabulary.
# On the CPU (hidden 896, 2,048 tokens, forward + backward) chunks of 256-1,024 tokens ran equally
# fast and 128 8 % slower. A tiny model's vocabulary fits a whole micro-batch in one chunk.
LOGPROB_CHUNK_LOGITS = 2**25


@dataclass
class ModelConfig:
    # Which policy adapter (mmrl.policies.POLICIES): causal_lm, and the domains' own.
    policy: str = "causal_lm"
    params: dict[str, Any] = field(default_factory=dict)  # adapter-specific settings
    # `tiny`: a Qwen2-architecture model built from `tiny` sizes with a tokenizer trained on the
    # task's corpus (tests, CPU demo). `pretrained`: `path`, a local folder or a hub id (mmrl.hub).
    source: Literal["tiny", "pretrained"] = "tiny"
    path: str | None = None
    tiny: dict[str, Any] = field(default_factory=dict)
    tokenizer_vocab_size: int = 320
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    use_chat_template: bool = False
    fast_decode: bool = True  # lean static-cache decoder for Llama/Qwen-family models
    lora_rank: int = 0  # > 0 turns on LoRA (peft)
    lora_alpha: int = 16
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    name: str = "arithmetic_exact"
    weight: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingConfig:
    group_size: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class RolloutConfig:
    # Training-inference mismatch correction (mmrl.algos.correction): the behaviour log-probs are
    # the engine's (Rollout.logp_beh) or, with train.recompute_old_logp, the sampler's own.
    correction: str = "none"  # none | tis | mis
    # token | sequence | auto: sequence for losses that need one advantage per sequence (gspo, gmpo),
    # else token, so `rollout.correction: tis` alone works with every loss
    correction_level: str = "auto"
    correction_cap: float = 2.0
    # What samples the text policies (causal_lm, qwen_vl): `hf`, their in-process sampler, or `vllm`,
    # a colocated vLLM engine on the GPU or, with vLLM's CPU build, the CPU (mmrl.policies.vllm_engine).
    engine: str = "hf"
    # > 0: at most this many rows (whole groups, one at least) in one in-process sampler call; a
    # step's or an evaluation's contexts are sampled in several calls. 0: all in one call.
    batch_size: int = 0
    vllm_memory: float = 0.3  # the engine's share of GPU (on the CPU: host) memory (vLLM's gpu_memory_utilization)
    # release the engine's weights and KV cache while training; null: on a GPU yes, on the CPU no
    # (vLLM's CPU backend has no sleep mode)
    vllm_sleep: bool | None = None
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # more vllm.LLM(...) arguments


@dataclass
class AlgoConfig:
    loss: str = "grpo"
    # None pairs the estimator with the loss: dr_grpo -> dr_grpo, everything else -> grpo.
    advantage: str | None = None
    advantage_params: dict[str, Any] = field(default_factory=dict)
    loss_params: dict[str, Any] = field(default_factory=dict)  # eps_low, eps_high, agg, tau_pos, ...
    beta: float = 0.0  # KL to the reference policy; 0 loads no reference model
    kl_kind: str = "k3"  # a KL estimator of mmrl.algos (`mmrl algos`): k1, k2, k3, abs; gaussian (flow policies)
    entropy_coef: float = 0.0
    # < 1: the policy gradient only on this share of tokens, the highest-entropy ones of each
    # forward pass (the mini-batch, or each micro-batch with train.micro_batch_size)
    entropy_top_frac: float = 1.0
    # Shaping and sampling (docs/algorithms.md, "Reward shaping and sampling").
    dynamic_sampling: bool = False
    max_sampling_tries: int = 4
    overlong_cache_len: int = 0  # > 0 turns on DAPO overlong shaping with L_max = max_new_tokens
    mask_truncated: bool = False
    redit_scale: float = 0.0
    redit_kind: Literal["gaussian", "uniform"] = "gaussian"
    success_filter: list[float] | None = None  # [low, high] on the group mean of the first reward
    # > 0: this share of each draw's prompts comes again from the prompts whose last group had
    # differing rewards (a FIFO of `prompt_replay_size`), sampled afresh; mmrl/stages/sampling.py
    prompt_replay: float = 0.0
    prompt_replay_size: int = 512
    # Guidance where RL cannot learn (ReLIFT, arXiv 2506.07527): a prompt whose group's best total
    # reward is below `guide_below` (every sample failed: zero advantage, nothing to learn from)
    # adds guide_coef x the policy's supervised loss on the task's expert target to the update.
    guide_below: float | None = None
    guide_coef: float = 1.0
    # Behaviour-cloning regularisation (DAPG, arXiv 1709.10087; VLA recipes that mix SFT into RL):
    # every optimizer step of the RL update adds sft_coef x the policy's supervised loss on a fresh
    # task.sft_batch of sft_batch_size (default: sft.batch_size) expert examples. 0: off.
    sft_coef: float = 0.0
    sft_batch_size: int | None = None
    gfpo_keep: int = 0  # > 0: GFPO, keep this many of each group by `gfpo_metric`; the rest get 0
    gfpo_metric: Literal["shortest", "reward_per_length"] = "shortest"
    # Perception (docs/algorithms.md, "Perception-aware terms"): the policy scores the sampled
    # units again with its images masked (each vision patch blacked with `mask_prob`).
    # PAPO (arXiv 2507.06448): maximise papo_gamma x the k3 KL(pi(.|image) || pi(.|masked image)),
    # optionally clipped per token at papo_kl_max (0 = no clip), plus the double entropy loss
    # papo_entropy = [eta_1 on the image's pass, eta_2 on the masked pass] (off by default).
    papo_gamma: float = 0.0
    papo_kl_max: float = 0.0
    papo_entropy: list[float] = field(default_factory=lambda: [0.0, 0.0])
    # More stages (mmrl.stages: rollout filters, reward shapers, advantage transforms, loss terms,
    # auxiliary losses), each {name: <registered>, <its fields>}, after the ones the keys above turn
    # on (mmrl.stages.LEGACY_KEYS; docs/architecture.md, "Add a stage").
    stages: list[dict[str, Any]] = field(default_factory=list)
    # VL-Calibration (arXiv 2604.09529): > 0 reweights the advantages of negative-advantage tokens
    # by the rollout's visual certainty, w = clip(1 + alpha (1 - 2c), 0, 2) with alpha = this value.
    certainty_reweight: float = 0.0
    mask_prob: float = 0.6

    @property
    def masks_images(self) -> bool:
        """Whether the update needs the masked-image pass."""
        return self.papo_gamma > 0 or any(e > 0 for e in self.papo_entropy) or self.certainty_reweight > 0

    def resolved_advantage(self) -> str:
        if self.advantage is not None:
            return self.advantage
        return "dr_grpo" if self.loss == "dr_grpo" else "grpo"


@dataclass
class SFTConfig:
    steps: int = 0  # warm-start steps before RL; 0 skips it
    batch_size: int = 32
    lr: float = 3e-3
    # constant, or cosine from lr to lr * train.min_lr_ratio over the sft.steps after the warmup
    lr_schedule: Literal["constant", "cosine"] = "constant"
    # linear ramp from lr / warmup_steps to lr over the first steps (then constant or cosine)
    warmup_steps: int = 0
    examples: int = 2000
    # > 0: stop SFT once its loop has used this many CPU-seconds (process time), whichever of the
    # two limits comes first: baselines trained for the same compute as another run
    max_cpu_s: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 50
    prompts_per_step: int = 8
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per epoch
    micro_batch_size: int = 0  # rows per forward/backward; 0 = whole mini-batch
    # > 0: micro-batches packed by length (verl's dynamic batch size) so that none holds more than
    # this many prompt + response tokens, padding included, and each is trimmed to its own longest
    # prompt and response. Same gradient as row-count micro-batches. Text and VLM policies
    # (TOKEN_BUDGET); micro_batch_size, when set, still bounds the rows. 0 = off.
    max_tokens_per_micro: int = 0
    # > 0: back-propagate this many units (tokens, action tokens, denoising steps) of each row at a
    # time, so one window's activations are alive, not all T; the gradient is the one-pass one.
    # Costs one extra forward without graph. 0 = all units in one pass.
    unit_chunk: int = 0
    recompute_old_logp: bool = False  # recompute old_logp with a forward instead of the sampler's
    # Tokens whose logits exist at once when log-probs are computed from the final hidden states
    # (mmrl.rollout.head_logprobs): the output head runs chunk by chunk, forward and backward, so
    # [rows, T, vocab] never does. 0: as many tokens as make LOGPROB_CHUNK_LOGITS logits.
    logprob_chunk: int = 0
    # Recompute each transformer block's activations in the backward instead of keeping them (the
    # policies whose GRADIENT_CHECKPOINTING is set; the config check names them). Same gradients.
    gradient_checkpointing: bool = False
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0
    # An optimizer step whose loss or gradient norm is NaN / inf is skipped (logged as
    # train/skipped_nonfinite); this many skipped in a row end the run in one line (it has
    # diverged). 0: never stop, skip them all.
    max_nonfinite_steps: int = 3
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    bf16: bool = True  # autocast on GPU only
    threads: int = 0  # torch.set_num_threads; 0 leaves the default
    # Under torchrun (mmrl train --nproc N): shard the policy with FSDP2 instead of replicating it
    fsdp: bool = False
    # A collective that waits longer than this (a rank died or hangs) ends the run with an error
    dist_timeout_s: float = 600.0
    # "" (the default): runs/<config file name>, plus the overrides that change the run (not those in
    # RUN_LENGTH_KEYS), e.g. runs/digit_sort_grpo+algo.loss=gspo; two different runs never share one
    output_dir: str = ""
    save_every: int = 0  # 0: only at the end
    eval_every: int = 10
    eval_size: int = 64
    eval_samples: int = 0  # > 0: also the mean reward of k samples per prompt at the training temperature
    log_every: int = 1
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "mmrl"
    progress: bool = True


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig()])
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # Python modules imported before the config is checked, where your own tasks, rewards, policies
    # and stages register themselves: module names (`my_lab.stages`) or paths to .py files.
    plugins: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- building from plain data


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: '{k}' is not a section")
    node[keys[-1]] = value


def parse_overrides(items: list[str]) -> dict:
    """`["algo.loss=gspo", "train.steps=3"]` -> nested dict; values are parsed as YAML scalars
    (`~key` removals are `apply_overrides`')."""
    data: dict = {}
    for item in items:
        if item.startswith("~"):
            continue
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. algo.loss=gspo) or ~key "
                              f"(remove a key)")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw) if raw else "")
    return data


def apply_overrides(data: dict, items: list[str]) -> dict:
    """`data` with the dotted overrides applied in order: `a.b=v` merges in (a mapping key by key, as
    `base:` does), `~a.b` removes the key, e.g. `~task.params.column_map` to drop a mapping a config set."""
    out = copy.deepcopy(data)  # the caller's mapping stays as it was
    for item in items:
        if not item.startswith("~"):
            out = _merge(out, parse_overrides([item]))
            continue
        keys, node = item[1:].strip().split("."), out
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict) or keys[-1] not in node:
            raise ConfigError(f"override {item}: the config has no key {item[1:]!r} to remove")
        del node[keys[-1]]
    return out


def _merge(base: dict | list, extra: dict, where: str = "") -> dict | list:
    """`extra` over `base`, section by section; digit keys index into a list (`rewards.0.weight=2`)."""
    if isinstance(base, list):
        if not all(str(k).isdigit() for k in extra):
            return extra  # a mapping replaces a list whole (and fails type checks if it should not)
        out_list = list(base)
        for k, v in extra.items():
            i = int(k)
            if i >= len(out_list):
                raise ConfigError(f"override {where}{k}: index {i} is past the end ({where.rstrip('.')} has "
                                  f"{len(out_list)} entries)")
            out_list[i] = _merge(out_list[i], v, f"{where}{k}.") if _mergeable(out_list[i], v) else v
        return out_list
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v, f"{where}{k}.") if _mergeable(out.get(k), v) else v
    return out


def _mergeable(base: Any, extra: Any) -> bool:
    return isinstance(extra, dict) and isinstance(base, (dict, list))


def typed_config(data: dict) -> RunConfig:
    """`data` as a typed RunConfig (names and types checked), without `validate`'s checks of values
    against the machine and the registries: for tools that only read a config (`mmrl plan`)."""
    return build_dataclass(RunConfig, data)


# Policies whose every forward goes through module calls that FSDP2's hooks see (others have
# functional fast paths over the raw weights).
FSDP_POLICIES = ("causal_lm",)
ROLLOUT_ENGINES = ("hf", "vllm")
VLLM_POLICIES = ("causal_lm", "vlm", "qwen_vl")

# Keys a run may change when it resumes: its length and how it reports. Any other difference from
# the config a run folder was started with is another run (resume refuses it).
RUN_LENGTH_KEYS = frozenset({
    "train.steps", "train.output_dir", "train.save_every", "train.eval_every", "train.log_every",
    "train.progress", "train.tensorboard", "train.wandb", "train.wandb_project", "train.threads",
    # when a diverging run stops: the steps it trains are the same (non-finite ones are skipped)
    "train.max_nonfinite_steps",
    # how the run is spread over processes: a checkpoint of N ranks resumes at M, sharded or not
    "train.fsdp", "train.dist_timeout_s",
})

# Keys `mmrl eval --checkpoint RUN` may take from elsewhere than the run's own config.yaml (a
# CONFIG argument, overrides): how much is evaluated and where it runs. Every other key is one the
# weights were trained with (the model, the data and the tokenizer a tiny model trains on the task's
# corpus, the algorithm): evaluating under another value is evaluating another run.
EVAL_KEYS = RUN_LENGTH_KEYS | {"train.eval_size", "train.eval_samples", "train.device"}
# Task parameters that only pick or size held-out data, per task: none of them changes the training
# split or the corpus a tiny tokenizer is trained on (VQA's eval_path / n_test / ood settings and
# video's eval_prompts do, so they are not here; nor tabletop's n_eval, drawn from one pool with n_train).
EVAL_TASK_PARAMS: dict[str, frozenset[str]] = {
    "planning": frozenset({"paper_split", "ood_sizes"}),
    "vqa": frozenset({"eval_k", "blank_eval"}),
    "caption": frozenset({"eval_k", "eval_questions"}),
    "video": frozenset({"eval_repeats"}),
    "tabletop": frozenset({"eval_mode", "eval_samples", "eval_grounding", "num_workers", "prefetch_resets"}),
    "libero": frozenset({"eval_trials", "eval_mode", "eval_samples", "eval_grounding", "num_workers",
                         "prefetch_resets", "assets_dir"}),
}


def is_eval_key(key: str, task: str) -> bool:
    """Whether the dotted `key` may differ from a run's config when its checkpoint is evaluated."""
    prefix = "task.params."
    if key.startswith(prefix):
        return key[len(prefix):].split(".", 1)[0] in EVAL_TASK_PARAMS.get(task, frozenset())
    return key in EVAL_KEYS


def check_device(name: Any, key: str, fallback: str = "auto or cpu") -> None:
    """Refuse a CUDA device this machine cannot see (one line, before anything is built): `key` is
    the config key that names it, `fallback` the values to suggest instead."""
    if not isinstance(name, str) or not (name == "cuda" or name.startswith("cuda:")):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{key}: {name!r} but no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                          f"use {key}={fallback}")
    index = name.partition(":")[2]
    if index and not index.isdigit():
        raise ConfigError(f"{key}: invalid device {name!r}; valid: cpu, cuda, cuda:N")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ConfigError(f"{key}: {name!r} but {count} CUDA GPU{'s are' if count > 1 else ' is'} visible here "
                          f"(cuda:0..cuda:{count - 1}); use {key}=cuda, a visible index, or {key}={fallback}")


def _param_devices(params: Any, where: str):
    """(key, value) of every `device` entry in a params mapping, nested ones included (a judge's or
    an encoder's own params)."""
    if isinstance(params, dict):
        for k, v in params.items():
            if k == "device":
                yield f"{where}.device", v
            else:
                yield from _param_devices(v, f"{where}.{k}")


def default_output_dir(path: str | Path | None, overrides: list[str]) -> str:
    """runs/<config stem>[+key=value...]: the overrides that change the run, sorted, in the name."""
    stem = Path(path).stem if path is not None else "default"
    changes = sorted(o.strip() for o in overrides if o.split("=", 1)[0].strip() not in RUN_LENGTH_KEYS)
    name = "+".join([stem, *changes]).replace("/", "_").replace(" ", "")
    if len(name) > 120:  # keep the folder name legal and readable; the hash keeps runs apart
        name = f"{name[:100]}+{hashlib.sha1(name.encode()).hexdigest()[:10]}"
    return str(Path("runs") / name)


def read_config_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """The YAML mapping of `path`; `base: PARENT.yaml` (relative to the file) names a config whose
    keys this one overrides, section by section (lists, e.g. `rewards`, are replaced whole)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in _seen:
        raise ConfigError(f"{path}: 'base' chain loops back to itself ({' -> '.join(map(str, _seen))})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be the path of a parent config, got {base!r}")
    return _merge(read_config_file(path.parent / base, (*_seen, path.resolve())), data)


def check_values(cfg: RunConfig) -> None:
    """Every value check that needs no registry above core: the algorithm's names (mmrl.algos) and
    stages (mmrl.stages), devices, ranges and cross-field rules. `mmrl.config.validate` adds the
    names of the policy, the task and the rewards."""
    loss_spec = check_algorithm_names(cfg)
    check_devices(cfg)
    check_training(cfg)
    check_rollout(cfg, loss_spec)
    check_algorithm(cfg)
    check_model_path(cfg)


def check_algorithm_names(cfg: RunConfig):
    """The loss, estimator and KL estimator against mmrl.algos, with their params; the loss's spec."""
    from mmrl.algos import AGG_MODES, get_advantage_spec, get_loss_spec, list_algorithms

    try:
        loss_spec = get_loss_spec(cfg.algo.loss)
    except ValueError as exc:
        raise ConfigError(f"algo.loss: {exc}") from None
    check_names(cfg.algo.loss_params, [p for p in loss_spec.accepted_params if p not in ("denominator", "weights")],
                 f"algo.loss_params (loss {cfg.algo.loss!r})")
    # A loss's params are typed by its defaults (numbers), its aggregation by the four modes.
    for key, value in cfg.algo.loss_params.items():
        default = loss_spec.defaults.get(key)
        if key == "agg":
            coerce(value, Literal[AGG_MODES], "algo.loss_params.agg")
        elif key == "max_response_len":
            coerce(value, int, "algo.loss_params.max_response_len")
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            coerce(value, float, f"algo.loss_params.{key}")
    estimators = [name for name, *_ in list_algorithms()["advantage"]]
    adv = cfg.algo.resolved_advantage()
    check(adv in estimators, f"algo.advantage: unknown estimator {adv!r}; valid: {', '.join(sorted(estimators))}")
    # names, and values against the estimator's annotations (its params are its keyword arguments)
    check_params(get_advantage_spec(adv).fn, cfg.algo.advantage_params, f"algo.advantage_params (estimator {adv!r})",
                 skip=2, internal=("mask",))
    kl_kinds = [name for name, *_ in list_algorithms()["kl"]]
    check(cfg.algo.kl_kind in kl_kinds, f"algo.kl_kind: invalid value {cfg.algo.kl_kind!r}; valid: {', '.join(kl_kinds)}")
    return loss_spec


def check_devices(cfg: RunConfig) -> None:
    """Every device a config names, before anything is built (a reward or judge loads its model
    onto its device when built)."""
    t = cfg.train
    check(t.device in ("auto", "cpu", "cuda") or (t.device.startswith("cuda:") and t.device[5:].isdigit()),
           f"train.device: invalid value {t.device!r}; valid: auto, cpu, cuda, cuda:N")
    check_device(t.device, "train.device")
    named = [*_param_devices(cfg.model.params, "model.params"), *_param_devices(cfg.task.params, "task.params")]
    for i, r in enumerate(cfg.rewards):
        named += _param_devices(r.params, f"rewards.{i}.params")
    for key, value in named:
        check_device(value, key, fallback="cpu")  # these are handed to torch as they are: no "auto"


def check_training(cfg: RunConfig) -> None:
    """Sampling, SFT and training sizes and rates, and what FSDP does not support."""
    check(len(cfg.rewards) > 0, "rewards: at least one reward is needed")
    s, t, a = cfg.sampling, cfg.train, cfg.algo
    check(s.group_size >= 1, f"sampling.group_size must be >= 1, got {s.group_size}")
    check(s.max_new_tokens >= 1, f"sampling.max_new_tokens must be >= 1, got {s.max_new_tokens}")
    check(s.temperature > 0, f"sampling.temperature must be > 0, got {s.temperature}")
    check(0 < s.top_p <= 1, f"sampling.top_p must be in (0, 1], got {s.top_p}")
    check(s.top_k >= 0, f"sampling.top_k must be >= 0 (0 = off), got {s.top_k}")
    check(cfg.sft.steps >= 0, f"sft.steps must be >= 0 (0 = no SFT), got {cfg.sft.steps}")
    check(cfg.sft.lr > 0, f"sft.lr must be > 0, got {cfg.sft.lr}")
    check(cfg.sft.batch_size >= 1, f"sft.batch_size must be >= 1, got {cfg.sft.batch_size}")
    check(cfg.sft.examples >= 1, f"sft.examples must be >= 1, got {cfg.sft.examples}")
    check(cfg.sft.warmup_steps >= 0, f"sft.warmup_steps must be >= 0, got {cfg.sft.warmup_steps}")
    check(cfg.sft.max_cpu_s >= 0, f"sft.max_cpu_s must be >= 0 (0 = no limit), got {cfg.sft.max_cpu_s}")
    check(t.steps >= 0, f"train.steps must be >= 0, got {t.steps}")
    check(t.prompts_per_step >= 1, f"train.prompts_per_step must be >= 1, got {t.prompts_per_step}")
    check(t.ppo_epochs >= 1, f"train.ppo_epochs must be >= 1, got {t.ppo_epochs}")
    check(t.mini_batches >= 1, f"train.mini_batches must be >= 1, got {t.mini_batches}")
    check(t.micro_batch_size >= 0, f"train.micro_batch_size must be >= 0, got {t.micro_batch_size}")
    check(t.max_tokens_per_micro >= 0, f"train.max_tokens_per_micro must be >= 0 (prompt + response tokens "
                                        f"of one micro-batch; 0 = off), got {t.max_tokens_per_micro}")
    check(t.unit_chunk >= 0, f"train.unit_chunk must be >= 0 (0 = all units in one pass), got {t.unit_chunk}")
    check(t.logprob_chunk >= 0, f"train.logprob_chunk must be >= 0 (tokens per chunk of the output head; "
                                 f"0 = sized to the vocabulary), got {t.logprob_chunk}")
    check(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    check(t.max_nonfinite_steps >= 0, f"train.max_nonfinite_steps must be >= 0 (0 = never stop on non-finite "
                                      f"steps, only skip them), got {t.max_nonfinite_steps}")
    check(len(t.betas) == 2, f"train.betas must be two numbers, got {t.betas}")
    check(t.dist_timeout_s > 0, f"train.dist_timeout_s must be > 0, got {t.dist_timeout_s}")
    if t.fsdp:  # FSDP needs the same forwards on every rank; these take a rank-dependent number
        check(cfg.model.policy in FSDP_POLICIES,
               f"train.fsdp: model.policy {cfg.model.policy!r} runs replicated only (train.fsdp: false); "
               f"FSDP2 sharding is built for: {', '.join(FSDP_POLICIES)}")
        check(t.unit_chunk == 0, f"train.fsdp does not support train.unit_chunk (got {t.unit_chunk}); set it to 0")
        check(a.guide_below is None, "train.fsdp does not support algo.guide_below; use replicate mode (train.fsdp: false)")


def check_rollout(cfg: RunConfig, loss_spec) -> None:
    """Mismatch correction, the sampler's batch and the rollout engine."""
    from mmrl.algos import CORRECTION_LEVELS, CORRECTIONS

    r, t = cfg.rollout, cfg.train
    check(r.correction in CORRECTIONS,
           f"rollout.correction: invalid value {r.correction!r}; valid: {', '.join(CORRECTIONS)}")
    check(r.correction_level in ("auto", *CORRECTION_LEVELS),
           f"rollout.correction_level: invalid value {r.correction_level!r}; valid: auto, {', '.join(CORRECTION_LEVELS)}")
    check(r.correction_cap > 1, f"rollout.correction_cap must be > 1, got {r.correction_cap}")
    check(r.correction == "none" or r.correction_level != "token" or not loss_spec.sequence_advantage,
           f"rollout.correction_level: loss {cfg.algo.loss!r} needs one advantage per sequence; "
           f"set rollout.correction_level: sequence")
    check(r.batch_size >= 0, f"rollout.batch_size must be >= 0 (0 = all rows in one sampler call), got {r.batch_size}")
    check(r.engine in ROLLOUT_ENGINES, f"rollout.engine: invalid value {r.engine!r}; valid: {', '.join(ROLLOUT_ENGINES)}")
    if r.engine == "vllm":
        check(cfg.model.policy in VLLM_POLICIES,
               f"rollout.engine: vllm samples the text policies ({', '.join(VLLM_POLICIES)}), "
               f"not model.policy {cfg.model.policy!r}; use rollout.engine: hf")
        check(t.recompute_old_logp, "rollout.engine: vllm needs train.recompute_old_logp: true (the engine's "
                                     "log-probs are the behaviour policy's, not the trainer's)")
        check(0 < r.vllm_memory < 1, f"rollout.vllm_memory must be in (0, 1) (a share of the device's memory), got {r.vllm_memory}")


def check_algorithm(cfg: RunConfig) -> None:
    """The algorithm's ranges and cross-field rules, then every stage's config (mmrl.stages)."""
    s, a = cfg.sampling, cfg.algo
    check(a.beta >= 0, f"algo.beta must be >= 0, got {a.beta}")
    check(0 < a.entropy_top_frac <= 1, f"algo.entropy_top_frac must be in (0, 1] (1 = every token), got {a.entropy_top_frac}")
    check(a.overlong_cache_len < s.max_new_tokens or a.overlong_cache_len == 0,
           f"algo.overlong_cache_len ({a.overlong_cache_len}) must be below sampling.max_new_tokens ({s.max_new_tokens})")
    check(a.gfpo_keep == 0 or 1 <= a.gfpo_keep < s.group_size,
           f"algo.gfpo_keep ({a.gfpo_keep}) must be 0 (off) or in [1, sampling.group_size={s.group_size})")
    check(0 <= a.prompt_replay <= 1, f"algo.prompt_replay must be in [0, 1] (0 = off), got {a.prompt_replay}")
    check(a.prompt_replay_size >= 1, f"algo.prompt_replay_size must be >= 1, got {a.prompt_replay_size}")
    check(a.guide_coef > 0, f"algo.guide_coef must be > 0, got {a.guide_coef}")
    check(a.sft_coef >= 0, f"algo.sft_coef must be >= 0, got {a.sft_coef}")
    check(a.sft_batch_size is None or a.sft_batch_size >= 1,
           f"algo.sft_batch_size must be >= 1 (or null: sft.batch_size), got {a.sft_batch_size}")
    check(a.papo_gamma >= 0, f"algo.papo_gamma must be >= 0 (0 = off), got {a.papo_gamma}")
    check(a.papo_kl_max >= 0, f"algo.papo_kl_max must be >= 0 (0 = no clip), got {a.papo_kl_max}")
    check(len(a.papo_entropy) == 2 and min(a.papo_entropy) >= 0,
           f"algo.papo_entropy must be two numbers >= 0 ([eta_1, eta_2]), got {a.papo_entropy}")
    check(a.certainty_reweight >= 0, f"algo.certainty_reweight must be >= 0 (0 = off), got {a.certainty_reweight}")
    check(0 <= a.mask_prob <= 1, f"algo.mask_prob must be in [0, 1], got {a.mask_prob}")
    if a.success_filter is not None:
        lo_hi = a.success_filter
        check(len(lo_hi) == 2 and 0 <= lo_hi[0] <= lo_hi[1] <= 1,
               f"algo.success_filter must be [low, high] with 0 <= low <= high <= 1, got {lo_hi}")
    from mmrl.stages import Guidance, from_algo

    stages = from_algo(a, cfg.sft.batch_size)  # every stage's config, checked before anything is built
    check(not (cfg.train.fsdp and stages.find(Guidance)), "train.fsdp does not support the guidance stage "
          "(its extra forwards differ between ranks); use replicate mode (train.fsdp: false)")


def check_model_path(cfg: RunConfig) -> None:
    check(cfg.model.source != "pretrained" or bool(cfg.model.path),
           "model.path: a local folder or a hub id (owner/name) is required when model.source is 'pretrained'")
    # A path the user gives is used or refused, never ignored: `tiny` builds a model from model.tiny.
    check(cfg.model.source != "tiny" or cfg.model.path is None,
           f"model.path: {cfg.model.path!r} is given but model.source is 'tiny' (a random model built from "
           f"model.tiny), which would ignore it; set model.source: pretrained to load it, or drop model.path")
    if cfg.model.source == "pretrained":  # a hub id is fetched when the model is built (mmrl.hub)
        from mmrl.hub import is_hub_id

        path = Path(cfg.model.path).expanduser()
        check(path.is_dir() or (not path.exists() and is_hub_id(cfg.model.path)),
               f"model.path: {cfg.model.path!r} is not a model folder" + (" (it is a file)" if path.is_file() else
                                                                          " (not found) nor a hub id (owner/name)")
               + "; accepted: a local folder saved by save_pretrained, or a Hugging Face model id")
