"""Vision-language-action policies, split as lerobot's are:

- `configuration`: the typed `model.params` of each backbone (`ActionTokenVLAConfig`,
  `SmolVLAConfig`, `DiffusionPolicyConfig`: each adapter's `CONFIG`, with defaults, types and value checks) and the
  constants (action-token modes, the default prompt, the saved-config file names);
- `processor`: what turns data into model inputs and back, shared by every backbone (action bins and
  `<act_i>` tokens, camera images of an observation batch, the one SFT-context parser, the acted
  chunks of a rollout window, the decoded episodes the rewards read, the tiny tokenizer's corpus);
- `lerobot_policy`: what the adapters of lerobot's generative action heads share (building and
  loading a lerobot policy with its processors offline; episodes, decoding and saving of a policy
  whose units are denoising steps);
- `modeling_<name>`: one policy adapter per backbone: `modeling_action_tokens`
  (`ActionTokenVLAPolicy`, OpenVLA-style action tokens on Qwen-VL, policy name `action_vla`),
  `modeling_smolvla` (`SmolVLAPolicy`, lerobot's SmolVLA with a flow-matching expert, `smolvla`),
  `modeling_diffusion` (`DiffusionActionPolicy`, lerobot's Diffusion Policy trained with DPPO,
  `diffusion`).

Every backbone rolls out with the episode runner of `mmrl.episodes`, in its task's env factory.

A new backbone (pi0-style, another OpenVLA) is a new `modeling_<name>.py` with a policy class
(`from_config`, `sample`, `logprobs`, `decode`, `sft_loss`, `save`; see `mmrl.policies.base`) that
reads its settings from a new dataclass in `configuration` and its data through `processor`; then
register it in `mmrl.policies.POLICIES` as `"<name>": "mmrl.policies.vla.modeling_<name>:<Class>"`.

Nothing is imported here: a modeling module pulls in torch / transformers / lerobot, so import it
(or let `mmrl.policies.policy_class` do it) only when it is used.
"""
