"""What the models read of a sample: its tensors (``Sample``, a generator's ``GenTargets``;
``data.sample`` draws them, ``data`` and ``feed`` load them), images grouped by size for an
encoder (``pack_images``, ``pack_items``; ``unpack_images`` the other way), and uint8 pixels
normalised on the encoder's device (``Pixels``).

Packing: the ViT encoder (``models.Encoder``) takes ``[B, N, patch_dim]`` with no attention
mask, so images of different sizes cannot share a row without attending to each other.
``pack_images`` therefore groups images by patch count: one dense ``[B_k, N_k, patch_dim]``
tensor per distinct size, no padding at all; ``unpack_images`` turns per-group outputs back
into one ``[tokens_i, D]`` tensor per sample (its images' tokens in order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dtdsl.ir import program as ir
from dtdsl.ir.modal import InputRule
from dtdsl.models.transformer import Encoder

__all__ = ["GenTargets", "PackedImages", "Pixels", "Sample", "image_encoder", "pack_images",
           "pack_items", "unpack_images"]


@dataclass(frozen=True, eq=False)
class GenTargets:
    """A sample's generation targets for one generator (G of them, G may be 0)."""

    latents: torch.Tensor | None   # [G, C, L, L] float32: the clean latents x0 (None:
                                   # a VAE generator's ``pixels`` and ``eps`` instead)
    noise: torch.Tensor        # [G, C, L, L] float32: the noise to predict
    timesteps: torch.Tensor    # [G] int64 in [0, the generator's timesteps)
    pixels: torch.Tensor | None = None   # [G, 3, S, S] uint8: images the VAE encodes
    eps: torch.Tensor | None = None      # [G, C, L, L] float32: its posterior's noise

    def __len__(self) -> int:
        return int(self.noise.shape[0])

    def slice(self, start: int, stop: int) -> GenTargets:
        """Targets ``start:stop``."""
        return GenTargets(*(None if t is None else t[start:stop] for t in (
            self.latents, self.noise, self.timesteps, self.pixels, self.eps)))

    @staticmethod
    def cat(parts: Sequence[GenTargets]) -> GenTargets:
        """The targets of ``parts`` one after the other."""
        def one(field: str) -> torch.Tensor | None:
            values = [getattr(t, field) for t in parts]
            return None if values[0] is None else torch.cat(values)
        return GenTargets(one("latents"), one("noise"), one("timesteps"), one("pixels"),
                          one("eps"))


@dataclass(frozen=True, eq=False)
class Sample:
    """One training sample: built from ``(train.seed, step, index)`` alone."""

    step: int
    index: int                              # position in the step's global batch
    tokens: torch.Tensor                    # [T] int64
    images: tuple[torch.Tensor, ...]        # each [3, H, W]: uint8 pixels (a dataset's,
                                            # ``Pixels`` normalises them) or
                                            # float32 (synthetic, already normalised)
    targets: dict[str, GenTargets]          # generator name -> its targets
    image_at: tuple[int, ...] | None = None             # as in ``SampleSizes``
    trained: tuple[tuple[int, int], ...] | None = None
    doc_text: tuple[int, ...] | None = None             # a packed sequence's documents
    doc_images: tuple[int, ...] | None = None
    doc_gen: dict[str, tuple[int, ...]] | None = None
    # Every other encoder's items, by encoder name (``SampleSizes.inputs``): float32
    # tensors, audio ``[T, M]`` fbanks, video ``[F, 3, H, W]`` frames (``ir.modal``).
    inputs: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    inputs_at: dict[str, tuple[int, ...]] | None = None
    doc_inputs: dict[str, tuple[int, ...]] | None = None

    @property
    def num_gen_targets(self) -> int:
        return sum(len(t) for t in self.targets.values())


def image_encoder(program: ir.Program) -> ir.Module | None:
    """The image encoder whose items are a sample's ``images`` (the first of the spec), or
    None; every other encoder's items are the sample's ``inputs`` (``ir.modal``).
    ValueError for an encoder that is not a transformer over patches."""
    for module in program.encoders:
        if not isinstance(module.arch, ir.TransformerArch):
            raise ValueError(f"the runtime has no data for the {module.modality} encoder "
                             f"'{module.name}': it models transformer encoders over patches")
    return next((m for m in program.encoders if m.modality == "image"), None)


