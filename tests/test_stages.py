"""Stages (mmrl.stages): today's keys become the built-in stages in the order their hooks ran before
the stages; a new method of any kind is one registered dataclass that a config names (a loss term, a
reward shaper, a rollout filter are shown); a key and the stage it maps to train alike; a bad stage
spec is refused at load in one line."""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from mmrl import algos, stages
from mmrl.config import ConfigError, config_from_dict, load_config
from mmrl.distributed import SINGLE
from mmrl.trainer import legacy_stage_state

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import build, make_cfg  # noqa: E402

if "test_constant" not in stages.STAGES:

    @stages.register_stage("test_constant")
    @dataclass(frozen=True)
    class Constant(stages.LossTerm):
        """`weight` x 1 per unit: its aggregate is 1 over an optimizer step, and it has no gradient."""

        weight: float = 0.0

        @property
        def coef(self) -> float:
            return self.weight

        @property
        def score(self) -> str:
            return "logp"

        def per_unit(self, x: stages.TermInputs) -> torch.Tensor:
            return torch.ones_like(x.scores["logp"]).detach()

    @stages.register_stage("test_flip")
    @dataclass
    class Flip(stages.RewardShaper):
        """The rewards negated: every advantage changes sign."""

        def shape(self, rewards, rollout, unit_budget, generator):
            return -rewards

    @stages.register_stage("test_first_group_only")
    @dataclass
    class FirstGroupOnly(stages.RolloutStage):
        """Keeps the rows of the lowest group id of each batch."""

        is_filter: ClassVar[bool] = True

        def keep(self, rollout):
            return rollout.group_ids == rollout.group_ids.min()


def trainer_with(tmp_path, **algo):
    cfg = make_cfg(str(tmp_path / "run")).to_dict()
    cfg["algo"].update(algo)
    return build(config_from_dict(cfg), SINGLE)


def test_todays_keys_are_the_built_in_stages_in_their_order():
    algo = load_config(None, ["algo.beta=0.04", "algo.entropy_coef=0.01", "algo.papo_gamma=0.02",
                              "algo.papo_entropy=[0.03, 0.05]", "algo.dynamic_sampling=true",
                              "algo.overlong_cache_len=4", "algo.redit_scale=0.1", "algo.gfpo_keep=2",
                              "algo.sft_coef=0.5", "algo.guide_below=0.1"]).algo
    run = stages.from_algo(algo, sft_batch_size=7)
    assert [s.name for s in run.items] == ["dynamic_sampling", "guidance", "overlong_penalty", "redit", "gfpo",
                                           "kl_ref", "entropy", "perception_kl", "entropy_masked", "sft_mix"]
    terms = run.of(stages.LossTerm)
    assert [t.coef for t in terms] == [0.04, pytest.approx(0.03 - 0.01), -0.02, 0.05]
    assert [t.score for t in terms] == ["logp", "entropy", "logp_masked", "entropy_masked"]
    assert stages.KLToReference(beta=0.1, kind="gaussian").score == "kl_ref"  # the policy scores it
    assert [s.name for s in run.rollout] == ["dynamic_sampling", "guidance"] and len(run.filters) == 1
    assert [s.name for s in run.auxiliary_losses] == ["guidance", "sft_mix"]  # guidance is of two kinds
    assert run.find(stages.SFTMix).batch_size == 7 and run.needs_masked_images
    assert set(stages.LEGACY_KEYS.values()) <= set(stages.STAGES)


