"""Loading a run config: `load_config(path, overrides)` returns a checked `RunConfig`.

The typed dataclasses, overrides and value checks are `mmrl.run_config` (core: every layer reads a
RunConfig); this module adds what needs the registries above core (the policy, the task and the
rewards a config names, the user's `plugins` that register their own) and sits above them. Every
key is checked before anything is built: an unknown key, a wrong type, a value outside its choices
or an unknown registered name raises `ConfigError` with one line that names the key and what is
accepted. Overrides use dotted keys: `algo.loss=gspo train.steps=20`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# The schema, its helpers and ConfigError are imported from here across the code and by users.
from mmrl.config_checks import (ConfigError, RunMismatchError, build_dataclass, check, check_names,  # noqa: F401
                                check_params)
from mmrl.run_config import (EVAL_KEYS, EVAL_TASK_PARAMS, FSDP_POLICIES, LOGPROB_CHUNK_LOGITS,  # noqa: F401
                             ROLLOUT_ENGINES, RUN_LENGTH_KEYS, VLLM_POLICIES, AlgoConfig, ModelConfig, RewardConfig,
                             RolloutConfig, RunConfig, SamplingConfig, SFTConfig, TaskConfig, TrainConfig,
                             apply_overrides, check_device, check_values, default_output_dir, is_eval_key,
                             parse_overrides, read_config_file, typed_config)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    data = read_config_file(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    train = data.get("train")
    if isinstance(train, dict) and not train.get("output_dir"):
        data["train"] = {**train, "output_dir": default_output_dir(path, overrides or [])}
    elif train is None:
        data["train"] = {"output_dir": default_output_dir(path, overrides or [])}
    return config_from_dict(data)


def config_from_dict(data: dict) -> RunConfig:
    cfg = typed_config(data)
    cfg.train.output_dir = cfg.train.output_dir or default_output_dir(None, [])
    import_plugins(cfg.plugins)
    validate(cfg)
    return cfg


def import_plugins(plugins: list[str]) -> None:
    """Import each of `plugins` (a module name, or a path to a .py file) once; a ConfigError of one
    line naming the plugin and why it did not import."""
    import importlib
    import importlib.util
    import sys

    for i, plugin in enumerate(plugins):
        try:
            if plugin.endswith(".py"):
                path = Path(plugin).expanduser().resolve()
                name = f"mmrl_plugin_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
                if name in sys.modules:
                    continue
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or not path.is_file():
                    raise FileNotFoundError(f"no file {path}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
            else:
                importlib.import_module(plugin)
        except Exception as exc:
            raise ConfigError(f"plugins[{i}]: cannot import {plugin!r}: {type(exc).__name__}: {exc}; accepted: "
                              f"a module name on the Python path or a path to a .py file") from None


def validate(cfg: RunConfig) -> None:
    """All of a config's checks: its values (`run_config.check_values`), then the names it gives the
    registries of policies, tasks and rewards (imports are local: registries fill on import)."""
    check_values(cfg)
    check_policy(cfg)
    check_task(cfg)
    check_rewards(cfg)


def check_policy(cfg: RunConfig) -> None:
    """model.policy and model.params against the policy registry, and what the policy must support."""
    from mmrl.algos import GAUSSIAN_KL
    from mmrl.policies import POLICIES, policy_class

    check(cfg.model.policy in POLICIES,
           f"model.policy: unknown policy {cfg.model.policy!r}; valid: {', '.join(sorted(POLICIES))}")
    try:
        policy_class(cfg.model.policy).check_params(cfg.model.params)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.algo.kl_kind == GAUSSIAN_KL:
        cls = policy_class(cfg.model.policy)
        ok = getattr(cls, "GAUSSIAN_UNITS", False) and cls.supports_gaussian_kl(cfg.model.params)
        gaussian = sorted(n for n in POLICIES if getattr(policy_class(n), "GAUSSIAN_UNITS", False))
        check(ok, f"algo.kl_kind: 'gaussian' needs units that are Gaussian denoising steps; model.policy "
                   f"{cfg.model.policy!r} (with these model.params) has none; accepted with: {', '.join(gaussian)} "
                   f"(video_gen with exploration sde); else k1, k2, k3 or abs")
    if cfg.train.max_tokens_per_micro and not getattr(policy_class(cfg.model.policy), "TOKEN_BUDGET", False):
        supported = sorted(n for n in POLICIES if getattr(policy_class(n), "TOKEN_BUDGET", False))
        raise ConfigError(f"train.max_tokens_per_micro: model.policy {cfg.model.policy!r} does not pack rows by "
                          f"length (its rows are not prompt + response tokens); set it to 0 or use "
                          f"train.micro_batch_size; supported: {', '.join(supported)}")
    if cfg.train.gradient_checkpointing and not getattr(policy_class(cfg.model.policy), "GRADIENT_CHECKPOINTING", False):
        supported = sorted(n for n in POLICIES if getattr(policy_class(n), "GRADIENT_CHECKPOINTING", False))
        raise ConfigError(f"train.gradient_checkpointing: model.policy {cfg.model.policy!r} does not support it; "
                          f"supported: {', '.join(supported)}")


def check_task(cfg: RunConfig) -> None:
    """task.name and task.params against the task registry and the task's own checks."""
    from mmrl.envs import task_class, task_names

    check(cfg.task.name in task_names(), f"task.name: unknown task {cfg.task.name!r}; valid: {', '.join(task_names())}")
    check_params(task_class(cfg.task.name).__init__, cfg.task.params, f"task.params (task {cfg.task.name!r})",
                 skip=1, internal=("seed",))
    try:  # the task's own checks of values that do not fit together (e.g. a parameter its source ignores)
        getattr(task_class(cfg.task.name), "check_params", lambda params: None)(cfg.task.params)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_rewards(cfg: RunConfig) -> None:
    """Each reward's name and parameters against the reward registry."""
    from mmrl.rewards import REWARDS, build_reward

    for i, r in enumerate(cfg.rewards):
        check(r.name in REWARDS, f"rewards[{i}].name: unknown reward {r.name!r}; valid: {', '.join(sorted(REWARDS))}")
        try:
            build_reward(r.name, r.params)  # checks the parameter names; builds nothing heavy
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"rewards[{i}].params: {exc}") from None