@dataclass(frozen=True, eq=False)
class PackedImages:
    """Images of several samples grouped by size for the encoder, with no padding.

    ``groups[k]`` is ``[B_k, N_k, patch_dim]`` flattened patches of images whose patch
    grid is ``grids[k]`` (rows, columns); ``owners[k][j]`` is the ``(sample position, image
    position)`` of its row ``j``; ``counts[i]`` how many images sample position ``i`` has."""

    groups: tuple[torch.Tensor, ...]
    owners: tuple[tuple[tuple[int, int], ...], ...]
    counts: tuple[int, ...]
    grids: tuple[tuple[int, int], ...] = ()


def _pack(items: Sequence[Sequence[torch.Tensor]],
          prepare: Callable[[torch.Tensor], torch.Tensor],
          patchify: Callable[[torch.Tensor], torch.Tensor],
          grid: Callable[[tuple[int, ...]], tuple[int, ...]]) -> PackedImages:
    """Every item of ``items`` (one sequence per sample) grouped by shape, in order of
    first appearance; each group stacked, ``prepare``d and ``patchify``d, its patch grid
    ``grid(shape)``."""
    by_shape: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for i, sample_items in enumerate(items):
        for j, item in enumerate(sample_items):
            by_shape.setdefault(tuple(item.shape), []).append((i, j))
    groups, owners, grids = [], [], []
    for shape, members in by_shape.items():
        groups.append(patchify(prepare(torch.stack([items[i][j] for i, j in members]))))
        owners.append(tuple(members))
        grids.append(grid(shape))
    return PackedImages(groups=tuple(groups), owners=tuple(owners),
                        counts=tuple(len(s) for s in items), grids=tuple(grids))


def pack_images(images: Sequence[Sequence[torch.Tensor]], patch: int,
                pixels: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PackedImages:
    """Group every image of ``images`` (one sequence per sample) by its patch count, in
    order of first appearance, and patchify each group (``Encoder.patchify``). ``pixels``:
    applied to each group's stacked ``[B, 3, H, W]`` images first (``Pixels``:
    uint8 pixels normalised, one pass per group)."""
    return _pack(images, pixels or (lambda x: x), lambda x: Encoder.patchify(x, patch),
                 lambda shape: (shape[-2] // patch, shape[-1] // patch))


def pack_items(items: Sequence[Sequence[torch.Tensor]], rule: InputRule,
               pixels: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PackedImages:
    """``pack_images`` for any encoder's items (``rule``: its ``ir.modal.InputRule``):
    grouped by shape in order of first appearance, each group patchified by the rule
    (``pixels`` applied to image groups only), ``grids`` the rule's patch grids."""
    if rule.modality == "image":
        return pack_images(items, rule.patch, pixels)
    return _pack(items, lambda x: x.float(), rule.patchify, rule.grid)


def unpack_images(packed: PackedImages, outputs: Sequence[torch.Tensor],
                  width: int | None = None) -> list[torch.Tensor]:
    """Per-group outputs ``[B_k, N_k, D]`` back to one ``[sum of N, D]`` tensor per
    sample (its images' tokens in image order; ``[0, D]`` for a sample without images,
    ``D`` from the outputs or ``width`` when there are none)."""
    per_image: list[list[torch.Tensor | None]] = [[None] * c for c in packed.counts]
    for members, out in zip(packed.owners, outputs, strict=True):
        for row, (i, j) in enumerate(members):
            per_image[i][j] = out[row]
    if outputs:
        width, like = outputs[0].shape[-1], outputs[0]
    else:
        if width is None:
            raise ValueError("no images to unpack: give the output width")
        like = torch.empty(0)
    result = []
    for items in per_image:
        if items:
            result.append(torch.cat(items, dim=0))
        else:
            result.append(like.new_zeros((0, width)))
    return result


class Pixels:
    """Images as the encoder reads them, made on their device (module docstring): uint8
    ``[..., 3, H, W]`` normalised with ``mean`` and ``std`` (``normalize``'s arithmetic);
    floating-point images (the synthetic data's, already normalised) as they are.

    The per-channel constants are copied to ``device`` once, when it is made (per stage,
    not per step): normalising then reads nothing from the host."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...],
                 device: Any = "cpu"):
        import torch

        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1).to(device)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1).to(device)

    def __call__(self, images: Any) -> Any:
        import torch

        if images.dtype != torch.uint8:
            return images
        if images.shape[-3] != 3:
            raise ValueError(f"uint8 images of shape {tuple(images.shape)}: expected 3 "
                             "colour channels before height and width")
        return images.to(torch.float32).div_(255.0).sub_(self.mean).div_(self.std)
