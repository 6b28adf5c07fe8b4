"""Loss terms as registered stages (mmrl.loss_terms): today's keys become the built-in terms in the
loss's order, a new term is one registered dataclass that a config names, and a bad term spec is
refused at load in one line."""

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mmrl import loss_terms
from mmrl.config import ConfigError, config_from_dict, load_config
from mmrl.distributed import SINGLE

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
from dist_worker import build, make_cfg  # noqa: E402

if "test_constant" not in loss_terms.LOSS_TERMS:

    @loss_terms.register_loss_term("test_constant")
    @dataclass(frozen=True)
    class Constant(loss_terms.LossTerm):
        """`weight` x 1 per unit: its aggregate is 1 over an optimizer step, and it has no gradient."""

        weight: float = 0.0

        @property
        def coef(self) -> float:
            return self.weight

        @property
        def score(self) -> str:
            return "logp"

        def per_unit(self, x: loss_terms.TermInputs) -> torch.Tensor:
            return torch.ones_like(x.scores["logp"]).detach()


def test_todays_keys_are_the_built_in_terms_in_the_losss_order():
    algo = load_config(None, ["algo.beta=0.04", "algo.entropy_coef=0.01", "algo.papo_gamma=0.02",
                              "algo.papo_entropy=[0.03, 0.05]"]).algo
    terms = loss_terms.from_algo(algo)
    assert [t.name for t in terms] == ["kl_ref", "entropy", "perception_kl", "entropy_masked"]
    assert [t.coef for t in terms] == [0.04, pytest.approx(0.03 - 0.01), -0.02, 0.05]
    assert [t.score for t in terms] == ["logp", "entropy", "logp_masked", "entropy_masked"]
    assert loss_terms.KLToReference(beta=0.1, kind="gaussian").score == "kl_ref"  # the policy scores it


def test_a_new_term_is_one_registered_class_a_config_names(tmp_path):
    """The term's aggregate over a step is 1 and it has no gradient: the logged loss rises by its
    weight exactly and the weights after the step are those of the run without it."""
    results = {}
    for weight in (0.0, 0.25):
        cfg = make_cfg(str(tmp_path / "run")).to_dict()
        cfg["algo"]["loss_terms"] = [{"name": "test_constant", "weight": weight}] if weight else []
        trainer = build(config_from_dict(cfg), SINGLE)
        rollout, _ = trainer.collect()
        metrics = trainer.update(rollout)
        results[weight] = metrics, [p.detach().clone() for p in trainer.policy.model.parameters()]
    (base, w0), (added, w1) = results[0.0], results[0.25]
    assert added["train/test_constant"] == pytest.approx(1.0)
    assert added["train/loss"] == pytest.approx(base["train/loss"] + 0.25, abs=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


@pytest.mark.parametrize("terms, fragment", [
    ([{"name": "nope"}], "algo.loss_terms.0.name: unknown loss term 'nope'; registered: "),
    ([{"name": "test_constant", "wieght": 1}], "has no field ['wieght']; its fields: ['weight']"),
    ([{"name": "test_constant", "weight": "big"}], "algo.loss_terms.0.weight: 'big' is not a float"),
    ([{"name": "entropy", "weight": 0.1}], "['entropy'] already in the loss"),
    (["entropy"], "expected a mapping, got 'entropy'"),
])
def test_a_bad_term_is_refused_at_load_in_one_line(terms, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"algo.loss_terms={terms!r}".replace("'", '"')])
    assert fragment in str(e.value) and "\n" not in str(e.value)
