"""A small VQ image tokenizer for the planning frames, trained here in seconds on CPU.

Design: a patch VQ-VAE. The encoder maps each `patch_size` x `patch_size` patch (non-overlapping;
an MLP on the flattened patch, i.e. a stride-P convolution followed by 1x1 convolutions) to a
vector on a sphere, the code vector of largest cosine replaces it (straight-through gradient,
codebook + commitment loss), and the decoder maps each code back to its patch. With the patch
equal to the renderer's cell, one grid cell is one code and one code is one cell: moving the
agent changes exactly two codes, which keeps the LM's job a local edit of a short sequence.

Because codes see only their own patch, training on the frames' *distinct* patches (uniformly)
is the same objective as training on whole frames with rare patches (the agent on the goal, a
maze corner) up-weighted; `train_vq` does that, which makes ~1000 steps (seconds) enough.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .configuration import VQConfig

CONFIG_NAME = "vq_config.json"
WEIGHTS_NAME = "vq.safetensors"


class VQTokenizer(nn.Module):
    def __init__(self, config: VQConfig):
        super().__init__()
        config.validate()
        self.config = config
        P, h, d = config.patch_size, config.hidden, config.code_dim
        # Linear layers on flattened patches: the same maps as a stride-P convolution (and its
        # transpose) followed by 1x1 convolutions, without the conv overhead on CPU.
        self.encoder = nn.Sequential(nn.Linear(P * P * 3, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, d))
        self.codebook = nn.Embedding(config.codebook_size, d)
        self.decoder = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, P * P * 3))

    # ------------------------------------------------------------------ shapes and conversion

    @property
    def device(self) -> torch.device:
        return self.codebook.weight.device

    def grid_shape(self, frame_shape: Sequence[int]) -> tuple[int, int]:
        """(rows, cols) of codes for a frame of shape (H, W[, 3])."""
        H, W = int(frame_shape[0]), int(frame_shape[1])
        P = self.config.patch_size
        if H % P or W % P:
            raise ValueError(f"frame {H}x{W} is not a multiple of the VQ patch size {P}; render with "
                             f"cell_size a multiple of {P}")
        return H // P, W // P

    def patchify(self, frames) -> torch.Tensor:
        """uint8 [B, H, W, 3] (array, tensor or list of same-shaped frames) -> float patches
        [B, h, w, P*P*3] in [0, 1]."""
        if isinstance(frames, (list, tuple)):
            frames = np.stack([np.asarray(f) for f in frames])
        x = torch.as_tensor(np.asarray(frames) if not torch.is_tensor(frames) else frames)
        if x.dim() != 4 or x.shape[-1] != 3:
            raise ValueError(f"frames must be [B, H, W, 3], got shape {tuple(x.shape)}")
        self.grid_shape(x.shape[1:])
        x = x.to(self.device)
        x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
        B, H, W, _ = x.shape
        P = self.config.patch_size
        return x.reshape(B, H // P, P, W // P, P, 3).transpose(2, 3).reshape(B, H // P, W // P, P * P * 3)

    def unpatchify(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, h, w, P*P*3] -> [B, h*P, w*P, 3]."""
        B, h, w, _ = patches.shape
        P = self.config.patch_size
        return patches.reshape(B, h, w, P, P, 3).transpose(2, 3).reshape(B, h * P, w * P, 3)

    # ------------------------------------------------------------------ the VQ-VAE

    @property
    def radius(self) -> float:
        return float(self.config.code_dim) ** 0.5

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """patches [..., P*P*3] -> patch vectors [..., d] on the sphere of radius sqrt(d).

        Fixed-norm vectors on both sides (cosine VQ) keep codes from collapsing onto each other:
        the encoder cannot shrink or inflate its outputs to reach a neighbour's code. The radius
        sqrt(d) gives the decoder inputs of unit scale per dimension (a unit sphere learns slowly)."""
        return F.normalize(self.encoder(x), dim=-1) * self.radius

    def code_vectors(self, codes: torch.Tensor | None = None) -> torch.Tensor:
        e = F.normalize(self.codebook.weight, dim=-1) * self.radius
        return e if codes is None else F.embedding(codes, e)

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Codes of patch vectors z [..., d] (largest cosine)."""
        return (z @ self.code_vectors().T).argmax(-1)

    def reconstruct(self, q: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.decoder(q))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """patches [..., P*P*3] in [0, 1] -> (reconstruction, vq loss, codes [...])."""
        z = self.embed(x)
        codes = self.nearest(z.detach())
        q = self.code_vectors(codes)
        vq_loss = F.mse_loss(q, z.detach()) + self.config.beta * F.mse_loss(z, q.detach())
        q_st = z + (q - z).detach()  # straight-through
        return self.reconstruct(q_st), vq_loss, codes

    @torch.no_grad()
    def encode(self, frames) -> torch.Tensor:
        """uint8 frames [B, H, W, 3] -> long codes [B, h*w] (row-major)."""
        with torch.autocast(self.device.type, enabled=False):  # codes in float32 under a bf16 trainer too
            x = self.patchify(frames)
            return self.nearest(self.embed(x)).reshape(x.shape[0], -1)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, grid: tuple[int, int]) -> np.ndarray:
        """long codes [B, h*w] -> uint8 frames [B, h*P, w*P, 3]."""
        codes = torch.as_tensor(codes, device=self.device).long()
        h, w = grid
        if codes.dim() != 2 or codes.shape[1] != h * w:
            raise ValueError(f"codes must be [B, {h * w}] for a {h}x{w} grid, got {tuple(codes.shape)}")
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.config.codebook_size):
            raise ValueError(f"codes outside 0..{self.config.codebook_size - 1}")
        with torch.autocast(self.device.type, enabled=False):
            img = self.unpatchify(self.reconstruct(self.code_vectors(codes.reshape(-1, h, w))))
        return (img * 255.0).round().clamp(0, 255).to(torch.uint8).cpu().numpy()

    # ------------------------------------------------------------------ persistence

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(directory / WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> VQTokenizer:
        directory = Path(directory)
        if not (directory / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{directory} has no {CONFIG_NAME}: not a saved VQ tokenizer")
        vq = cls(VQConfig(**json.loads((directory / CONFIG_NAME).read_text())))
        vq.load_state_dict(load_file(str(directory / WEIGHTS_NAME)))
        return vq.to(device).eval()


def distinct_patches(frames: Sequence[np.ndarray] | np.ndarray, patch_size: int) -> np.ndarray:
    """The distinct P x P patches of frames (any mix of sizes, each a multiple of P): uint8 [M, P, P, 3]."""
    P = patch_size
    groups: dict[tuple[int, int], list[np.ndarray]] = {}
    for f in frames:
        groups.setdefault(f.shape[:2], []).append(f)
    parts = []
    for (H, W), fs in groups.items():
        if H % P or W % P:
            raise ValueError(f"frame {H}x{W} is not a multiple of the patch size {P}")
        a = np.stack(fs).reshape(len(fs), H // P, P, W // P, P, 3).transpose(0, 1, 3, 2, 4, 5)
        parts.append(a.reshape(-1, P * P * 3))
    rows = np.concatenate(parts)
    # dedupe on two random projections per patch (a BLAS matmul): far faster than unique(axis=0);
    # distinct patches collide only on a measure-zero set of projections
    mix = np.random.default_rng(0).standard_normal((rows.shape[1], 2))
    keys = rows.astype(np.float64) @ mix
    _, first = np.unique(keys, axis=0, return_index=True)
    return rows[np.sort(first)].reshape(-1, P, P, 3)


def train_vq(frames: Sequence[np.ndarray] | np.ndarray, steps: int = 1000, config: VQConfig | None = None,
             lr: float = 3e-3, batch_size: int = 256, seed: int = 0, warmup_frac: float = 0.5,
             restart_every: int = 25, device: str | torch.device = "cpu") -> VQTokenizer:
    """Train a `VQTokenizer` on frames (uint8 [H, W, 3] each); deterministic given `seed`.

    Three phases, the usual cure for codebook collapse on tiny data: (1) `warmup_frac` of the
    steps as a plain autoencoder (no quantisation), so patch vectors become distinct; (2) the
    codebook starts at k-means centres of those vectors (k-means++ seeding: every distinct
    pattern gets its own code while there are more codes than patterns); (3) VQ training with a
    10x slower encoder, where every `restart_every` steps unused codes move onto distinct patches
    that had to share a code (a merge), worst reconstructed first.
    """
    config = config or VQConfig()
    patches = distinct_patches(frames, config.patch_size)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vq = VQTokenizer(config).to(device)
    data = torch.as_tensor(patches, device=device).reshape(len(patches), -1).float() / 255.0  # [M, P*P*3]
    M, K = len(data), config.codebook_size
    opt = torch.optim.Adam(vq.parameters(), lr=lr, foreach=True)
    warmup = int(steps * warmup_frac)
    used = torch.zeros(K, dtype=torch.bool, device=device)
    vq.train()
    for step in range(steps):
        if step == warmup:
            with torch.no_grad():
                vq.codebook.weight.copy_(_kmeans(vq.embed(data), K, gen))
            # fresh moments for the new objective; a slower encoder keeps the patterns apart
            opt = torch.optim.Adam([{"params": vq.encoder.parameters(), "lr": lr * 0.1},
                                    {"params": [*vq.codebook.parameters(), *vq.decoder.parameters()]}], lr=lr, foreach=True)
        x = data[torch.randint(M, (min(batch_size, M),), generator=gen).to(device)]
        if step < warmup:
            loss = F.mse_loss(vq.reconstruct(vq.embed(x)), x)
        else:
            recon, vq_loss, codes = vq(x)
            loss = F.mse_loss(recon, x) + vq_loss
            used[codes.flatten()] = True
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= warmup and restart_every and (step - warmup + 1) % restart_every == 0 and step + 1 < steps:
            _restart_dead_codes(vq, data, used)
            used.zero_()
    return vq.eval()


def _kmeans(z: torch.Tensor, k: int, gen: torch.Generator, iters: int = 20) -> torch.Tensor:
    """k-means++ seeded centres of the rows of z [M, d]; with M <= k every row is a centre."""
    M = len(z)
    if M <= k:  # spare codes: random directions, far from every pattern (dead until restarted)
        spare = F.normalize(torch.randn((k - M, z.shape[1]), generator=gen), dim=-1).to(z.device)
        return torch.cat([z, spare])
    centres = [z[int(torch.randint(M, (1,), generator=gen))]]
    d2 = (z - centres[0]).pow(2).sum(-1)
    for _ in range(k - 1):
        i = int(torch.multinomial(d2 / d2.sum(), 1, generator=gen)) if d2.sum() > 0 else int(
            torch.randint(M, (1,), generator=gen))
        centres.append(z[i])
        d2 = torch.minimum(d2, (z - z[i]).pow(2).sum(-1))
    c = torch.stack(centres)
    for _ in range(iters):
        assign = torch.cdist(z, c).argmin(-1)
        for j in range(k):
            members = z[assign == j]
            if len(members):
                c[j] = members.mean(0)
    return c


@torch.no_grad()
def _restart_dead_codes(vq: VQTokenizer, data: torch.Tensor, used: torch.Tensor) -> None:
    """Move unused codes onto distinct patches that share a code with another one (a merge),
    worst reconstructed first; a tiny error bound skips merges of near-identical patches."""
    dead = (~used).nonzero().flatten()
    if len(dead) == 0:
        return
    recon, _, codes = vq(data)
    err = (recon - data).pow(2).mean(1)
    shared = torch.bincount(codes, minlength=vq.config.codebook_size)[codes] > 1
    cand = torch.nonzero(shared & (err > 1e-3)).flatten()
    cand = cand[err[cand].argsort(descending=True)][: len(dead)]
    if len(cand):
        vq.codebook.weight[dead[: len(cand)]] = vq.embed(data[cand])
