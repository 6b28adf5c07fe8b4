"""Typed settings of the visual planner (lerobot-style: configuration apart from modeling).

`VisualPlannerConfig.from_params(cfg.model.params)` reads the free `model.params` dict of a run
config and names any unknown key. The VQ and LM sizes only matter for `model.source: tiny`; a
pretrained directory carries its own.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrl.config_checks import check_names

# Llama sizes of the tiny demo / test model (overridable through `model.tiny`).
TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@dataclass
class VQConfig:
    """A patch VQ-VAE: every `patch_size` x `patch_size` pixel patch is one code.

    With `patch_size` equal to the renderer's cell size, one grid cell is one code, so the LM's
    next-frame prediction is a local edit of a short code sequence.
    """

    patch_size: int = 16
    codebook_size: int = 128
    code_dim: int = 32
    hidden: int = 128
    beta: float = 0.25  # commitment weight

    def validate(self) -> None:
        for name in ("patch_size", "codebook_size", "code_dim", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"vq {name} must be >= 1, got {getattr(self, name)}")
        if self.beta < 0:
            raise ValueError(f"vq beta must be >= 0, got {self.beta}")


@dataclass
class VisualPlannerConfig:
    # VQ tokenizer (trained here on rendered frames when model.source is tiny)
    patch_size: int | None = None  # None: the task's cell_size (one code per cell)
    codebook_size: int = 128
    code_dim: int = 32
    vq_hidden: int = 128
    vq_steps: int = 1000
    vq_lr: float = 3e-3
    vq_batch_size: int = 256
    vq_layouts: int = 200  # train layouts whose reachable states are rendered for the VQ
    # the LM's vocabulary: codes, then specials, then one size token per code-grid side
    max_side: int = 32
    # side (in codes) of the canvas frames are placed on, VOID around them; None: the largest
    # train frame's side; 0: no canvas (each frame is just its own codes)
    canvas: int | None = None
    fast_decode: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # free room for forks; ignored here

    def __post_init__(self):
        for name in ("codebook_size", "code_dim", "vq_hidden", "vq_batch_size", "vq_layouts", "max_side"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"model.params.{name} must be >= 1, got {getattr(self, name)}")
        if self.vq_steps < 0:
            raise ValueError(f"model.params.vq_steps must be >= 0, got {self.vq_steps}")
        if self.canvas is not None and self.canvas < 0:
            raise ValueError(f"model.params.canvas must be >= 0, got {self.canvas}")
        if self.patch_size is not None and self.patch_size < 1:
            raise ValueError(f"model.params.patch_size must be >= 1, got {self.patch_size}")

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> VisualPlannerConfig:
        params = dict(params or {})
        check_names(params, [f.name for f in dataclasses.fields(cls)], "model.params (visual_planner)", kind="key")
        return cls(**params)

    def vq_config(self, cell_size: int) -> VQConfig:
        cfg = VQConfig(patch_size=self.patch_size or cell_size, codebook_size=self.codebook_size,
                       code_dim=self.code_dim, hidden=self.vq_hidden)
        cfg.validate()
        return cfg


@dataclass
class Vocabulary:
    """Token ids: codes 0..K-1, then PAD, BOS, SEP, EOS, VOID, then `<h=k>` and `<w=k>` size tokens.

    `canvas`: frames are placed at the top left of a canvas x canvas grid of codes, VOID around
    them, both in the prompt and in the generated frame. Then a code and its copy in the next
    frame are always the same distance apart, and a row up or down is always the same offset,
    whatever the grid size: a tiny LM learns that fixed geometry far faster than a size-dependent
    one. A frame larger than the canvas uses its own size. 0: no canvas.
    """

    codebook_size: int
    max_side: int = 32
    canvas: int = 0

    def canvas_shape(self, h: int, w: int) -> tuple[int, int]:
        return max(h, self.canvas), max(w, self.canvas)

    @property
    def pad(self) -> int:
        return self.codebook_size

    @property
    def bos(self) -> int:
        return self.codebook_size + 1

    @property
    def sep(self) -> int:
        return self.codebook_size + 2

    @property
    def eos(self) -> int:
        return self.codebook_size + 3

    @property
    def void(self) -> int:
        return self.codebook_size + 4

    def height_token(self, h: int) -> int:
        if not 1 <= h <= self.max_side:
            raise ValueError(f"code grid height {h} outside 1..{self.max_side} (raise model.params.max_side)")
        return self.codebook_size + 5 + h - 1

    def width_token(self, w: int) -> int:
        if not 1 <= w <= self.max_side:
            raise ValueError(f"code grid width {w} outside 1..{self.max_side} (raise model.params.max_side)")
        return self.codebook_size + 5 + self.max_side + w - 1

    @property
    def size(self) -> int:
        return self.codebook_size + 5 + 2 * self.max_side

    @property
    def special_ids(self) -> list[int]:
        """Every token but the codes and VOID: never sampled as part of a frame."""
        return [i for i in range(self.codebook_size, self.size) if i != self.void]

    def to_dict(self) -> dict[str, int]:
        return {"codebook_size": self.codebook_size, "max_side": self.max_side, "canvas": self.canvas}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: Path) -> Vocabulary:
        return cls(**json.loads(path.read_text()))
