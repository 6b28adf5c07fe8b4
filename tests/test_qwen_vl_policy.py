"""The Qwen-VL policy adapter on tiny models: sampled log-probs equal teacher-forced ones (left
padding, images of different sizes, mRoPE), vision tokens are never sampled, rollouts slice and
micro-batch without changing anything, checkpoints round-trip, and VPRL's text mode trains."""

import json
import math
import sys

import numpy as np
import pytest
import torch

from mmrl.config import load_config
from mmrl.envs import make_task
from mmrl.envs.planning.frozenlake import from_text
from mmrl.envs.planning.minibehavior import make_layout
from mmrl.policies import build_policy
from mmrl.policies.fast_decode import FastDecoder, _rotate
from mmrl.policies.qwen_vl import QwenVLPolicy, rope_positions, vision_inputs
from mmrl.rewards import REWARDS, get_reward, register_reward
from mmrl.envs.planning.text_plan import parse_actions
from mmrl.rollout import Rollout
from mmrl.tiny import QWEN_VL_ARCHS, build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer
from mmrl.trainer import Trainer

torch.set_num_threads(1)

CONFIG = "configs/vprl_frozenlake_text_grpo.yaml"

if "test_vl_text_length" not in REWARDS:

    @register_reward("test_vl_text_length")
    def _text_length(contexts, outputs, **_):
        """A reward with spread on random weights, so GRPO advantages (and gradients) are non-zero."""
        return torch.tensor([float(len(o) % 5) for o in outputs])


def _contexts() -> list[dict]:
    rng = np.random.default_rng(0)
    img = lambda h, w: rng.integers(0, 256, (h, w, 3), dtype=np.uint8)  # noqa: E731
    return [
        {"frame": img(56, 56), "prompt": "go up", "target": "up"},  # 4 image tokens
        {"frame": img(112, 84), "prompt": "the agent goes left then right and up", "target": "left right"},  # 12
        {"frame": [img(56, 84), img(84, 56)], "prompt": "two images", "target": "down"},  # 2 images
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["go up down left right", "the agent goes left then right", "two images",
                            "user assistant"], vocab_size=300)


@pytest.fixture(scope="module")
def vl(tokenizer):
    """arch -> (model, processor), built once per module."""
    cache = {}

    def get(arch: str = "qwen2_5_vl"):
        if arch not in cache:
            cache[arch] = (build_tiny_qwen_vl(tokenizer, arch, seed=0).eval(), build_qwen_vl_processor(tokenizer, arch))
        return cache[arch]

    return get


def _max_diff(rollout: Rollout, logp: torch.Tensor) -> float:
    return torch.where(rollout.mask, logp - rollout.logp_old, 0.0).abs().max().item()


