"""The feed's messages: one training step's data for one trainer rank, and the progress
announcements the workers pace themselves by.

A ``batch`` message (``wire`` kind ``"batch"``) carries, for step ``meta["step"]``:

- ``routing``: ``order`` int64 ``[B]`` (the positions of every microbatch step, steps
  concatenated in execution order), ``counts`` int64 ``[M]`` (positions per step),
  ``assign.<unit>`` int64 ``[B]`` (each position's replica of that unit, aligned with
  ``order``);
- the loss denominators ``meta["norm"] = [text_tokens, gen_targets]``;
- the keys of the batch (``keys``: uint8, the keys joined by newlines) for rank 0, which
  records them in ``samples.jsonl``;
- the samples this rank reads, only the parts it reads: ``p<pos>.tokens`` int64,
  ``p<pos>.img<k>`` uint8 ``[3, H, W]`` (decoded images; float32 where the job draws
  synthetic samples), ``p<pos>.<generator>.latents`` / ``.noise`` float32 and
  ``.timesteps`` int64 (a generator with a VAE: ``.pixels`` uint8 ``[G, 3, S, S]`` and
  ``.eps`` float32 instead of ``.latents``), and every other encoder's items (audio,
  video, a second image encoder; ``ir.modal``): ``p<pos>.in.<encoder>.<k>`` float32 or
  uint8 of the shape its sizes give.

Each position's sizes travel too (``sizes.*``): the text, images, places, trained
ranges, packed documents, generation counts and, per encoder with items of its own,
``sizes.in.<encoder>.count`` (items per position), ``.shape`` (each item's shape),
``.at`` (its place) and ``.doc`` (per document of a packed sequence).

A ``progress`` message (kind ``"progress"``, published by trainer rank 0) says
``meta["next_step"]``: the step the trainers need next; ``meta["done"]`` is true once they
have finished; ``meta["session"]``: a token drawn by each start of the trainers (a torchrun
restart or a resumed run draws a new one, and the workers then send again from
``next_step``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["BATCH", "PROGRESS", "batch_message", "read_batch"]

BATCH = "batch"
PROGRESS = "progress"


def _array(x: Any) -> np.ndarray:
    if hasattr(x, "numpy"):     # a torch tensor
        return x.detach().contiguous().numpy()
    return np.ascontiguousarray(x)


def batch_message(step: int, routing: Sequence[Any], normalizer: Any, samples: Mapping[int, Any],
                  units: Sequence[str], keys: Sequence[str] | None,
                  sizes: Sequence[Any] = ()) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The meta and arrays of one ``batch`` message. ``routing``: ``StepSamples`` per
    microbatch step; ``samples``: position -> an object with ``tokens``, ``images`` and
    ``gen`` (name -> latents/noise/timesteps), numpy or torch, each possibly empty;
    ``sizes``: every position's ``SampleSizes`` (a few integers each: every rank gets
    them, the shapes of what ranks exchange follow from them)."""
    order = [i for s in routing for i in s.sample_ids]
    arrays: dict[str, np.ndarray] = {
        "order": np.asarray(order, dtype=np.int64),
        "counts": np.asarray([len(s.sample_ids) for s in routing], dtype=np.int64)}
    if sizes:
        arrays["sizes.text"] = np.asarray([z.text_tokens for z in sizes], dtype=np.int64)
        arrays["sizes.images"] = np.asarray([len(z.image_shapes) for z in sizes],
                                            dtype=np.int64)
        arrays["sizes.hw"] = np.asarray([hw for z in sizes for hw in z.image_shapes],
                                        dtype=np.int64).reshape(-1, 2)
        arrays["sizes.at"] = np.asarray([p for z in sizes for p in z.places], dtype=np.int64)
        arrays["sizes.ntrained"] = np.asarray([len(z.trained_ranges) for z in sizes],
                                              dtype=np.int64)
        arrays["sizes.trained"] = np.asarray([r for z in sizes for r in z.trained_ranges],
                                             dtype=np.int64).reshape(-1, 2)
        arrays["sizes.cut"] = np.asarray([z.cut for z in sizes], dtype=np.int64)
        # packed sequences: per position its documents (0: one document, not packed)
        arrays["sizes.ndocs"] = np.asarray([len(z.doc_text) if z.doc_text is not None else 0
                                            for z in sizes], dtype=np.int64)
        arrays["sizes.doc_text"] = np.asarray([n for z in sizes for n in z.doc_text or ()],
                                              dtype=np.int64)
        arrays["sizes.doc_images"] = np.asarray([n for z in sizes for n in z.doc_images or ()],
                                                dtype=np.int64)
        for name in sorted({g for z in sizes for g in z.doc_gen or {}}):
            arrays[f"sizes.doc_gen.{name}"] = np.asarray(
                [n for z in sizes if z.doc_gen is not None for n in z.doc_gen.get(name, ())],
                dtype=np.int64)
        for name in sorted({g for z in sizes for g in z.gen_counts}):
            arrays[f"sizes.gen.{name}"] = np.asarray([z.gen_counts.get(name, 0)
                                                      for z in sizes], dtype=np.int64)
        for name in sorted({k for z in sizes for k in z.inputs}):
            arrays.update(_input_sizes(name, sizes))
    for unit in units:
        arrays[f"assign.{unit}"] = np.asarray(
            [r for s in routing for r in s.assignment[unit]], dtype=np.int64)
    if keys is not None:
        arrays["keys"] = np.frombuffer("\n".join(keys).encode(), dtype=np.uint8)
    for pos, s in samples.items():
        if s.tokens is not None:
            arrays[f"p{pos}.tokens"] = _array(s.tokens).astype(np.int64, copy=False)
        for k, image in enumerate(s.images or ()):
            arrays[f"p{pos}.img{k}"] = _array(image)
        for name, items in (getattr(s, "inputs", None) or {}).items():
            for k, item in enumerate(items):
                arrays[f"p{pos}.in.{name}.{k}"] = _array(item)
        for name, t in (s.gen or {}).items():
            if t.latents is not None:
                arrays[f"p{pos}.{name}.latents"] = _array(t.latents)
            else:           # a VAE generator: its images (uint8) and posterior noise
                arrays[f"p{pos}.{name}.pixels"] = _array(t.pixels)
                arrays[f"p{pos}.{name}.eps"] = _array(t.eps)
            arrays[f"p{pos}.{name}.noise"] = _array(t.noise)
            arrays[f"p{pos}.{name}.timesteps"] = _array(t.timesteps).astype(np.int64,
                                                                            copy=False)
    meta = {"step": step, "norm": [int(normalizer.text_tokens), int(normalizer.gen_targets)],
            "positions": sorted(int(p) for p in samples),
            "parts": sorted({p for s in samples.values() for p in s.parts})}
    return meta, arrays