def test_a_new_loss_term_is_one_registered_class_a_config_names(tmp_path):
    """The term's aggregate over a step is 1 and it has no gradient: the logged loss rises by its
    weight exactly and the weights after the step are those of the run without it."""
    results = {}
    for weight in (0.0, 0.25):
        trainer = trainer_with(tmp_path, stages=[{"name": "test_constant", "weight": weight}] if weight else [])
        rollout, _ = trainer.collect()
        metrics = trainer.update(rollout)
        results[weight] = metrics, [p.detach().clone() for p in trainer.policy.model.parameters()]
    (base, w0), (added, w1) = results[0.0], results[0.25]
    assert added["train/test_constant"] == pytest.approx(1.0)
    assert added["train/loss"] == pytest.approx(base["train/loss"] + 0.25, abs=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


def test_a_new_reward_shaper_and_filter_plug_in_without_a_trainer_edit(tmp_path):
    plain = trainer_with(tmp_path)
    rollout, _ = plain.collect()
    rollout.rewards["total"] = torch.rand(len(rollout), generator=torch.Generator().manual_seed(0))  # spread
    flipped = trainer_with(tmp_path, stages=[{"name": "test_flip"}])
    adv, rewards = flipped.advantages(rollout)
    torch.testing.assert_close(rewards, -rollout.rewards["total"])
    torch.testing.assert_close(adv, algos.compute_advantages("grpo", -rollout.rewards["total"], rollout.group_ids))
    assert adv.abs().sum() > 0 and torch.allclose(adv, -plain.advantages(rollout)[0], atol=1e-6)

    filtered = trainer_with(tmp_path, stages=[{"name": "test_first_group_only"}], max_sampling_tries=2)
    batch, stats = filtered.collect()
    G = filtered.cfg.sampling.group_size
    assert len(batch) == 2 * G and batch.group_ids.unique().tolist() == [0, 3]  # one group a round, two rounds
    assert stats["sampling/tries"] == 2 and stats["sampling/short_groups"] == 1


@pytest.mark.parametrize("keys, spec", [
    ({"gfpo_keep": 2, "gfpo_metric": "shortest"}, {"name": "gfpo", "keep": 2, "metric": "shortest"}),
    ({"overlong_cache_len": 2, "redit_scale": 0.3}, [{"name": "overlong_penalty", "cache_len": 2},
                                                     {"name": "redit", "scale": 0.3}]),
])
def test_a_key_and_the_stage_it_maps_to_give_the_same_advantages(tmp_path, keys, spec):
    by_keys = trainer_with(tmp_path, **keys)
    rollout, _ = by_keys.collect()
    rollout.rewards["total"] = torch.rand(len(rollout), generator=torch.Generator().manual_seed(0)).round()
    by_stage = trainer_with(tmp_path, stages=spec if isinstance(spec, list) else [spec])
    for t in (by_keys, by_stage):
        t.sample_gen.manual_seed(3)  # ReDit's noise
    adv_keys, _ = by_keys.advantages(rollout)
    adv_stage, _ = by_stage.advantages(rollout)
    assert torch.equal(adv_keys, adv_stage)
    assert not torch.equal(adv_keys, trainer_with(tmp_path).advantages(rollout)[0])


def test_a_stages_state_travels_with_the_checkpoint(tmp_path):
    trainer = trainer_with(tmp_path, stages=[{"name": "prompt_replay", "share": 0.5, "capacity": 8}])
    rollout, _ = trainer.collect()
    replay = trainer.stages.find(stages.PromptReplay)
    replay.push(rollout.contexts[:3])
    trainer.step = 1
    trainer.save()
    resumed = trainer_with(tmp_path, stages=[{"name": "prompt_replay", "share": 0.5, "capacity": 8}])
    resumed.resume()
    assert list(resumed.stages.find(stages.PromptReplay).buffer) == list(replay.buffer)
    # a checkpoint written before the stages keeps its replay buffer and SFT-mix stream under keys of their own
    assert legacy_stage_state({"replay": {"buffer": ["a"]}, "sft_mix_rng": {"s": 1}}) == {
        "prompt_replay": {"buffer": ["a"]}, "sft_mix": {"rng": {"s": 1}}}


@pytest.mark.parametrize("spec, fragment", [
    ([{"name": "nope"}], "algo.stages.0.name: unknown stage 'nope'; registered: "),
    ([{"name": "test_constant", "wieght": 1}], "unknown key 'algo.stages.0.wieght'; valid keys here: weight"),
    ([{"name": "test_constant", "weight": "big"}], "algo.stages.0.weight: expected a number, got 'big'"),
    ([{"name": "redit", "kind": "cauchy"}], "algo.stages.0.kind: invalid value 'cauchy'; valid: gaussian, uniform"),
    ([{"name": "gfpo", "keep": 0}], "algo.stages.0: gfpo keep must be >= 1, got 0 (stage 'gfpo')"),
    ([{"name": "entropy", "weight": 0.1}], "['entropy'] already in the run"),
    (["entropy"], "expected a mapping, got 'entropy'"),
])
def test_a_bad_stage_is_refused_at_load_in_one_line(spec, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"algo.stages={spec!r}".replace("'", '"')])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_stage_in_a_file_of_its_own_plugs_in_from_the_config(tmp_path):
    """`plugins` imports the user's file before the config is checked, so the CLI runs its stage."""
    plugin = tmp_path / "my_shaper.py"
    plugin.write_text(
        "from dataclasses import dataclass\n"
        "from mmrl import stages\n\n\n"
        "@stages.register_stage('test_plugin_halve')\n"
        "@dataclass\n"
        "class Halve(stages.RewardShaper):\n"
        "    def shape(self, rewards, rollout, unit_budget, generator):\n"
        "        return rewards / 2\n")
    cfg = load_config(None, [f"plugins=[{plugin}]", "algo.stages=[{name: test_plugin_halve}]"])
    assert [s.name for s in stages.from_algo(cfg.algo, 1).reward_shapers] == ["test_plugin_halve"]
    load_config(None, [f"plugins=[{plugin}]"])  # imported once: registering again would raise
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"plugins=[{tmp_path / 'missing.py'}]"])
    assert str(e.value).startswith("plugins[0]: cannot import") and "missing.py" in str(e.value)
    with pytest.raises(ConfigError, match=r"plugins\[0\]: cannot import 'no_such_module_xyz'"):
        load_config(None, ["plugins=[no_such_module_xyz]"])


def test_every_registered_component_declares_a_typed_config():
    """Policies, like stages, declare the dataclass of their params; tasks, rewards and estimators
    are checked as the dataclass of their signature, a loss's params by its defaults' types. A value of the wrong type or one the config refuses is one
    line at load, naming the key."""
    import dataclasses

    from mmrl.policies import POLICIES, policy_class

    for name in POLICIES:
        assert dataclasses.is_dataclass(policy_class(name).CONFIG), name
    for override, fragment in [("model.params.min_image_tokens=many", "model.params.min_image_tokens: expected an "
                                "integer, got 'many' (QwenVLPolicy)"),
                               ("model.params.max_image_tokens=0", "model.params.max_image_tokens must be >= 1"),
                               ("task.params.n_train=many", "task.params (task 'vqa'): n_train: expected an integer, "
                                "got 'many'"),
                               ("algo.loss_params.eps_high=wide", "algo.loss_params.eps_high: expected a number"),
                               ("algo.loss_params.agg=sum", "algo.loss_params.agg: invalid value 'sum'; valid: "),
                               ("algo.advantage_params.eps=x", "algo.advantage_params (estimator 'grpo'): eps: "
                                "expected a number, got 'x'")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, ["model.policy=qwen_vl", "task.name=vqa", override])
        assert fragment in str(e.value) and "\n" not in str(e.value)
