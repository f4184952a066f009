"""What a pass reads of its microbatch's samples (a mixin of train.executor.StageExecutor):
their loss tokens and rows (context-parallel shards too), their images packed for an
encoder, a co-located encoder's images, and a generator's targets per document."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dtdsl.models.inputs import PackedImages, Sample, pack_items
from dtdsl.models.multimodal import (
    encoder_items,
    padded_width,
)
from dtdsl.parallel.device import to_device


class PassInputs:
    """``StageExecutor``'s sample views (module docstring); it reads the executor's state
    (``self._sample``, ``self._sizes``, ``self.stage``, ...)."""

    def _loss_tokens(self, ids: Sequence[int]) -> int:
        """The next-token targets of these samples (``models.multimodal.loss_tokens``'s
        rule), from their sizes: no device round trip to count them (under context
        parallelism those of this CP rank's shard)."""
        if self._cp is not None:
            width = padded_width(max((self._layout(i).length for i in ids), default=0),
                                 self.role.grid.tp, self._cp.size)
            return self._cp_loss_rows(ids, width)[0]
        return sum(self._layout(i).loss_tokens for i in ids)

    def _loss_rows(self, ids: Sequence[int]) -> torch.Tensor | None:
        """The positions (flat, in the padded ``[B, S]`` batch) that have a next-token
        target, made on the host from the samples' sizes and copied without blocking: the
        head runs on those rows only, with no device round trip to find them. None on a
        stage without the head."""
        if not self._last or self.role.role != "backbone":
            return None
        tp = self.role.grid.tp
        width = padded_width(max((self._layout(i).length for i in ids), default=0), tp,
                             self.role.grid.cp)
        if self._cp is not None:
            return to_device(self._cp_loss_rows(ids, width)[1], self.device)
        rows: list[int] = []
        for b, i in enumerate(ids):
            for lo, hi in self._layout(i).loss_positions():
                rows.extend(range(b * width + lo, b * width + hi))
        return to_device(torch.tensor(rows, dtype=torch.int64), self.device)

    def _cp_loss_rows(self, ids: Sequence[int], width: int) -> tuple[int, torch.Tensor]:
        """Under context parallelism: ``(targets, flat rows)`` of this CP rank's shard
        ``[B, width / cp]`` of the microbatch that have a next-token target, on the host."""
        assert self._cp is not None
        wanted = torch.zeros(len(ids), width, dtype=torch.bool)
        for b, i in enumerate(ids):
            for lo, hi in self._layout(i).loss_positions():
                wanted[b, lo:hi] = True
        rows = self._cp.shard(wanted).flatten().nonzero().squeeze(1)
        return rows.numel(), rows

    def _pack(self, samples: Sequence[Sample], name: str | None = None) -> PackedImages:
        """The items of ``samples`` of encoder ``name`` (default: the one this rank
        encodes), packed (``models.inputs.pack_items``: uint8 pixels normalised on the
        device)."""
        name = name or self._encoder
        assert name is not None
        items = [to_device(list(encoder_items(s, self._inputs, name)), self.device)
                 for s in samples]
        return pack_items(items, self._inputs.rule(name), self._pixels)

    def _hosted_images(self, samples: Sequence[Sample], name: str | None = None
                       ) -> PackedImages | None:
        """The items of ``samples`` packed for co-located (or phased) encoder ``name``
        (default: the one this rank runs; None when they have none), their patches
        counted."""
        packed = self._pack(samples, name)
        if not packed.groups:
            return None
        self.processed["patches"] += sum(g.shape[0] * g.shape[1] for g in packed.groups)
        return packed

    def _generation(self, ids: Sequence[int]) -> dict[str, tuple[list[Any], list[Any]]]:
        """Per co-located generator, the targets of samples ``ids`` and their documents'
        target counts (``_hosted_losses``), the targets counted."""
        out = {}
        for name in self._hosted_generators:
            targets = [to_device(self._sample(i).targets[name], self.device) for i in ids]
            out[name] = (targets, [self._doc_targets(i, name) for i in ids])
            self.processed["targets"] += sum(len(t) for t in targets)
        return out

    def _doc_targets(self, i: int, name: str) -> tuple[int, ...]:
        """Sample ``i``'s generation targets of generator ``name``, per document."""
        sizes = self._sizes(i)
        return sizes.doc_gen[name] if sizes.doc_gen is not None else \
            (sizes.gen_counts.get(name, 0),)
