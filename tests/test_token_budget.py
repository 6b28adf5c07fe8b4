"""Token-budget micro-batches (train.max_tokens_per_micro): rows packed by length so that no
micro-batch holds more prompt + reply tokens than the budget (padding included), each trimmed to
its own longest prompt and reply, with the gradient of row-count micro-batches."""

import numpy as np
import pytest
import torch

from mmrl.algos import AGG_MODES
from mmrl.rollout import token_budget_batches, unit_spans

torch.set_num_threads(1)


def test_unit_spans():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert unit_spans(mask).tolist() == [2, 3, 0, 4]


def test_packing_keeps_every_row_once_and_every_batch_under_the_budget():
    rng = np.random.default_rng(0)
    sizes = torch.tensor(np.stack([rng.integers(5, 40, 50), rng.integers(1, 60, 50)], 1))
    for budget, max_rows in [(100, 0), (300, 0), (300, 3), (10_000, 0)]:
        batches = token_budget_batches(sizes, budget, max_rows)
        rows = torch.cat(batches)
        assert sorted(rows.tolist()) == list(range(50))
        for b in batches:
            cost = len(b) * int(sizes[b, 0].max() + sizes[b, 1].max())
            assert cost <= budget and (not max_rows or len(b) <= max_rows), (budget, b, cost)
    assert len(token_budget_batches(sizes, 10_000)) == 1
    # Packing by length needs fewer micro-batches than rows of the longest length would.
    assert len(token_budget_batches(sizes, 300)) < 50 * 99 // 300 + 1


def test_a_row_over_the_budget_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"train.max_tokens_per_micro 50 is below one row's 30 prompt \+ 25 reply "
                                         r"tokens; set it to at least 55"):
        token_budget_batches(torch.tensor([[10, 5], [30, 25]]), 50)


def _trainer(tmp_path, agg, **train):
    from test_trainer import build, make_cfg

    cfg = make_cfg(tmp_path, algo={"beta": 0.05, "loss_params": {"agg": agg}},
                   sampling={"group_size": 4, "max_new_tokens": 8, "temperature": 1.5},
                   train={"steps": 1, "recompute_old_logp": True, **train})
    return build(cfg)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_the_gradient_equals_row_count_micro_batches(tmp_path, agg, monkeypatch):
    """The same step with micro-batches of 3 rows and packed by a token budget: equal gradients
    (policy loss, KL to the reference, recomputed old log-probs), while the packed micro-batches
    are really trimmed and stay under the budget."""
    from test_trainer import grads

    by_rows = _trainer(tmp_path / "rows", agg, micro_batch_size=3)
    by_rows.train_step()
    packed = _trainer(tmp_path / "tokens", agg, max_tokens_per_micro=48)
    seen = []
    micro_part = packed.updater.micro_part

    def spy(rollout, rows):
        part = micro_part(rollout, rows)
        seen.append((len(part), part.extras["prompt_ids"].shape[1], part.units.shape[1],
                     rollout.extras["prompt_ids"].shape[1], rollout.units.shape[1]))
        return part

    monkeypatch.setattr(packed.updater, "micro_part", spy)
    packed.train_step()
    assert seen and all(n * (p + t) <= 48 for n, p, t, _, _ in seen), seen
    assert any(p < P or t < T for _, p, t, P, T in seen), seen  # some padding was cut
    assert len({n for n, *_ in seen}) > 1, seen  # short rows share a micro-batch, long ones do not
    a, b = grads(by_rows), grads(packed)
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-7, rtol=1e-4)


def test_qwen_vl_trimmed_rows_score_the_same():
    """A Qwen-VL micro-batch without its shared padding (prompt columns, reply tail, and the
    mm_token_type_ids with them) gives each row the log-probs it had in the whole batch."""
    from mmrl.policies.qwen_vl import QwenVLPolicy
    from mmrl.tiny import build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer

    tok = build_tokenizer(["how many red objects are there in the picture move the dot"], vocab_size=300)
    model = build_tiny_qwen_vl(tok, "qwen2_5_vl", seed=0)
    policy = QwenVLPolicy(model, build_qwen_vl_processor(tok, "qwen2_5_vl", 4, 4), temperature=1.0,
                          max_new_tokens=10)
    rng = np.random.default_rng(0)
    contexts = [{"frame": rng.integers(0, 256, (56, 56, 3), dtype=np.uint8), "prompt": p}
                for p in ("how many red objects are there in the picture", "move")]
    rollout = policy.sample(contexts, 3, generator=torch.Generator().manual_seed(1))
    whole, _ = policy.logprobs(rollout)
    rows = torch.tensor([3, 4, 5])  # the short prompt's rows
    part = policy.trim_padding(rollout.select(rows))
    assert part.extras["prompt_ids"].shape[1] < rollout.extras["prompt_ids"].shape[1]
    assert part.extras["mm_token_type_ids"].shape == part.extras["prompt_ids"].shape
    logp, _ = policy.logprobs(part)
    T = part.units.shape[1]
    torch.testing.assert_close(torch.where(part.mask, logp, 0.0), torch.where(part.mask, whole[rows, :T], 0.0),
                               atol=1e-5, rtol=1e-5)


def test_the_key_is_checked_at_load():
    from mmrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"train.max_tokens_per_micro must be >= 0"):
        load_config("configs/digit_sort_grpo.yaml", ["train.max_tokens_per_micro=-1"])
    with pytest.raises(ConfigError, match=r"train.max_tokens_per_micro: model.policy 'visual_planner' does not pack"):
        load_config("configs/vprl_frozenlake_grpo.yaml", ["train.max_tokens_per_micro=512"])
    assert load_config("configs/vqa_grpo.yaml", ["train.max_tokens_per_micro=512"]).train.max_tokens_per_micro == 512


def test_fsdp_ranks_get_the_same_number_of_micro_batches():
    """Under FSDP a rank with fewer packed micro-batches splits its largest until it has as many as
    the rank with the most (FSDP's collectives run once per forward on every rank)."""
    from mmrl.update import split_largest

    batches = [torch.arange(0, 5), torch.arange(5, 7), torch.arange(7, 8)]
    out = split_largest(batches, 5)
    assert len(out) == 5 and sorted(torch.cat(out).tolist()) == list(range(8)) and min(map(len, out)) >= 1