def eval_config(checkpoint: str | Path, config: str | Path | None = None, overrides: list[str] | None = None):
    """The config `mmrl eval` evaluates `checkpoint` (a run folder or a checkpoint in one) with: the
    run folder's own config.yaml, the resolved config the run was started with, with `overrides` on
    top. A `config` file given as well must agree with the run's on every key the weights were
    trained with (all but `mmrl.config.is_eval_key`); it is then used, with the overrides, as given.
    A run folder without config.yaml (written before mmrl kept one) needs `config`. The plugins its
    config.yaml names are imported only under `--trust-checkpoint`: the folder may come from elsewhere."""
    import mmrl.checkpoint
    from mmrl.checkpoint import (RUN_CONFIG, CheckpointError, config_differences, plain_config, read_run_config,
                                 run_dir_of)

    run_dir = run_dir_of(checkpoint)
    if not (run_dir / RUN_CONFIG).is_file():
        if config is None:
            raise CheckpointError(f"{run_dir} has no {RUN_CONFIG} (the config a run folder is started with); give "
                                  f"the config it was trained with: mmrl eval CONFIG --checkpoint {checkpoint}")
        return load_config(config, overrides)
    run = read_run_config(run_dir)
    if config is None and run.get("plugins") and not mmrl.checkpoint.TRUST_CHECKPOINT:
        raise CheckpointError(f"{run_dir / RUN_CONFIG} names plugins ({', '.join(run['plugins'])}), which evaluating "
                              f"with it would import, running their code; if you wrote this run folder yourself, "
                              f"pass --trust-checkpoint, or give the config it was trained with: mmrl eval CONFIG "
                              f"--checkpoint {checkpoint}")
    if config is not None:
        cfg = load_config(config, overrides)
        diff = config_differences(run, plain_config(cfg.to_dict()), lambda key: is_eval_key(key, run["task"]["name"]))
        if diff:
            raise RunMismatchError(f"{config} is not the config {run_dir} was trained with ({diff}); drop the "
                                   f"CONFIG argument: `mmrl eval --checkpoint {checkpoint}` evaluates with the run's "
                                   f"own {RUN_CONFIG} (overrides, e.g. train.eval_size=N, still apply)")
    else:
        cfg = config_from_dict(apply_overrides(run, overrides or []))
    cfg.train.output_dir = str(run_dir)  # the evaluation belongs to the checkpoint's run, wherever it now lies
    return cfg
