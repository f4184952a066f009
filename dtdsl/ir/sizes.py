"""A sample's sizes without its tensors (``SampleSizes``): what the cost model, the
layout rule (``ir.layout``), the loss denominators and the runtime's routing share, so
it lives below all of them and imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SampleSizes"]


@dataclass(frozen=True)
class SampleSizes:
    """The sizes of one sample, drawn without building any tensor (``make_sample`` draws
    exactly these): enough for the loss denominators (``loss_normalizer_of_sizes``)."""

    text_tokens: int                    # len(tokens)
    image_shapes: tuple[tuple[int, int], ...]   # each image's (height, width)
    gen_counts: dict[str, int]          # generator name -> G
    # Where the images go and what the loss trains on (``data.text.TokenLayout``): per
    # image, the text tokens before it; text-token ranges [a, b) that are next-token
    # targets. Left out: every image before the text, every text token but the first
    # trained (synthetic samples).
    image_at: tuple[int, ...] | None = None
    trained: tuple[tuple[int, int], ...] | None = None
    # A packed sequence (``ir.layout.pack``) of several samples, its documents: per
    # document its text tokens, its images and per generator its targets, in order (all
    # the sample's text, images and targets, the documents' one after the other). None:
    # one document.
    doc_text: tuple[int, ...] | None = None
    doc_images: tuple[int, ...] | None = None
    doc_gen: dict[str, tuple[int, ...]] | None = None
    cut: int = 0        # how many of its samples were cut to seq_len (``ir.layout.fit``)
    # Every encoder's items but the image encoder's (``ir.modal.EncoderInputs``): per
    # encoder name, each item's tensor shape (audio ``(T, M)``, video ``(F, 3, H, W)``),
    # where each goes (text tokens before it; left out: before the text) and, in a packed
    # sequence, how many each document has.
    inputs: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    inputs_at: dict[str, tuple[int, ...]] | None = None
    doc_inputs: dict[str, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if self.inputs_at is None:
            object.__setattr__(self, "inputs_at", {k: (0,) * len(v)
                                                   for k, v in self.inputs.items()})
        if self.doc_text is not None and self.doc_inputs is None:
            if any(self.inputs.values()):
                raise ValueError("a packed sequence with encoder inputs needs doc_inputs")
            object.__setattr__(self, "doc_inputs", {k: (0,) * len(self.doc_text)
                                                    for k in self.inputs})
        for k, v in self.inputs.items():
            if len(self.input_places(k)) != len(v):
                raise ValueError(f"{len(v)} items of {k} but {len(self.input_places(k))} "
                                 "places")
        if self.image_at is None:
            object.__setattr__(self, "image_at", (0,) * len(self.image_shapes))
        if self.trained is None:
            object.__setattr__(self, "trained", ((1, self.text_tokens),)
                               if self.text_tokens > 1 else ())
        if len(self.image_at) != len(self.image_shapes):
            raise ValueError(f"{len(self.image_shapes)} images but {len(self.image_at)} "
                             "image places")
        if self.doc_text is not None:
            assert self.doc_images is not None and self.doc_gen is not None
            if sum(self.doc_text) != self.text_tokens or \
                    sum(self.doc_images) != len(self.image_shapes) or \
                    len(self.doc_images) != len(self.doc_text) or any(
                        sum(c) != self.gen_counts.get(g, 0) or len(c) != len(self.doc_text)
                        for g, c in self.doc_gen.items()) or any(
                        sum(self.doc_inputs.get(k, ())) != len(v) or
                        len(self.doc_inputs.get(k, ())) != len(self.doc_text)
                        for k, v in self.inputs.items() if v):
                raise ValueError("the documents of a packed sequence do not add up to it")

    @property
    def num_docs(self) -> int:
        return 1 if self.doc_text is None else len(self.doc_text)

    def docs(self) -> list[SampleSizes]:
        """The documents of a packed sequence, each as its own sizes (itself when it is
        one document)."""
        if self.doc_text is None:
            return [self]
        assert self.doc_images is not None and self.doc_gen is not None
        out, t0, i0 = [], 0, 0
        doc_inputs = self.doc_inputs or {}
        k0 = dict.fromkeys(self.inputs, 0)
        for d, (nt, ni) in enumerate(zip(self.doc_text, self.doc_images, strict=True)):
            trained = tuple((max(a, t0) - t0, min(b, t0 + nt) - t0) for a, b in self.trained_ranges
                            if a < t0 + nt and b > t0)
            nk = {k: doc_inputs[k][d] if k in doc_inputs else 0 for k in self.inputs}
            out.append(SampleSizes(
                text_tokens=nt, image_shapes=self.image_shapes[i0:i0 + ni],
                gen_counts={g: c[d] for g, c in self.doc_gen.items()},
                image_at=tuple(p - t0 for p in self.places[i0:i0 + ni]), trained=trained,
                inputs={k: v[k0[k]:k0[k] + nk[k]] for k, v in self.inputs.items()},
                inputs_at={k: tuple(p - t0 for p in self.input_places(k)[k0[k]:k0[k] + nk[k]])
                           for k in self.inputs}))
            t0, i0 = t0 + nt, i0 + ni
            k0 = {k: k0[k] + nk[k] for k in self.inputs}
        return out

    @property
    def num_gen_targets(self) -> int:
        return sum(self.gen_counts.values())

    @property
    def places(self) -> tuple[int, ...]:
        """Per image: how many text tokens come before it."""
        assert self.image_at is not None
        return self.image_at

    def input_places(self, name: str) -> tuple[int, ...]:
        """Per item of encoder ``name`` (an ``inputs`` key): the text tokens before it."""
        assert self.inputs_at is not None
        return self.inputs_at.get(name, ())

    @property
    def num_items(self) -> int:
        """Every encoder's items: the images and the ``inputs``."""
        return len(self.image_shapes) + sum(len(v) for v in self.inputs.values())

    @property
    def trained_ranges(self) -> tuple[tuple[int, int], ...]:
        """Text-token ranges ``[a, b)`` whose tokens are next-token targets."""
        assert self.trained is not None
        return self.trained
