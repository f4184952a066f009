"""Training batches from a dataset on disk (``dtdsl.data.sources``: a dtdsl dataset or
WebDataset shards): which samples make up each step, and each of them decoded into the
runtime's tensors.

**Order.** The run reads the dataset as one stream of epochs: global batch ``s`` holds
stream positions ``s*B .. s*B + B - 1`` (``B = train.global_batch``); stream position
``t`` is sample ``perm_e[t mod N]`` of epoch ``e = t div N``, where ``perm_e`` is a
permutation of the ``N`` samples seeded by ``(train.seed, e)`` alone. So the batches are
a function of the seed and the step, whatever reads them (any number of workers, a
trainer resumed at step k), and every sample of an epoch is consumed exactly once.

**Which samples.** ``N`` counts the samples the run can train on (``data.usable``: the
index's samples whose text goes with their images and whose parts decode; the same list
in every process), each within the spec's clamps (``data.clamps``) and cut to ``seq_len``
(``ir.layout.fit``). What is left out is logged once per sample, with its file and why,
and counted (``left_out``). A sample that stops decoding after that (its file changed
during the run) keeps its place with a stand-in of its sizes, logged once and counted in
``replaced``: the batch's sizes, which every process computes alone, must not change.

**Tensors.** ``dtdsl.data.decode.Decoder`` gives numpy arrays; ``to_sample`` turns them
into a ``runtime.data.Sample``: token ids as they are, images as their uint8 pixels
(normalised on the encoder's device, ``models.inputs.Pixels``, with the encoder's mean and
std, ``ir.modal.pixel_norm``), the generators' latents, noise and timesteps as they are. The
preprocessing workers ship the same uint8 images, so a launched run and ``dtc reference
--data`` see identical tensors.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from dtdsl.ir import program as ir

__all__ = ["DatasetSource", "epoch_permutation", "image_pixels", "stream_indices",
           "to_sample"]

log = logging.getLogger("dtdsl.feed.source")
_MAX_LOGGED = 1000      # skipped samples named one by one; then a count


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the ``n`` samples in epoch ``epoch`` (a pure function of its inputs)."""
    digest = hashlib.sha256(f"dtdsl:epoch:{seed}:{epoch}:{n}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little")).permutation(n)


def stream_indices(seed: int, n: int, step: int, batch: int) -> list[int]:
    """The dataset indices of global batch ``step`` (module docstring)."""
    if n < 1:
        raise ValueError("the dataset is empty")
    perms: dict[int, np.ndarray] = {}
    out = []
    for t in range(step * batch, (step + 1) * batch):
        epoch, at = divmod(t, n)
        if epoch not in perms:
            perms[epoch] = epoch_permutation(seed, epoch, n)
        out.append(int(perms[epoch][at]))
    return out


def image_pixels(pixels: np.ndarray):
    """A decoded uint8 ``[3, H, W]`` image as the tensor a ``Sample`` holds: its pixels,
    uint8, in memory of its own (normalised on the encoder's device,
    ``models.inputs.Pixels``). ValueError for anything else."""
    import torch

    array = np.asarray(pixels)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[0] != 3:
        raise ValueError(f"an image of dtype {array.dtype} and shape {array.shape}: "
                         "expected uint8 pixels [3, H, W]")
    return torch.from_numpy(np.array(array, dtype=np.uint8, order="C"))


