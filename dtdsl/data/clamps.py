"""The spec's clamps on real samples: one rule for what a run does with a sample whose
sizes lie outside them, used by the run's sources (``feed.source.DatasetSource``: the
workers, the in-process feed and ``dtc reference`` alike) and by ``dtc check``, which
counts such samples and says what happens to them (``DT505``).

The planner and the cost model see the spec's distributions within their clamps, so a
sample above a clamp's high is made to fit it, the way the spec says:

- ``text.tokens`` above ``HIGH``: its first ``HIGH`` text tokens are kept, with the images
  placed among them; the images after the cut and the text after it are dropped (the
  rule ``ir.layout.fit`` has for ``seq_len``);
- ``image.count`` above ``HIGH``: its first ``HIGH`` images are kept, the others dropped;
  ``audio.count`` and ``video.count`` likewise for the clips of the encoders of that
  modality (a clip placed after a ``text.tokens`` cut goes with the text after it); a
  second encoder of a modality (``data.decode``: it reads the same items) keeps the same
  ones;
- ``image.gen_count`` / ``audio.gen_count`` above ``HIGH``: its first ``HIGH`` targets are
  kept;
- ``image.patches`` above ``HIGH`` (an encoder of native resolution): the image is
  resized down to at most ``HIGH`` patches (``images.ImagePolicy``), as it always was;
  an encoder of fixed size (a Hugging Face tower) reads its own size whatever the clamp.

A sample below a clamp's low is used as it is: nothing is padded or made up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dtdsl.ir import program as ir

if TYPE_CHECKING:
    from dtdsl.ir.sizes import SampleSizes

__all__ = ["Clamps", "Outside", "what_happens"]


def _bounds(data: ir.Data, key: str) -> tuple[int | None, int | None]:
    modality, name = key.split(".")
    q = data.get(modality, name)
    if q is None:
        return None, None
    low = int(q.low) if q.low is not None else None
    # A fractional high keeps the whole values below it (clamp [0, 2.5]: 2 images).
    high = int(q.high) if q.high is not None else None
    return low, high


@dataclass(frozen=True)
class Outside:
    """How many samples lie outside one clamp, above and below it."""

    key: str                         # the quantity, e.g. "image.count"
    low: int | None
    high: int | None
    above: int = 0
    below: int = 0


@dataclass(frozen=True)
class Clamps:
    """A spec's clamps as its runs apply them (module docstring)."""

    text: tuple[int | None, int | None] = (None, None)
    images: tuple[int | None, int | None] = (None, None)      # input images per sample
    gen: Mapping[str, tuple[str, int | None, int | None]] = field(default_factory=dict)
    # generator name -> (its quantity, low, high)
    inputs: Mapping[str, tuple[int | None, int | None]] = field(default_factory=dict)
    # name of an encoder whose items are ``inputs`` -> its modality's count clamp

    @classmethod
    def for_program(cls, program: ir.Program) -> Clamps:
        reads_images = any(m.modality == "image" for m in program.encoders)
        gen = {}
        for g in program.generators:
            key = f"{g.modality}.gen_count"
            gen[g.name] = (key, *_bounds(program.data, key))
        # the first image encoder's items are the images (``images`` above)
        first_image = next((m for m in program.encoders if m.modality == "image"), None)
        inputs = {m.name: _bounds(program.data, f"{m.modality}.count")
                  for m in program.encoders if m is not first_image}
        return cls(text=_bounds(program.data, "text.tokens"),
                   images=_bounds(program.data, "image.count") if reads_images
                   else (None, None), gen=gen, inputs=inputs)

    def apply(self, sizes: SampleSizes) -> SampleSizes:
        """One sample's sizes (not a packed sequence) within the clamps' highs."""
        images, places = sizes.image_shapes, sizes.places
        trained, text = sizes.trained_ranges, sizes.text_tokens
        if self.images[1] is not None and len(images) > self.images[1]:
            images, places = images[:self.images[1]], places[:self.images[1]]
        if self.text[1] is not None and text > self.text[1]:
            text = self.text[1]
            n = sum(1 for p in places if p <= text)     # places never decrease
            images, places = images[:n], places[:n]
            trained = tuple((a, min(b, text)) for a, b in trained if a < text)
        gen = {g: min(c, self.gen[g][2]) if g in self.gen and self.gen[g][2] is not None
               else c for g, c in sizes.gen_counts.items()}
        inputs, inputs_at = dict(sizes.inputs), {k: sizes.input_places(k) for k in sizes.inputs}
        for name, shapes in sizes.inputs.items():
            n = len(shapes)
            high = self.inputs.get(name, (None, None))[1]
            if high is not None:
                n = min(n, high)
            n = min(n, sum(1 for p in inputs_at[name] if p <= text))
            inputs[name], inputs_at[name] = shapes[:n], inputs_at[name][:n]
        if (text, images, gen, inputs) == (sizes.text_tokens, sizes.image_shapes,
                                           sizes.gen_counts, sizes.inputs):
            return sizes
        return replace(sizes, text_tokens=text, image_shapes=images, image_at=places,
                       trained=trained, gen_counts=gen, inputs=inputs, inputs_at=inputs_at)

    def count(self, samples: list[tuple[int, int, Mapping[str, int]]]) -> list[Outside]:
        """Per clamped quantity, how many of ``samples`` (each: text tokens, input images,
        targets per generator) lie above and below it; only quantities some sample
        lies outside of."""
        out = []
        checks: list[tuple[str, tuple[int | None, int | None], Any]] = [
            ("text.tokens", self.text, lambda s: s[0]),
            ("image.count", self.images, lambda s: s[1])]
        seen = set()
        for g, (key, low, high) in sorted(self.gen.items()):
            if key not in seen:
                seen.add(key)
                checks.append((key, (low, high), lambda s, g=g: s[2].get(g, 0)))
        for key, (low, high), value in checks:
            above = sum(1 for s in samples if high is not None and value(s) > high)
            below = sum(1 for s in samples if low is not None and value(s) < low)
            if above or below:
                out.append(Outside(key=key, low=low, high=high, above=above, below=below))
        return out


def what_happens(o: Outside) -> str:
    """What a run does with the samples above ``o``'s clamp (the module's rules)."""
    def first(n: int | None, word: str) -> str:
        return f"{n} {word}" if n == 1 else f"first {n} {word}s"

    if o.key == "text.tokens":
        return (f"each is cut to its {first(o.high, 'text token')} (with the images placed "
                "among them; the rest is not trained)")
    if o.key == "image.count":
        return f"each keeps its {first(o.high, 'image')}; the others are dropped"
    if o.key == "image.patches":
        return f"each such image is resized down to at most {o.high} patches"
    return f"each keeps its {first(o.high, 'target')}; the others are dropped"

