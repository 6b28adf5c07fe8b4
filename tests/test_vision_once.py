"""Vision once per image: the Qwen-VL policy's teacher-forced forward encodes each distinct image of
a micro-batch once (the G replies of a prompt share it) and copies its features to the rows that use
it; log-probs and gradients (vision tower included) equal those of the per-row HF forward, which
encodes every row's image again."""

import numpy as np
import pytest
import torch

from mmrl.hf_compat import checkpointing_on
from mmrl.policies.base import repeat_rows
from mmrl.policies.qwen_vl import QwenVLPolicy, rope_owner, distinct_images
from mmrl.tiny import QWEN_VL_ARCHS, build_qwen_vl_processor, build_tiny_qwen_vl, build_tokenizer

torch.set_num_threads(1)

G = 3  # replies per prompt


def _contexts() -> list[dict]:
    rng = np.random.default_rng(0)
    img = lambda h, w: rng.integers(0, 256, (h, w, 3), dtype=np.uint8)  # noqa: E731
    return [
        {"frame": img(56, 56), "prompt": "go up"},
        {"frame": img(112, 84), "prompt": "the agent goes left then right and up"},
        {"frame": None, "prompt": "no image here"},  # a text-only row
        {"frame": [img(56, 84), img(84, 56)], "prompt": "two images"},
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["go up down left right", "the agent goes left then right", "two images",
                            "no image here", "user assistant"], vocab_size=300)


@pytest.fixture(scope="module")
def processors(tokenizer):
    return {arch: build_qwen_vl_processor(tokenizer, arch) for arch in QWEN_VL_ARCHS}


def _policy(processors, arch: str, lora: bool = False) -> QwenVLPolicy:
    model = build_tiny_qwen_vl(processors[arch].tokenizer, arch, seed=0)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for p in model.parameters():  # the base weights too: every gradient is compared
            p.requires_grad_(True)
    return QwenVLPolicy(model, processors[arch], temperature=0.7)


def _batch(policy: QwenVLPolicy, T: int = 5):
    """Rows = prompts x G, as `sample` makes them (a group's rows share its vision tensors), and
    random completions of text tokens."""
    extras = repeat_rows(policy.encode(_contexts()), G)
    allowed = torch.tensor([i for i in range(len(policy.tokenizer)) if i not in set(policy.suppress_token_ids)])
    units = allowed[torch.randint(0, len(allowed), (len(extras["prompt_ids"]), T),
                                  generator=torch.Generator().manual_seed(0))]
    return extras, units


def _per_row_logprobs(policy: QwenVLPolicy, model, extras, units):
    """The reference: the policy's fallback where the vision-once pieces are missing, the HF forward
    on the rows' joined pixel_values (each row's images encoded)."""
    policy.vision_once = False
    try:
        return policy._token_logprobs(model, extras, units, True)
    finally:
        policy.vision_once = True


class _VisionSpy:
    """Counts the vision tower's forward calls and the patches they see."""

    def __init__(self, model):
        self.calls, self.patches = 0, 0
        self.handle = rope_owner(model).visual.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1
        self.patches += args[0].shape[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _grads(policy, fn, extras, units) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = policy.model
    model.zero_grad(set_to_none=True)
    logp, ent = fn(extras, units)
    w = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)
    ((logp * w).sum() + 0.3 * ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


def _compare(policy, extras, units):
    ours = lambda e, u: policy._token_logprobs(policy.model, e, u, True)  # noqa: E731
    ref = lambda e, u: _per_row_logprobs(policy, policy.model, e, u)  # noqa: E731
    with _VisionSpy(policy.model) as spy_ours:
        logp, grads = _grads(policy, ours, extras, units)
    with _VisionSpy(policy.model) as spy_ref:
        ref_logp, ref_grads = _grads(policy, ref, extras, units)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    assert any("visual" in n for n in grads), "the vision tower is trained"
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)
    return spy_ours, spy_ref


@pytest.mark.parametrize("arch", QWEN_VL_ARCHS)
def test_logprobs_and_gradients_equal_the_per_row_forward(processors, arch):
    """Vision once equals the model's own forward (the fallback), in values and gradients."""
    policy = _policy(processors, arch)
    assert policy.vision_once  # the installed transformers has what it calls
    policy.model.train()
    extras, units = _batch(policy)
    spy, ref = _compare(policy, extras, units)
    # The tower runs once per pass, on each distinct image once: G times fewer patches.
    patches = sum(int(g.prod(-1).sum()) for g in policy.encode(_contexts())["image_grid_thw"])
    assert (spy.calls, spy.patches) == (1, patches)
    assert (ref.calls, ref.patches) == (1, G * patches)