def _input_sizes(name: str, sizes: Sequence[Any]) -> dict[str, np.ndarray]:
    """The ``sizes.in.<name>.*`` arrays of encoder ``name``'s items."""
    shapes = [tuple(x) for z in sizes for x in z.inputs.get(name, ())]
    ndim = len(shapes[0]) if shapes else 0
    if any(len(x) != ndim for x in shapes):
        raise ValueError(f"encoder {name}'s items have shapes of different ranks")
    return {
        f"sizes.in.{name}.count": np.asarray([len(z.inputs.get(name, ())) for z in sizes],
                                             dtype=np.int64),
        f"sizes.in.{name}.shape": np.asarray(shapes, dtype=np.int64).reshape(len(shapes),
                                                                             ndim),
        f"sizes.in.{name}.at": np.asarray([p for z in sizes for p in z.input_places(name)],
                                          dtype=np.int64),
        f"sizes.in.{name}.doc": np.asarray(
            [n for z in sizes if z.doc_inputs is not None
             for n in z.doc_inputs.get(name, (0,) * len(z.doc_text))], dtype=np.int64)}


def _read_input_sizes(arrays: Mapping[str, np.ndarray], units: Sequence[str], n: int,
                      ndocs: Sequence[int], step: int) -> list[dict[str, Any]]:
    """Per position, its ``SampleSizes`` fields of the encoders with items of their own
    (``inputs``, ``inputs_at``, ``doc_inputs``): only the plan's units are read."""
    out: list[dict[str, Any]] = [{"inputs": {}, "inputs_at": {}, "doc_inputs": {}}
                                 for _ in range(n)]
    for name in units:
        if f"sizes.in.{name}.count" not in arrays:
            continue
        counts = arrays[f"sizes.in.{name}.count"].tolist()
        shapes = [tuple(x) for x in arrays[f"sizes.in.{name}.shape"].tolist()]
        places = arrays[f"sizes.in.{name}.at"].tolist()
        docs = arrays[f"sizes.in.{name}.doc"].tolist()
        if len(counts) != n or sum(counts) != len(shapes) or len(places) != len(shapes) \
                or len(docs) != sum(ndocs) or any(d < 0 for s in shapes for d in s) \
                or any(c < 0 for c in counts):
            raise ValueError(f"step {step}: inconsistent sizes of encoder {name}'s items")
        at = d = 0
        for i, c in enumerate(counts):
            out[i]["inputs"][name] = tuple(shapes[at:at + c])
            out[i]["inputs_at"][name] = tuple(places[at:at + c])
            if ndocs[i]:
                out[i]["doc_inputs"][name] = tuple(docs[d:d + ndocs[i]])
            at, d = at + c, d + ndocs[i]
    for fields in out:
        if not fields["doc_inputs"]:
            fields["doc_inputs"] = None
    return out