@pytest.mark.parametrize("arch", QWEN_VL_ARCHS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_teacher_forcing(vl, arch, temperature):
    policy = QwenVLPolicy(*vl(arch), temperature=temperature, max_new_tokens=10)
    rollout = policy.sample(_contexts(), 3, generator=torch.Generator().manual_seed(1))
    assert (rollout.extras["prompt_mask"] == 0).any(), "prompts of different lengths: left padding is exercised"
    grids = {tuple(g[0].tolist()) for g in rollout.extras["image_grid_thw"]}
    assert len(grids) >= 3, grids  # images of different sizes in one batch
    assert rollout.extras["pixel_values"][0] is rollout.extras["pixel_values"][2], "a group shares its image"
    with torch.no_grad():
        logp, entropy = policy.logprobs(rollout, with_entropy=True)
    assert rollout.mask.any()
    assert _max_diff(rollout, logp) < 1e-5
    assert torch.isfinite(entropy[rollout.mask]).all() and (entropy[rollout.mask] >= 0).all()


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "views"])
@pytest.mark.parametrize("arch", QWEN_VL_ARCHS)
def test_lean_and_hf_decoding_draw_the_same_tokens(vl, arch, fuse, monkeypatch):
    """After the HF prefill (vision + prompt), the lean static-cache decoder and the HF forward
    draw the same tokens with the same log-probs from one generator (a text-only row included)."""
    model, processor = vl(arch)
    if not fuse:  # the model's own weights through views, as layers above FUSE_MAX_LAYER_PARAMS get
        monkeypatch.setattr(FastDecoder, "FUSE_MAX_LAYER_PARAMS", 0)
    lean, hf = QwenVLPolicy(model, processor, max_new_tokens=10), QwenVLPolicy(model, processor, max_new_tokens=10,
                                                                               fast_decode=False)
    assert lean._fast is not None and hf._fast is None and lean._fast.fuse == fuse
    contexts = _contexts() + [{"frame": None, "prompt": "no image here"}]
    for temperature in (1.0, 0.7):
        a, b = (p.sample(contexts, 3, generator=torch.Generator().manual_seed(7), temperature=temperature)
                for p in (lean, hf))
        assert torch.equal(a.units, b.units) and torch.equal(a.mask, b.mask)
        assert torch.allclose(a.logp_old, b.logp_old, atol=1e-5), (a.logp_old - b.logp_old).abs().max()