def to_sample(step: int, position: int, decoded, parts: frozenset[str]):
    """A ``runtime.data.Sample`` from a ``DecodedSample`` (only ``parts`` filled; images
    as uint8 pixels, ``image_pixels``; audio and video items, with the images, as the
    float32 arrays ``data.media`` makes)."""
    import torch

    from dtdsl.models.inputs import GenTargets, Sample

    tokens = (torch.from_numpy(np.array(decoded.tokens, dtype=np.int64)) if "tokens" in parts
              else torch.empty(0, dtype=torch.int64))
    images = (tuple(image_pixels(im) for im in decoded.images) if "images" in parts
              else ())
    targets = {}
    if "targets" in parts:
        for name, t in decoded.gen.items():
            def tensor(x: Any) -> Any:
                return None if x is None else torch.from_numpy(np.array(x))

            targets[name] = GenTargets(latents=tensor(t.latents), noise=tensor(t.noise),
                                       timesteps=tensor(t.timesteps), pixels=tensor(t.pixels),
                                       eps=tensor(t.eps))
    keep = "images" in parts
    inputs = {k: tuple(torch.from_numpy(np.array(x, dtype=np.float32)) for x in v)
              for k, v in decoded.inputs.items()} if keep else {}
    return Sample(step=step, index=position, tokens=tokens, images=images, targets=targets,
                  image_at=decoded.image_at, trained=decoded.trained,
                  doc_text=decoded.doc_text, doc_images=decoded.doc_images,
                  doc_gen=decoded.doc_gen, inputs=inputs,
                  inputs_at=decoded.inputs_at if inputs else None,
                  doc_inputs=decoded.doc_inputs if inputs else None)


def _log_left_out(path: str | Path, found: Any, total_text: str) -> None:
    """Each sample the run leaves out because it does not decode (its file and why), and
    the count of everything left out; once, when the source is made."""
    for k, (key, file, why) in enumerate(found.undecodable):
        if k == _MAX_LOGGED:
            log.warning("data %s: %d more samples that do not decode are skipped",
                        path, len(found.undecodable) - k)
            break
        log.warning("data %s: skipping sample %s (%s): %s", path, key, file, why)
    if total_text:
        log.warning("data %s: %d of %d samples are trained on; %s", path,
                    len(found.indices), found.total, total_text)


def _first(targets: Any, n: int) -> Any:
    """A generator's targets cut to their first ``n`` (itself when it has no more)."""
    import dataclasses

    if len(targets) <= n:
        return targets
    return dataclasses.replace(
        targets, **{f: getattr(targets, f)[:n] for f in ("latents", "noise", "timesteps",
                                                         "pixels", "eps")
                    if getattr(targets, f) is not None})