def _read_items(message: Any, pos: int, sizes: Any, step: int) -> dict[str, tuple]:
    """Position ``pos``'s items of every encoder with items of its own, each checked
    against the shape its sizes give (float32 or uint8)."""
    arrays = message.arrays
    out = {}
    for name, shapes in (sizes.inputs if sizes is not None else {}).items():
        if f"p{pos}.in.{name}.0" not in arrays and shapes:
            continue            # a part this rank does not read
        items = []
        for k, shape in enumerate(shapes):
            key = f"p{pos}.in.{name}.{k}"
            item = arrays.get(key)
            if item is None or tuple(item.shape) != tuple(shape) or \
                    item.dtype not in (np.uint8, np.float32):
                raise ValueError(f"step {step}: item {key} is "
                                 f"{'missing' if item is None else (item.dtype, item.shape)}"
                                 f": expected uint8 or float32 {tuple(shape)}")
            items.append(message.tensor(key))
        if f"p{pos}.in.{name}.{len(shapes)}" in arrays:
            raise ValueError(f"step {step}: more items of {name} at p{pos} than its sizes")
        out[name] = tuple(items)
    return out


def read_batch(message: Any, units: Sequence[str], generators: Sequence[str]) -> Any:
    """The ``runtime.batch.StepBatch`` of a valid ``batch`` message (images as sent: uint8
    pixels the encoder's device normalises, ``models.inputs.Pixels``, or the synthetic
    data's float32). ValueError when it is inconsistent (a worker bug or a mismatched
    bundle)."""
    from dtdsl.data.batch import StepBatch
    from dtdsl.models.multimodal import Normalizer

    meta, arrays = message.meta, message.arrays
    step = int(meta["step"])
    routing = _read_routing(arrays, units, step)
    keys: tuple[str, ...] = ()
    if "keys" in arrays:
        keys = tuple(arrays["keys"].tobytes().decode().split("\n"))
    sizes = _read_sizes(arrays, units, generators, step) if "sizes.text" in arrays else []
    parts = set(meta["parts"])
    samples = {int(pos): _read_sample(message, int(pos), parts, generators,
                                      sizes[int(pos)] if sizes else None, step)
               for pos in meta["positions"]}
    norm = meta["norm"]
    return StepBatch(step=step, keys=keys, routing=routing, samples=samples,
                     normalizer=Normalizer(text_tokens=int(norm[0]), gen_targets=int(norm[1])),
                     sizes=tuple(sizes))


def _read_routing(arrays: Mapping[str, Any], units: Sequence[str], step: int
                  ) -> tuple[Any, ...]:
    """The step's routing: per microbatch step, its samples and every unit's replica of each."""
    from dtdsl.parallel.broker import StepSamples

    order = arrays["order"].tolist()
    counts = arrays["counts"].tolist()
    if sum(counts) != len(order):
        raise ValueError(f"step {step}: routing counts {counts} do not add up to "
                         f"{len(order)} positions")
    assign = {u: arrays[f"assign.{u}"].tolist() for u in units}
    routing, at = [], 0
    for c in counts:
        routing.append(StepSamples(sample_ids=tuple(order[at:at + c]),
                                   assignment={u: tuple(a[at:at + c])
                                               for u, a in assign.items()}))
        at += c
    return tuple(routing)