@pytest.mark.parametrize("arch", QWEN_VL_ARCHS)
def test_lean_rope_is_the_models_mrope_on_text(vl, arch):
    """With the same position on the t/h/w axes (a text token), the model's mRoPE rotation is the
    lean decoder's: plain RoPE at that position with the model's rope_theta."""
    model, _ = vl(arch)
    fast = FastDecoder.maybe(model)
    text = model.model.language_model
    rope = text.config.rope_parameters
    pos = torch.tensor([[0, 1, 17, 300], [5, 6, 7, 1000]])
    q = torch.randn(2, 4, pos.shape[1], fast.head_dim, generator=torch.Generator().manual_seed(0))
    cos3, sin3 = text.rotary_emb(q, pos.expand(3, *pos.shape))
    hf_module = sys.modules[type(model).__module__]
    if cos3.dim() == 3:  # the rotary module merged the mRoPE sections itself (Qwen3-VL; all from transformers 5.2x)
        want, _ = hf_module.apply_rotary_pos_emb(q, q, cos3, sin3)
    else:  # [3, B, S, D]: the attention merges them (Qwen2(.5)-VL up to transformers 5.1x)
        want, _ = hf_module.apply_multimodal_rotary_pos_emb(q, q, cos3, sin3, rope["mrope_section"])
    got = _rotate(q, *fast.rope(pos))
    assert (got - want).abs().max().item() < 1e-5
    inv_freq = rope["rope_theta"] ** -(torch.arange(0, fast.head_dim, 2).float() / fast.head_dim)
    angles = (pos[..., None].float() * inv_freq).repeat(1, 1, 2)[:, None]  # [B, 1, S, D]
    plain = q * angles.cos() + torch.cat([-q[..., fast.head_dim // 2:], q[..., :fast.head_dim // 2]], -1) * angles.sin()
    assert (got - plain).abs().max().item() < 1e-4  # float32 angles up to 1000 rad


def test_lean_decoding_falls_back_under_lora(vl):
    """LoRA wraps the projections (their weights are not `.weight` alone): the HF forward decodes."""
    from peft import LoraConfig, get_peft_model

    model, processor = build_tiny_qwen_vl(vl()[1].tokenizer, "qwen2_5_vl", seed=0), vl()[1]
    assert FastDecoder.maybe(model) is not None
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert FastDecoder.maybe(lora) is None and FastDecoder.maybe(lora.get_base_model()) is None
    policy = QwenVLPolicy(lora, processor, max_new_tokens=6)
    assert policy._fast is None
    rollout = policy.sample(_contexts(), 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _max_diff(rollout, policy.logprobs(rollout)[0]) < 1e-5


def test_explicit_positions_are_the_models_own(vl):
    """The 3-D positions passed explicitly equal what the model computes itself from
    mm_token_type_ids (zeros for the completion) over prompt + completion."""
    model, processor = vl()
    policy = QwenVLPolicy(model, processor, max_new_tokens=6)
    r = policy.sample(_contexts(), 2, generator=torch.Generator().manual_seed(0))
    e = r.extras
    ids = torch.cat([e["prompt_ids"], r.units], 1)
    attn = torch.cat([e["prompt_mask"], torch.ones_like(r.units)], 1)
    mm = torch.cat([e["mm_token_type_ids"], torch.zeros_like(r.units)], 1)
    vision = vision_inputs(e["pixel_values"], e["image_grid_thw"])
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=attn, mm_token_type_ids=mm, use_cache=False,
                     position_ids=rope_positions(model, ids, attn, mm, vision["image_grid_thw"]), **vision).logits
        own = model(input_ids=ids, attention_mask=attn, mm_token_type_ids=mm, use_cache=False, **vision).logits
    real = attn.bool()
    assert (ours - own).abs()[real].max().item() < 1e-6


def test_vision_tokens_are_never_sampled(vl):
    model, processor = vl()
    policy = QwenVLPolicy(model, processor, max_new_tokens=8)
    vision_ids = [i for i in policy.suppress_token_ids if i < len(processor.tokenizer)]
    assert len(vision_ids) >= 4

    def favour_vision(module, args, out):  # make the vision tokens the model's top choice
        out = out.clone()
        out[..., vision_ids] += 30.0
        return out

    hook = model.lm_head.register_forward_hook(favour_vision)
    try:
        enc = policy.encode(_contexts())
        with torch.no_grad():
            raw = model(input_ids=enc["prompt_ids"], attention_mask=enc["prompt_mask"],
                        mm_token_type_ids=enc["mm_token_type_ids"],
                        **vision_inputs(enc["pixel_values"], enc["image_grid_thw"])).logits[:, -1]
        assert all(int(t) in vision_ids for t in raw.argmax(-1)), "without suppression they would be drawn"
        rollout = policy.sample(_contexts(), 8, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logp, _ = policy.logprobs(rollout)
    finally:
        hook.remove()
    assert not torch.isin(rollout.units[rollout.mask], torch.tensor(policy.suppress_token_ids)).any()
    assert _max_diff(rollout, logp) < 1e-5


def test_select_and_concat_keep_logprobs(vl):
    policy = QwenVLPolicy(*vl(), max_new_tokens=8)
    a = policy.sample(_contexts(), 3, generator=torch.Generator().manual_seed(2))
    text_only = [_contexts()[0], {"frame": None, "prompt": "no image here"}]
    b = policy.sample(text_only, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = policy.logprobs(a)[0]
        idx = torch.tensor([7, 0, 4])
        part = a.select(idx)
        assert len(part.extras["pixel_values"]) == 3 and part.extras["pixel_values"][1] is a.extras["pixel_values"][0]
        assert (policy.logprobs(part)[0] - full[idx]).abs().max().item() < 1e-6
        both = Rollout.concat([a, b])  # pads T and the prompts; joins the per-sample vision lists
        assert len(both.extras["image_grid_thw"]) == len(both) == len(a) + len(b)
        logp = policy.logprobs(both)[0]
        assert _max_diff(both, logp) < 1e-5
        for window in (slice(0, 2), slice(3, 7)):  # a window of units scores exactly those
            assert torch.allclose(policy.logprobs(both, units=window)[0], logp[:, window], atol=1e-5), window
        moved = a.to("cpu")
        assert moved.extras["pixel_values"][0] is moved.extras["pixel_values"][1]


def _small_cfg(tmp_path, *overrides: str):
    return load_config(CONFIG, [
        "task.params.sizes=[3]", "task.params.n_train=16", "task.params.n_test=4",
        "sampling.group_size=4", "sampling.max_new_tokens=8", "train.prompts_per_step=2", "train.eval_size=4",
        "train.progress=false", "train.threads=0", f"train.output_dir={tmp_path / 'run'}", *overrides])


def _build(cfg) -> Trainer:
    torch.manual_seed(cfg.train.seed)
    task = make_task(cfg.task.name, seed=cfg.train.seed, **cfg.task.params)
    return Trainer(cfg, build_policy(cfg, task, torch.device("cpu")), task)


def test_micro_batching_gives_the_same_gradients(tmp_path):
    def grads(micro: int) -> dict[str, torch.Tensor]:
        cfg = _small_cfg(tmp_path / str(micro), "train.steps=1", f"train.micro_batch_size={micro}",
                         "train.prompts_per_step=3", "rewards=[{name: test_vl_text_length}]")
        trainer = _build(cfg)
        trainer.train_step()
        return {k: p.grad.clone() for k, p in trainer.policy.model.named_parameters() if p.grad is not None}

    whole, split = grads(0), grads(5)  # 12 rows in micro-batches of 5, 5, 2
    assert whole.keys() == split.keys() and any(g.abs().sum() > 0 for g in whole.values())
    assert any("visual" in k for k in whole), "the vision tower is trained too"
    for k in whole:
        assert torch.allclose(whole[k], split[k], atol=1e-7, rtol=1e-4), k


def test_save_and_from_pretrained_round_trip(vl, tmp_path):
    policy = QwenVLPolicy(*vl(), max_new_tokens=8)
    rollout = policy.sample(_contexts(), 2, generator=torch.Generator().manual_seed(4))
    policy.save(tmp_path / "ckpt")
    loaded = QwenVLPolicy.from_pretrained(tmp_path / "ckpt", max_new_tokens=8)
    assert type(loaded.model) is type(policy.model)
    enc_a, enc_b = policy.encode(_contexts()), loaded.encode(_contexts())
    assert torch.equal(enc_a["prompt_ids"], enc_b["prompt_ids"])
    assert all(torch.equal(x, y) for x, y in zip(enc_a["pixel_values"], enc_b["pixel_values"]))
    with torch.no_grad():
        assert torch.equal(policy.logprobs(rollout)[0], loaded.logprobs(rollout)[0])
    again = loaded.sample(_contexts(), 2, generator=torch.Generator().manual_seed(4))
    assert torch.equal(again.units, rollout.units)


def test_text_mode_trains_through_the_trainer(tmp_path):
    """VPRL text mode (configs/vprl_frozenlake_text_grpo.yaml), SFT 2 + GRPO 2 steps."""
    cfg = _small_cfg(tmp_path, "sft.steps=2", "sft.batch_size=4", "train.steps=2", "train.eval_every=0")
    assert cfg.model.params["target_key"] == "target_actions"
    trainer = _build(cfg)
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    results = trainer.train(resume=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sft = [r["sft/loss"] for r in rows if "sft/loss" in r]
    steps = [r for r in rows if "reward/total" in r]
    assert len(sft) == 2 and len(steps) == 2
    for r in steps:
        for k in ("reward/vprl_text_plan", "train/loss", "train/grad_norm", "train/entropy"):
            assert math.isfinite(r[k]), (k, r[k])
        assert -5.0 <= r["reward/total"] <= 3.0  # 3x3 maps: at most 4 progress steps, at least -5
    after = results["eval_after"]
    assert 0.0 <= after["eval/exact_match"] <= 1.0 and math.isfinite(after["eval/vprl_text_plan"])
    changed = [k for k, v in trainer.policy.model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("visual" in k for k in changed) and any("language_model" in k for k in changed)
    loaded = QwenVLPolicy.from_pretrained(tmp_path / "run" / "final")  # the exported final model loads back
    assert loaded.decode(loaded.sample(trainer.task.eval_batch(1), 1, temperature=0.0)) is not None


# ---------------------------------------------------------------- the text-mode reward


def _reward(contexts, outputs, **params) -> list[float]:
    return get_reward("vprl_text_plan")(contexts, outputs, **params).tolist()


def test_parse_actions_is_lenient_on_case_and_punctuation():
    assert parse_actions("Right, RIGHT. down;\nDown!") == [2, 2, 1, 1]
    assert parse_actions("pick drop") == [4, 5]
    assert parse_actions("") is None and parse_actions("...") is None
    assert parse_actions("go right") is None and parse_actions("right 2") is None  # strict by default
    assert parse_actions("go right", strict=False) == [2]


def test_vprl_text_plan_reward_on_frozenlake():
    lay = from_text(["SFF",
                     "FHF",
                     "FFG"])
    ctx = {"layout": lay, "state": lay.start_state()}
    cases = {
        "right right down down": 4.0,  # 4 progress steps to the goal
        "Down, down. Right right": 4.0,  # the other optimal route, any case / punctuation
        "right": 1.0,  # valid progress, goal not reached yet
        "right left": 1.0,  # +1, then 0 for a valid step away from the goal
        "right left up": -4.0,  # +1, 0, then -5 for bumping into the border
        "right down": -4.0,  # +1, then -5 for the hole
        "right right down down up": 4.0,  # steps after the goal are not scored
        "left": -5.0,  # off the grid: the state does not change
        "pick": -5.0,  # not a FrozenLake action
        "hello": -5.0, "": -5.0, "right 3": -5.0,  # unparseable
    }
    got = _reward([ctx] * len(cases), list(cases))
    assert got == list(cases.values()), dict(zip(cases, got))
    mean = _reward([ctx] * 3, ["right left", "right right down down", "nope"], reduce="mean")
    assert mean == [0.5, 1.0, -5.0]
    mid = {"layout": lay, "state": np.array([0, 2, 0, -1, -1])}  # from a later state of the map
    assert _reward([mid], ["down down"]) == [2.0]
    assert _reward([ctx], ["right right down down"], max_steps=2) == [2.0]


def test_vprl_text_plan_reward_on_minibehavior():
    # 3x3 room (interior coordinates): agent at (0, 0), printer at (0, 2), table at (2, 2).
    lay = make_layout(3, start=(0, 0), printer=(0, 2), table=[(2, 2)])
    ctx = {"layout": lay, "state": lay.start_state()}
    assert lay.optimal_length == 5
    got = _reward([ctx] * 4, ["right pick right down drop", "pick", "right pick right down down", "right drop"])
    # the full plan; a pick away from the printer; 4 steps then into the table; a drop while not carrying
    assert got == [5.0, -5.0, -1.0, -4.0]


def test_bad_contexts_and_settings_name_the_problem(vl):
    model, processor = vl()
    policy = QwenVLPolicy(model, processor, image_key="image")
    with pytest.raises(KeyError, match="'image'.*model.params.image_key"):
        policy.encode(_contexts())
    bad = [{"frame": np.zeros((56, 56), np.uint8), "prompt": "x"}]
    with pytest.raises(ValueError, match="uint8 HxWx3"):
        QwenVLPolicy(model, processor).encode(bad)
    with pytest.raises(ValueError, match="min_image_tokens"):
        QwenVLPolicy(model, processor, min_image_tokens=20, max_image_tokens=10)
    # explicit token bounds resize every image into them; a text-only context needs no image
    sized = QwenVLPolicy(model, processor, min_image_tokens=6, max_image_tokens=9)
    enc = sized.encode(_contexts() + [{"frame": None, "prompt": "no image"}])
    tokens = [int(g.prod(-1).sum()) // 4 for g in enc["image_grid_thw"][:2]]
    assert all(6 <= t <= 9 for t in tokens) and enc["image_grid_thw"][3].numel() == 0
