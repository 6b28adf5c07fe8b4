"""A conv-net + spatial soft-argmax vision tower for the action-token VLA (`model.params.vision:
conv_keypoints`), a drop-in replacement for the Qwen-VL vision tower (`model.visual`).

Why: on random object layouts the tiny VLA's ViT-patch tower does not learn object positions on a
CPU budget (docs/vla_experiments.md). Robot learning gets positions from pixels with a small conv
net ending in spatial soft-argmax keypoints (Levine et al. 2016, "End-to-End Training of Deep
Visuomotor Policies"; robomimic's visual BC) and random-shift augmentation (DrQ, Kostrikov et al.
2020). Each keypoint is an expected (x, y) in [-1, 1] under a softmax heatmap, so position is an
explicit number the language model reads instead of something to infer from patch embeddings.

Interface (what `Qwen2_5_VLModel.get_image_features` expects of `self.visual`, transformers 5.5):
`visual(pixel_values, grid_thw=image_grid_thw)` takes the processor's flat patches
[n_patches, C * temporal_patch * patch * patch] of all images and returns an output whose
`pooler_output` holds grid_t * grid_h * grid_w / merge**2 embeddings per image (the number of
`<|image_pad|>` placeholders the processor inserted), in image order; `visual.dtype` and
`visual.spatial_merge_size` are read too. Qwen3-VL also reads `deepstack_features` (here none).

The encoder rebuilds each image from its patches (`patches_to_images`, the inverse of
`Qwen2VLImageProcessor`'s patch layout), so it sees the processor's resized, normalised image.

Tokens: one token per keypoint, so the number of keypoints K is the image's placeholder count,
fixed when the encoder is built (`image_token_count` of the camera size). An image that gets another
count (another size) is an error, not silently padded or cut.

Instruction conditioning (`film_dim` > 0): each conv block's normalised features are scaled and
shifted per channel by a linear map of a conditioning vector (FiLM, Perez et al. 2018, as RT-1
conditions its EfficientNet on the instruction), zero-initialised so a new tower starts unconditioned.
The policy passes one vector per image (its prompt's mean token embedding) inside
`encoder.conditioned(...)`; a FiLM tower called outside that block is an error. Without it the
keypoints must serve every instruction at once: on random layouts a tower trained with the
auxiliary action loss, which sees no instruction, learned to reach for the nearest ball
(docs/vla_experiments.md).

Augmentation: `random_shift` (DrQ) runs only inside `encoder.augmenting(...)`, which the policy's
`sft_loss` opens, and only in train mode. Not on `self.training` alone: the trainer puts the model
in train mode for RL updates too, and there the teacher-forced log-probs must equal the sampler's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling


# ----------------------------------------------------------------------------- patches <-> images


def patches_to_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch_size: int,
                      temporal_patch_size: int, merge_size: int) -> list[torch.Tensor]:
    """The images [C, H, W] that `Qwen2VLImageProcessor` cut into `pixel_values`.

    The processor views each (normalised, resized) image stack as
    [t, tp, C, gh/m, m, p, gw/m, m, p] and permutes it to rows [t, gh/m, gw/m, m, m] of
    [C, tp, p, p]: patches come in merge-size blocks (the m x m patches of one LM token are
    adjacent rows), and each row is channel-major over the temporal patch. A still image is
    repeated over the temporal patch; its first frame is returned."""
    images, start = [], 0
    for t, gh, gw in grid_thw.tolist():
        if t != 1:
            raise ValueError(f"conv_keypoints encodes still images (grid_t 1), got a grid of {t} frames")
        n = gh * gw
        x = pixel_values[start:start + n]
        start += n
        channels = x.shape[1] // (temporal_patch_size * patch_size ** 2)
        m, p = merge_size, patch_size
        x = x.reshape(gh // m, gw // m, m, m, channels, temporal_patch_size, p, p)
        # -> [tp, C, gh/m, m, p, gw/m, m, p]: rows of blocks, rows inside a block, pixels in a patch.
        x = x.permute(5, 4, 0, 2, 6, 1, 3, 7).reshape(temporal_patch_size, channels, gh * p, gw * p)
        images.append(x[0])
    if start != pixel_values.shape[0]:
        raise ValueError(f"grid_thw covers {start} patches, pixel_values has {pixel_values.shape[0]}")
    return images


def image_token_count(image_processor: Any, height: int, width: int, min_tokens: int | None = None,
                      max_tokens: int | None = None) -> int:
    """Placeholder tokens the processor gives a `height` x `width` image (its resize rule,
    `smart_resize`, with the policy's min/max image tokens where given)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    factor = image_processor.patch_size * image_processor.merge_size
    size = image_processor.size
    min_pixels = size["shortest_edge"] if min_tokens is None else min_tokens * factor ** 2
    max_pixels = size["longest_edge"] if max_tokens is None else max_tokens * factor ** 2
    h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // factor) * (w // factor)


# ----------------------------------------------------------------------------- augmentation


def random_shift(images: torch.Tensor, pad: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """DrQ's random shift: pad [B, C, H, W] by `pad` pixels (replicating the border), then crop each
    image back to H x W at its own random offset in [0, 2 * pad] (a shift of up to `pad` pixels)."""
    if pad <= 0:
        return images
    B, _, H, W = images.shape
    padded = F.pad(images, (pad, pad, pad, pad), mode="replicate")
    device = generator.device if generator is not None else torch.device("cpu")
    offsets = torch.randint(0, 2 * pad + 1, (B, 2), generator=generator, device=device).tolist()
    return torch.stack([padded[i, :, dy:dy + H, dx:dx + W] for i, (dy, dx) in enumerate(offsets)])


# ----------------------------------------------------------------------------- soft-argmax


def spatial_soft_argmax(heatmaps: torch.Tensor, temperature: torch.Tensor | float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected (x, y) in [-1, 1] ([B, K, 2]; pixel centres from -1 at the left/top to 1 at the
    right/bottom) under softmax(heatmap / temperature) over H*W, and those softmax weights [B, K, H*W]."""
    B, K, H, W = heatmaps.shape
    attn = (heatmaps.flatten(2).float() / temperature).softmax(-1)
    ys = torch.linspace(-1.0, 1.0, H, device=heatmaps.device)
    xs = torch.linspace(-1.0, 1.0, W, device=heatmaps.device)
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    coords = torch.stack([grid_x.flatten(), grid_y.flatten()], -1)  # [H*W, 2] as (x, y)
    return attn @ coords, attn


# ----------------------------------------------------------------------------- the encoder


@dataclass
class ConvKeypointsOutput(BaseModelOutputWithPooling):
    """`pooler_output`: the LM embeddings [images * K, hidden]; `keypoints`: (x, y) [images, K, 2]."""

    keypoints: torch.Tensor | None = None
    # Qwen3-VL adds these to its first LM layers; a conv tower has none (an empty list adds nothing).
    deepstack_features: list[torch.Tensor] | None = None


def _conv(cin: int, cout: int, stride: int, groups: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.GroupNorm(groups, cout), nn.ReLU())


class ConvKeypointsEncoder(nn.Module):
    """conv (stride 2) -> conv -> conv -> 1x1 conv to K heatmaps -> spatial soft-argmax; each keypoint's
    [x, y, softmax-weighted mean feature] is projected linearly to the LM's hidden size, one LM token
    per keypoint (K = the image's placeholder count)."""

    def __init__(self, out_hidden_size: int, n_keypoints: int, *, patch_size: int, temporal_patch_size: int,
                 spatial_merge_size: int, channels: int = 32, in_channels: int = 3, augment_pad: int = 0,
                 aux_dim: int = 0, film_dim: int = 0):
        super().__init__()
        if n_keypoints < 1:
            raise ValueError(f"n_keypoints must be >= 1, got {n_keypoints}")
        self.n_keypoints = n_keypoints
        self.patch_size, self.temporal_patch_size = patch_size, temporal_patch_size
        self.spatial_merge_size = spatial_merge_size  # read by get_image_features to split per image
        self.augment_pad = augment_pad
        groups = 8 if channels % 8 == 0 else 1
        # Feature maps at 1/2 resolution: a 56 px image gives 28 x 28 soft-argmax positions.
        self.convs = nn.Sequential(_conv(in_channels, channels, 2, groups), _conv(channels, channels, 1, groups),
                                   _conv(channels, channels, 1, groups))
        self.to_heatmaps = nn.Conv2d(channels, n_keypoints, 1)
        # FiLM: (scale, shift) per channel of each conv block from the conditioning vector; zeros at
        # init, so the conditioned tower starts as the unconditioned one.
        self.film = None
        if film_dim > 0:
            self.film = nn.Linear(film_dim, 2 * channels * len(self.convs))
            nn.init.zeros_(self.film.weight)
            nn.init.zeros_(self.film.bias)
        self._cond: torch.Tensor | None = None
        # Learnable softmax temperature (as log, so it stays positive), robomimic's SpatialSoftmax.
        self.log_temperature = nn.Parameter(torch.zeros(()))
        self.proj = nn.Linear(2 + channels, out_hidden_size)
        # Optional: an MLP from one image's K tokens to `aux_dim` numbers (the policy's auxiliary
        # action regression in SFT), a direct gradient path from the actions to the tower.
        self.aux_head = None
        if aux_dim > 0:
            self.aux_head = nn.Sequential(nn.Linear(n_keypoints * out_hidden_size, 128), nn.ReLU(),
                                          nn.Linear(128, aux_dim))
        # Set only inside `augmenting`: augmentation is opt-in per call, not train mode alone.
        self._augment, self._pad = False, augment_pad
        self._generator: torch.Generator | None = None

    @property
    def dtype(self) -> torch.dtype:  # get_image_features casts pixel_values to it
        return self.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj.weight.device

    @contextmanager
    def augmenting(self, generator: torch.Generator | None = None, pad: int | None = None) -> Iterator[None]:
        """Random shifts by up to `pad` px (None: `augment_pad`) inside the block, in train mode only."""
        saved = self._augment, self._generator, self._pad
        self._augment, self._generator, self._pad = True, generator, self.augment_pad if pad is None else pad
        try:
            yield
        finally:
            self._augment, self._generator, self._pad = saved

    @contextmanager
    def conditioned(self, cond: torch.Tensor) -> Iterator[None]:
        """FiLM conditioning [images, film_dim] (one row per image, in the processor's image order)
        for the tower's calls inside the block."""
        if self.film is None:
            raise RuntimeError("this conv_keypoints tower was built without FiLM (film_dim 0)")
        saved, self._cond = self._cond, cond
        try:
            yield
        finally:
            self._cond = saved

    def encode_images(self, images: torch.Tensor, cond: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Images [B, C, H, W] (and FiLM conditioning [B, film_dim]) -> (LM tokens [B, K, hidden],
        keypoints [B, K, 2])."""
        if self._augment and self.training and self._pad > 0:
            images = random_shift(images, self._pad, self._generator)
        if (self.film is None) != (cond is None):
            raise ValueError("a FiLM tower needs its conditioning (call it inside `conditioned`), "
                             "a tower without FiLM takes none")
        film = None if cond is None else self.film(cond.to(images.dtype)).view(len(images), len(self.convs), 2, -1, 1, 1)
        feats = images
        for i, (conv, norm, act) in enumerate(self.convs):
            feats = norm(conv(feats))
            if film is not None:
                feats = feats * (1 + film[:, i, 0]) + film[:, i, 1]
            feats = act(feats)
        keypoints, attn = spatial_soft_argmax(self.to_heatmaps(feats), self.log_temperature.exp())
        # Each keypoint's feature: the feature map averaged under its softmax heatmap.
        point_feats = attn.to(feats.dtype) @ feats.flatten(2).transpose(1, 2)  # [B, K, channels]
        tokens = self.proj(torch.cat([keypoints.to(feats.dtype), point_feats], -1))
        return tokens, keypoints

    def aux_predict(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, n_rows: int) -> torch.Tensor:
        """The auxiliary head's output [n_rows, aux_dim] for `n_rows` rows of equally many images
        (in row order, as the processor flattens them): each image's K tokens through the head,
        averaged over a row's images (cameras)."""
        if self.aux_head is None:
            raise RuntimeError("this conv_keypoints tower was built without an auxiliary head (aux_dim 0)")
        tokens = self(pixel_values, grid_thw).pooler_output
        per_image = self.aux_head(tokens.reshape(-1, tokens.shape[-1] * self.n_keypoints))
        return per_image.view(n_rows, -1, per_image.shape[-1]).mean(1)

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> ConvKeypointsOutput:
        """`hidden_states`: the processor's flat patches of all images; `grid_thw` [images, 3]."""
        m2 = self.spatial_merge_size ** 2
        counts = (grid_thw.prod(-1) // m2).tolist()
        if any(c != self.n_keypoints for c in counts):
            raise ValueError(f"conv_keypoints emits one token per keypoint ({self.n_keypoints}), but the processor "
                             f"gave {counts} image tokens for grids {grid_thw.tolist()}; build it with "
                             "model.params.n_keypoints equal to the camera image's token count")
        images = patches_to_images(hidden_states, grid_thw, self.patch_size, self.temporal_patch_size,
                                   self.spatial_merge_size)
        if self.film is not None and (self._cond is None or len(self._cond) != len(images)):
            got = "none" if self._cond is None else f"{len(self._cond)} rows"
            raise ValueError(f"this FiLM tower needs one conditioning row per image ({len(images)}), got {got}: "
                             "call it inside `conditioned(...)`")
        tokens: list[torch.Tensor | None] = [None] * len(images)
        points: list[torch.Tensor | None] = [None] * len(images)
        # Images of one size go through the convs together (usually all of them).
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, img in enumerate(images):
            by_shape.setdefault(tuple(img.shape), []).append(i)
        for idx in by_shape.values():
            tok, kp = self.encode_images(torch.stack([images[i] for i in idx]),
                                         None if self.film is None else self._cond[idx])
            for j, i in enumerate(idx):
                tokens[i], points[i] = tok[j], kp[j]
        out = torch.cat(tokens)  # type: ignore[arg-type]
        return ConvKeypointsOutput(last_hidden_state=out, pooler_output=out, keypoints=torch.stack(points),
                                   deepstack_features=[])


# ----------------------------------------------------------------------------- installing it


def conv_encoder(model: nn.Module) -> ConvKeypointsEncoder | None:
    """The model's conv keypoint tower, None when it has another (through a PEFT wrapper too)."""
    from mmrl.policies.qwen_vl import rope_owner

    visual = getattr(rope_owner(model), "visual", None)
    return visual if isinstance(visual, ConvKeypointsEncoder) else None


def install_conv_keypoints(model: nn.Module, n_keypoints: int, *, augment_pad: int = 0, channels: int = 32,
                           seed: int | None = None, aux_dim: int = 0, film: bool = False) -> ConvKeypointsEncoder:
    """Replace a Qwen-VL model's vision tower by a `ConvKeypointsEncoder` (seeded weights, the old
    tower's dtype and device); returns it. The model's state dict then holds its weights under the
    same `...visual.` prefix. `film` conditions it on the LM's token embeddings (`conditioned`)."""
    from mmrl.policies.qwen_vl import rope_owner

    owner = rope_owner(model)
    old, vc = owner.visual, model.config.vision_config
    hidden = getattr(vc, "out_hidden_size", None) or model.config.get_text_config().hidden_size
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        enc = ConvKeypointsEncoder(hidden, n_keypoints, patch_size=vc.patch_size,
                                   temporal_patch_size=vc.temporal_patch_size,
                                   spatial_merge_size=vc.spatial_merge_size, channels=channels,
                                   in_channels=getattr(vc, "in_channels", 3), augment_pad=augment_pad,
                                   aux_dim=aux_dim, film_dim=model.get_input_embeddings().weight.shape[1] if film else 0)
    p = next(old.parameters())
    owner.visual = enc.to(device=p.device, dtype=p.dtype)
    return enc


def load_conv_keypoints(model: nn.Module, directory: str | Path) -> None:
    """Load the conv tower's weights from a checkpoint that `save_pretrained` wrote (its safetensors
    keys end in `visual.<encoder key>`, whatever prefix the checkpoint format puts before it)."""
    from safetensors.torch import load_file

    enc = conv_encoder(model)
    if enc is None:
        raise ValueError("the model has no conv_keypoints vision tower to load")
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        for key, value in load_file(str(f)).items():
            if "visual." in key:
                state[key.split("visual.", 1)[1]] = value
    wanted = set(enc.state_dict())
    missing = sorted(wanted - set(state))
    if missing:
        raise ValueError(f"{directory} holds no conv_keypoints weights for {missing[:3]} (a checkpoint of "
                         "another vision tower?)")
    enc.load_state_dict({k: state[k] for k in wanted})


__all__ = [
    "ConvKeypointsEncoder",
    "ConvKeypointsOutput",
    "conv_encoder",
    "image_token_count",
    "install_conv_keypoints",
    "load_conv_keypoints",
    "patches_to_images",
    "random_shift",
    "spatial_soft_argmax",
]