def _read_sizes(arrays: Mapping[str, Any], units: Sequence[str], generators: Sequence[str],
                step: int) -> list[Any]:
    """Every sample's ``SampleSizes`` (its text, images and their places, trained ranges,
    packed documents and every encoder's inputs), checked for consistency."""
    from dtdsl.ir.sizes import SampleSizes

    text, counts_img = arrays["sizes.text"].tolist(), arrays["sizes.images"].tolist()
    hw = [tuple(x) for x in arrays["sizes.hw"].reshape(-1, 2).tolist()]
    if len(counts_img) != len(text) or sum(counts_img) != len(hw):
        raise ValueError(f"step {step}: inconsistent sample sizes")
    places = arrays["sizes.at"].tolist()
    ntrained = arrays["sizes.ntrained"].tolist()
    ranges = [tuple(r) for r in arrays["sizes.trained"].reshape(-1, 2).tolist()]
    if len(places) != len(hw) or len(ntrained) != len(text) or \
            sum(ntrained) != len(ranges):
        raise ValueError(f"step {step}: inconsistent sample layouts")
    gens = {name: arrays[f"sizes.gen.{name}"].tolist() for name in generators
            if f"sizes.gen.{name}" in arrays}
    ndocs = arrays["sizes.ndocs"].tolist()
    cut = arrays["sizes.cut"].tolist()
    doc_text = arrays["sizes.doc_text"].tolist()
    doc_images = arrays["sizes.doc_images"].tolist()
    doc_gen = {name: arrays[f"sizes.doc_gen.{name}"].tolist() for name in generators
               if f"sizes.doc_gen.{name}" in arrays}
    if len(ndocs) != len(text) or len(doc_text) != sum(ndocs) or \
            len(doc_images) != sum(ndocs):
        raise ValueError(f"step {step}: inconsistent packed sequences")
    per_input = _read_input_sizes(arrays, units, len(text), ndocs, step)
    sizes = []
    at = r = d = 0
    for i, (t, c) in enumerate(zip(text, counts_img, strict=True)):
        n = ndocs[i]
        docs = {}
        if n:
            docs = dict(doc_text=tuple(doc_text[d:d + n]),
                        doc_images=tuple(doc_images[d:d + n]),
                        doc_gen={g: tuple(v[d:d + n]) for g, v in doc_gen.items()})
        sizes.append(SampleSizes(text_tokens=int(t), image_shapes=tuple(hw[at:at + c]),
                                 gen_counts={g: int(v[i]) for g, v in gens.items()},
                                 image_at=tuple(places[at:at + c]),
                                 trained=tuple(ranges[r:r + ntrained[i]]), cut=cut[i],
                                 **docs, **per_input[i]))
        at, r, d = at + c, r + ntrained[i], d + n
    return sizes


def _read_sample(message: Any, pos: int, parts: set[str], generators: Sequence[str],
                 layout: Any, step: int) -> Any:
    """The ``Sample`` at position ``pos`` of the message: its tokens, images (uint8 or
    float32 [3, H, W]), generator targets and other encoders' items, laid out by
    ``layout`` (its ``SampleSizes``, None when the message carries none)."""
    import torch

    from dtdsl.models.inputs import GenTargets, Sample

    arrays = message.arrays
    tokens = (message.tensor(f"p{pos}.tokens") if "tokens" in parts
              else torch.empty(0, dtype=torch.int64))
    images = []
    k = 0
    while f"p{pos}.img{k}" in arrays:
        image = arrays[f"p{pos}.img{k}"]
        if image.ndim != 3 or image.shape[0] != 3 or \
                image.dtype not in (np.uint8, np.float32):
            raise ValueError(f"step {step}: image p{pos}.img{k} of dtype {image.dtype} "
                             f"and shape {image.shape}: expected uint8 or float32 "
                             "[3, H, W]")
        images.append(message.tensor(f"p{pos}.img{k}"))
        k += 1
    targets = {}
    if "targets" in parts:
        for name in generators:
            def opt(field: str, prefix: str = f"p{pos}.{name}") -> Any:
                key = f"{prefix}.{field}"
                return message.tensor(key) if key in arrays else None

            targets[name] = GenTargets(latents=opt("latents"),
                                       noise=message.tensor(f"p{pos}.{name}.noise"),
                                       timesteps=message.tensor(f"p{pos}.{name}.timesteps"),
                                       pixels=opt("pixels"), eps=opt("eps"))
    inputs = _read_items(message, pos, layout, step)
    return Sample(step=step, index=pos, tokens=tokens,
                  images=tuple(images), targets=targets,
                  image_at=layout.image_at if layout else None,
                  trained=layout.trained if layout else None,
                  doc_text=layout.doc_text if layout else None,
                  doc_images=layout.doc_images if layout else None,
                  doc_gen=layout.doc_gen if layout else None,
                  inputs=inputs,
                  inputs_at=layout.inputs_at if layout and inputs else None,
                  doc_inputs=layout.doc_inputs if layout and inputs else None)