def test_lora_and_gradient_checkpointing(processors):
    policy = _policy(processors, "qwen2_5_vl", lora=True)
    policy.enable_gradient_checkpointing()
    policy.model.train()
    assert checkpointing_on(policy.model.get_base_model())
    extras, units = _batch(policy)
    spy, _ = _compare(policy, extras, units)
    assert spy.patches < sum(p.shape[0] for p in extras["pixel_values"])


def test_duplicates_by_identity_then_equality(processors, monkeypatch):
    """Shared tensors are one image without comparing values; equal copies are found by `torch.equal`
    (one comparison each: fingerprints spare distinct images any); any difference (PAPO's masked
    copies) keeps an image apart."""
    compared = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or equal(a, b))
    policy = _policy(processors, "qwen2_vl")
    enc = policy.encode(_contexts())
    pixels, grids = enc["pixel_values"], repeat_rows(enc["image_grid_thw"], G)
    n_images = sum(len(g) for g in enc["image_grid_thw"])  # 4: the two-image prompt has two
    rows = repeat_rows(pixels, G)
    _, joined_grids, index = distinct_images(rows, grids)
    assert len(joined_grids) == n_images and len(index) == G * n_images
    assert index[:G] == [0] * G  # the first prompt's rows share image 0
    assert not compared, "shared tensors need no comparison"

    copies = [p.clone() for p in rows]  # no sharing left: found equal by value
    assert distinct_images(copies, grids)[2] == index
    assert len(compared) == (G - 1) * n_images

    altered = [p.clone() for p in rows]
    altered[1][0, 0] += 1e-6  # the second row of the first prompt: one value differs
    _, g2, index2 = distinct_images(altered, grids)
    assert len(g2) == n_images + 1 and index2[:G] == [0, 1, 0]  # distinct images in order of first use

    same_size = [torch.rand(16, pixels[0].shape[1]) for _ in range(5)]  # distinct, all one shape
    compared.clear()
    assert distinct_images(same_size, [torch.tensor([[1, 4, 4]])] * 5)[2] == [0, 1, 2, 3, 4]
    assert not compared


def test_masked_images_are_not_merged(processors):
    """PAPO's `mask_images` blacks patches per row: each row's own masked image is encoded, and the
    log-probs and gradients still equal the per-row forward's."""
    from mmrl.rollout import Rollout

    policy = _policy(processors, "qwen2_5_vl")
    policy.model.train()
    extras, units = _batch(policy)
    rollout = Rollout(units=units, logp_old=torch.zeros(units.shape), mask=torch.ones(units.shape, dtype=torch.bool),
                      truncated=torch.zeros(len(units), dtype=torch.bool), max_units=units.shape[1], extras=extras)
    masked = policy.mask_images(rollout, 0.5, torch.Generator().manual_seed(0)).extras
    spy, ref = _compare(policy, masked, units)
    assert spy.patches == ref.patches  # every image row masked differently: nothing to share
    same = policy.mask_images(rollout, 0.0, torch.Generator().manual_seed(0)).extras  # unmasked copies
    with torch.no_grad(), _VisionSpy(policy.model) as spy0:
        logp = policy._token_logprobs(policy.model, same, units, False)[0]
    assert spy0.patches * G == ref.patches
    with torch.no_grad():
        torch.testing.assert_close(logp, policy._token_logprobs(policy.model, extras, units, False)[0])


def test_text_only_batch(processors):
    policy = _policy(processors, "qwen2_vl")
    text = [{"frame": None, "prompt": "go up"}, {"frame": None, "prompt": "no image here"}]
    extras = repeat_rows(policy.encode(text), G)
    units = torch.full((len(extras["prompt_ids"]), 3), policy.eos_token_ids[0])
    assert distinct_images(extras["pixel_values"], extras["image_grid_thw"]) is None
    with torch.no_grad(), _VisionSpy(policy.model) as spy:
        logp = policy._token_logprobs(policy.model, extras, units, False)[0]
        torch.testing.assert_close(logp, _per_row_logprobs(policy, policy.model, extras, units)[0])
    assert spy.calls == 0