class DatasetSource:
    """A ``runtime.batch.SampleSource`` over a dataset (module docstring). Its samples are
    those ``data.usable`` keeps (the others are counted in ``skipped``, by reason in
    ``left_out``), each within the spec's clamps (``data.clamps``) and cut to ``seq_len``
    as ``ir.layout.fit`` cuts it."""

    def __init__(self, program: ir.Program, path: str | Path, *, seed: int | None = None,
                 progress: Any = None):
        from dtdsl.data.clamps import Clamps
        from dtdsl.data.decode import Decoder
        from dtdsl.data.shards import Dataset, DatasetError, NoSamples
        from dtdsl.data.sources import open_dataset
        from dtdsl.data.text import HashTokenizer, token_layouts
        from dtdsl.data.usable import left_out_text, usable_samples

        self.program = program
        self.path = path
        # A dtdsl dataset, WebDataset shards or a LLaVA JSON (indexed once).
        self.dataset = open_dataset(str(path), program=program, progress=progress)
        self.seed = program.train.seed if seed is None else seed
        self.decoder = Decoder.for_program(program, seed=self.seed)
        if isinstance(self.decoder.tokenizer, HashTokenizer) and \
                not isinstance(self.dataset, Dataset):
            raise DatasetError(f"{path} holds real text, which needs a tokenizer: the data "
                               "block's `tokenizer` (the hashing one is for synthetic data)")
        self.batch = program.train.global_batch
        image = next((m for m in program.encoders if m.modality == "image"), None)
        self.patch = (image.arch.patch or 1) if image is not None else None
        if self.decoder.input_encoders:     # every encoder's rule places its items
            from dtdsl.ir.modal import encoder_inputs

            self.image_tokens: Any = encoder_inputs(program)
        else:
            self.image_tokens = program.image_tokens()
        self.clamps = Clamps.for_program(program)
        layouts = token_layouts(self.dataset, self.decoder.tokenizer, progress=progress,
                                kinds=self.decoder.kinds)
        found = usable_samples(self.dataset, self.decoder, layouts, progress=progress)
        self.usable = list(found.indices)
        self.skipped = len(layouts) - len(self.usable)
        self.left_out = dict(found.left_out)
        self.replaced: dict[int, str] = {}      # dataset index -> why (module docstring)
        self._layouts = layouts
        told = left_out_text(self.dataset, self.left_out)
        _log_left_out(path, found, told)
        if not self.usable:
            raise NoSamples(f"{path} has no sample to train on: its index holds "
                            f"{len(layouts)}" + (f"; {told}" if told else ""))
        self._doc_sizes: dict[int, Any] = {}
        self._rows = lru_cache(maxsize=8)(self._step_rows)
        self._sizes = lru_cache(maxsize=8)(self._step_sizes)
        self._epoch_rows = lru_cache(maxsize=2)(self._pack_epoch)
        self._epoch_counts: dict[int, int] = {}

    # ---- which samples ----------------------------------------------------------------------

    def _pack_epoch(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        """Epoch ``epoch``'s samples in its order, packed into sequences (dataset indices)."""
        from dtdsl.ir.layout import layout_of, pack

        order = [self.usable[k] for k in epoch_permutation(self.seed, epoch, len(self.usable))]
        seq_len = self.program.train.seq_len
        rows = pack((layout_of(self.doc_sizes(i), self.image_tokens, seq_len).length
                     for i in order), seq_len)
        return tuple(tuple(order[j] for j in r) for r in rows)

    def _step_rows(self, step: int) -> tuple[tuple[int, ...], ...]:
        if not self.program.train.packing:
            picks = stream_indices(self.seed, len(self.usable), step, self.batch)
            return tuple((self.usable[k],) for k in picks)
        # The epochs' packed sequences one after the other; step s takes B of them.
        start, out = step * self.batch, []
        epoch = first = 0           # first: the stream position of the epoch's first row
        while len(out) < self.batch:
            count = self.sequences_in_epoch(epoch)
            at = start + len(out) - first
            if at < count:
                out.extend(self._epoch_rows(epoch)[at:at + self.batch - len(out)])
            first, epoch = first + count, epoch + 1
        return tuple(out)

    def sequences_in_epoch(self, epoch: int) -> int:
        """How many packed sequences epoch ``epoch`` makes (its samples, once each)."""
        if epoch not in self._epoch_counts:
            self._epoch_counts[epoch] = len(self._epoch_rows(epoch))
        return self._epoch_counts[epoch]

    def rows(self, step: int) -> tuple[tuple[int, ...], ...]:
        """Per position of step ``step``, the dataset indices of its samples (one each
        without packing)."""
        return self._rows(step)

    def indices(self, step: int) -> tuple[int, ...]:
        """The dataset indices of step ``step``'s samples, in order."""
        return tuple(i for r in self.rows(step) for i in r)

    def keys(self, step: int) -> tuple[str, ...]:
        return tuple("+".join(self.dataset.key(i) for i in r) for r in self.rows(step))

    # ---- sizes and samples ----------------------------------------------------------------

    def doc_sizes(self, i: int) -> Any:
        """Dataset sample ``i``'s sizes from the index and its token layout (the decoded
        shapes, cut to ``seq_len``; no pixel read)."""
        found = self._doc_sizes.get(i)
        if found is not None:
            return found
        from dtdsl.ir.layout import fit
        from dtdsl.ir.sizes import SampleSizes

        info = self.dataset.info(i)
        layout = self._layouts[i]
        assert layout is not None
        text, places, trained, items_at = layout
        shapes: tuple[tuple[int, int], ...] = ()
        if self.decoder.images is not None:
            shapes = tuple(self.decoder.images.shape(w, h) for w, h in info.images)
        else:
            places = ()       # no encoder reads the images: text only
        gen = {g.name: (len(info.gen_images) if g.modality == "image" else
                        info.gen_audio_count) for g in self.program.generators}
        # The spec's clamps first (data.clamps), then seq_len: the one place the run's
        # samples are made to fit, for the workers and the reference alike.
        inputs = self.decoder.input_shapes(info)
        inputs_at = self.decoder.input_places(places, items_at)
        found = self._doc_sizes[i] = fit(
            self.clamps.apply(SampleSizes(text_tokens=text, image_shapes=shapes,
                                          gen_counts=gen, image_at=places, trained=trained,
                                          inputs=inputs, inputs_at=inputs_at)),
            self.image_tokens, self.program.train.seq_len)
        return found

    def _step_sizes(self, step: int) -> tuple:
        from dtdsl.data.sample import join_sizes

        return tuple(join_sizes([self.doc_sizes(i) for i in r]) for r in self.rows(step))

    def sizes(self, step: int) -> list:
        """Every position's sizes (a packed sequence's: its samples' joined); made once
        per step, however many positions a worker decodes."""
        return list(self._sizes(step))

    def _read_decoded(self, i: int):
        """Sample ``i`` decoded whole, or its stand-in when it no longer reads or decodes
        as it did when the run's samples were chosen (module docstring)."""
        from dtdsl.data.shards import DatasetError

        try:
            decoded = self.decoder.decode(self.dataset.read(i))
            if len(decoded.tokens) != self._layouts[i][0]:
                raise DatasetError(f"sample {decoded.key} changed since it was indexed: "
                                   f"{len(decoded.tokens)} tokens, not {self._layouts[i][0]}")
            return decoded
        except DatasetError as err:
            from dtdsl.data.usable import where

            if i not in self.replaced:
                self.replaced[i] = str(err)
                log.warning("data %s: sample %s (%s) no longer decodes (%s); a stand-in of "
                            "its sizes takes its place (%d so far)", self.path,
                            self.dataset.key(i), where(self.dataset, i), err,
                            len(self.replaced))
            info = self.dataset.info(i)
            gen = {g.name: len(info.gen_images) if g.modality == "image" else
                   info.gen_audio_count for g in self.program.generators}
            return self.decoder.stand_in(info.key, self._layouts[i][0], info.images, gen,
                                         self.decoder.input_shapes(info))

    def _decode_one(self, i: int):
        import dataclasses

        decoded = self._read_decoded(i)
        sizes = self.doc_sizes(i)
        # Cut to the sizes the batch was formed with (clamps, seq_len): a prefix of each.
        gen = {name: _first(t, sizes.gen_counts.get(name, len(t)))
               for name, t in decoded.gen.items()}
        return dataclasses.replace(
            decoded, tokens=decoded.tokens[:sizes.text_tokens],
            images=decoded.images[:len(sizes.image_shapes)] if self.patch is not None else (),
            gen=gen, image_at=sizes.image_at, trained=sizes.trained,
            inputs={k: v[:len(sizes.inputs.get(k, ()))] for k, v in decoded.inputs.items()},
            inputs_at=sizes.inputs_at if sizes.inputs else None)

    def decode(self, step: int, position: int):
        """The ``DecodedSample`` (numpy) at ``position`` of step ``step``, each sample cut
        as its sizes say; a packed sequence's samples joined."""
        from dtdsl.data.decode import join_decoded

        row = self.rows(step)[position]
        return join_decoded([self._decode_one(i) for i in row],
                            self._sizes(step)[position] if len(row) > 1 else None)

    def sample(self, step: int, position: int,
               parts: frozenset[str] = frozenset({"tokens", "images", "targets"}),
               sizes: Sequence | None = None):
        return to_sample(step, position, self.decode(step, position), parts)
