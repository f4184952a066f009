"""Where a sample's tokens and its encoders' items sit in the backbone's sequence, and which
positions carry a loss: one rule for the data layer, the model, the runtime and the loss
denominators.

A sample is its text tokens ``0..T-1`` with items inserted: image ``k`` (of ``N_k``
tokens: its patches as the projector compresses them, ``ir.program.ImageTokens``) goes
before text token ``image_at[k]`` (``T``: after the text), and so does every other
encoder's item ``k`` (audio, video, a second image encoder: ``inputs_at[name][k]``, its
tokens ``ir.modal.InputRule.tokens``). The backbone's sequence lays them out in that
order; items before the same text token go in the encoders' spec order, each encoder's
in its own order (``placements``). Below, "image" means any encoder's item. ``trained``
names the text tokens that are next-token targets; each is predicted at the position
just before it (an image's last token when it follows one), and a token at the sequence's
first position is never a target (nothing precedes it).

A sample longer than ``seq_len`` is cut at ``seq_len``: text tokens up to the cut stay, an
image that does not fit whole is dropped with everything after it (``fit``; a sample whose
first image alone does not fit keeps its text, without images). The data
sources fit their samples before anything is routed, so the encoders never see an image
the backbone drops, and ``SequenceLayout.cut`` says that a sample was cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dtdsl.ir.modal import EncoderInputs
from dtdsl.ir.program import ImageTokens

if TYPE_CHECKING:
    from dtdsl.ir.sizes import SampleSizes

__all__ = ["Packer", "SequenceLayout", "Tokens", "concat", "fit", "layout_of", "pack", "placements",
           "sequence_layout"]

# What gives an item its tokens: every encoder's rule, or (a program with one image
# encoder) the image rule alone.
Tokens = EncoderInputs | ImageTokens


@dataclass(frozen=True)
class SequenceLayout:
    """One sample in the backbone's sequence."""

    length: int                             # positions it takes
    text: int                               # text tokens kept (a prefix of the text)
    image_tokens: tuple[int, ...]           # per kept image (a prefix): its tokens
    image_starts: tuple[int, ...]           # per kept image: its first position
    text_runs: tuple[tuple[int, int, int], ...]   # (first token, stop, first position)
    loss: tuple[tuple[int, int], ...]       # text-token ranges [a, b) with a target
    cut: bool                               # the sample was longer than seq_len
    # A packed sequence's documents: (first position, length) each; they attend only
    # within themselves and their positions restart at 0. Empty: one document.
    docs: tuple[tuple[int, int], ...] = ()
    # Per kept item (the ``image_tokens`` order): its encoder's key (``placements``) and
    # its index among that encoder's items. Empty: images only, in their order.
    items: tuple[tuple[str, int], ...] = ()

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """(first position, length) of each document (the whole sequence when one)."""
        return self.docs or ((0, self.length),)

    @property
    def loss_tokens(self) -> int:
        return sum(b - a for a, b in self.loss)

    def position(self, token: int) -> int:
        """The position of kept text token ``token``."""
        for first, stop, at in self.text_runs:
            if first <= token < stop:
                return at + token - first
        raise IndexError(f"text token {token} is not kept")

    def loss_positions(self) -> list[tuple[int, int]]:
        """Ranges of positions that predict a target (each just before its token)."""
        out = []
        for a, b in self.loss:
            for first, stop, at in self.text_runs:
                lo, hi = max(a, first), min(b, stop)
                if lo < hi:
                    out.append((at + lo - first - 1, at + hi - first - 1))
        return out


def sequence_layout(text_tokens: int, image_tokens: Sequence[int], image_at: Sequence[int],
                    trained: Sequence[tuple[int, int]], seq_len: int) -> SequenceLayout:
    """The layout of one sample (module docstring)."""
    if len(image_at) != len(image_tokens):
        raise ValueError(f"{len(image_tokens)} images but {len(image_at)} image places")
    pos = prev = 0
    starts: list[int] = []
    runs: list[tuple[int, int, int]] = []
    cut = False

    def text_until(stop: int) -> bool:
        nonlocal pos, prev
        take = min(stop - prev, seq_len - pos)
        if take > 0:
            runs.append((prev, prev + take, pos))
        pos, prev = pos + max(take, 0), prev + max(take, 0)
        return prev == stop

    for n, at in zip(image_tokens, image_at, strict=True):
        if not text_until(at) or pos + n > seq_len:
            cut = True
            break
        starts.append(pos)
        pos += n
    else:
        cut = not text_until(text_tokens)
    kept = prev
    loss = []
    for a, b in trained:
        a, b = max(a, 0), min(b, kept)
        # The sequence's first position predicts nothing: a token there has no target.
        if runs and runs[0][2] == 0 and a == runs[0][0]:
            a += 1
        if a < b:
            loss.append((a, b))
    return SequenceLayout(length=pos, text=kept, image_tokens=tuple(image_tokens[:len(starts)]),
                          image_starts=tuple(starts), text_runs=tuple(runs),
                          loss=tuple(loss), cut=cut)


def placements(sizes: SampleSizes, tokens: Tokens) -> list[tuple[str, int, int, int]]:
    """Every item of a sample (not of a packed sequence) in the order the sequence holds
    them: ``(encoder key, index among its items, text tokens before it, tokens)``. The
    key of the ``images`` is ``tokens.image`` (``""`` with a bare ``ImageTokens``), of the
    ``inputs`` their encoder's name. Items before the same text token go in the encoders'
    spec order; one encoder's keep their order."""
    rules = tokens if isinstance(tokens, EncoderInputs) else EncoderInputs.of_image(tokens)
    image = rules.image if rules.image is not None else ""
    out = [(image, k, at, rules(h, w)) for k, ((h, w), at)
           in enumerate(zip(sizes.image_shapes, sizes.places, strict=True))]
    if not sizes.inputs:
        return out
    order = {r.name: i for i, r in enumerate(rules.rules)}
    for name, shapes in sizes.inputs.items():
        if name not in order or name == image:
            raise ValueError(f"the sample has items of '{name}', which is not an encoder "
                             f"whose items are inputs (encoders: {sorted(order)})")
        rule = rules.rule(name)
        out += [(name, k, at, rule.tokens(shape)) for k, (shape, at)
                in enumerate(zip(shapes, sizes.input_places(name), strict=True))]
    return sorted(out, key=lambda x: (x[2], order.get(x[0], -1), x[1]))


def layout_of(sizes: SampleSizes, tokens: Tokens, seq_len: int) -> SequenceLayout:
    """The layout of a sample from its sizes (``tokens``: every encoder's rule,
    ``ir.modal.encoder_inputs``, or an image's tokens alone, ``Program.image_tokens``);
    of a packed sequence, its documents' layouts one after the other."""
    if sizes.doc_text is None:
        items = placements(sizes, tokens)
        lay = sequence_layout(sizes.text_tokens, [n for *_, n in items],
                              [at for _, _, at, _ in items], sizes.trained_ranges, seq_len)
        if not sizes.inputs:
            return lay
        return replace(lay, items=tuple((key, k) for key, k, _, _ in
                                        items[:len(lay.image_starts)]))
    return concat([layout_of(d, tokens, seq_len) for d in sizes.docs()], seq_len)


def concat(layouts: Sequence[SequenceLayout], seq_len: int) -> SequenceLayout:
    """Documents packed one after the other in one sequence. ValueError when one was cut
    (documents are fitted before they are packed) or they do not fit together."""
    pos = text = 0
    image_tokens: list[int] = []
    starts: list[int] = []
    runs: list[tuple[int, int, int]] = []
    loss: list[tuple[int, int]] = []
    docs: list[tuple[int, int]] = []
    items: list[tuple[str, int]] = []
    seen: dict[str, int] = {}      # per encoder key: its items in the documents before
    for lay in layouts:
        if lay.cut or lay.docs:
            raise ValueError("only whole documents that fit in seq_len are packed")
        own = lay.items or tuple(("", k) for k in range(len(lay.image_tokens)))
        items.extend((key, k + seen.get(key, 0)) for key, k in own)
        for key, _ in own:
            seen[key] = seen.get(key, 0) + 1
        image_tokens.extend(lay.image_tokens)
        starts.extend(s + pos for s in lay.image_starts)
        runs.extend((a + text, b + text, at + pos) for a, b, at in lay.text_runs)
        loss.extend((a + text, b + text) for a, b in lay.loss)
        docs.append((pos, lay.length))
        pos, text = pos + lay.length, text + lay.text
    if pos > seq_len:
        raise ValueError(f"packed documents of {pos} positions exceed seq_len {seq_len}")
    return SequenceLayout(length=pos, text=text, image_tokens=tuple(image_tokens),
                          image_starts=tuple(starts), text_runs=tuple(runs), loss=tuple(loss),
                          cut=False, docs=tuple(docs),
                          items=tuple(items) if any(lay.items for lay in layouts) else ())


class Packer:
    """``pack``'s state, fed a part of the stream at a time: packing is a function of the
    stream, so feeding it in parts closes the same sequences as feeding it whole."""

    def __init__(self, seq_len: int, window: int = 16):
        self.seq_len, self.window = seq_len, window
        self.done: list[list[int]] = []         # closed sequences, in the order they closed
        self.open_rows: list[list[int]] = []
        self._room: list[int] = []
        self._fed = 0

    def feed(self, lengths: Iterable[int], rows: int | None = None) -> bool:
        """Pack the next documents of the stream (their indices count on from the last
        part's); True, with the rest not fed, once ``rows`` sequences have closed."""
        seq_len, room, open_rows = self.seq_len, self._room, self.open_rows
        for n in lengths:
            i = self._fed
            self._fed += 1
            if n > seq_len:
                raise ValueError(f"document {i} has {n} positions, more than seq_len "
                                 f"{seq_len}")
            k = next((k for k, r in enumerate(room) if r >= n), None)
            if k is None:
                open_rows.append([i])
                room.append(seq_len - n)
                if len(open_rows) > self.window:
                    self.done.append(open_rows.pop(0))
                    room.pop(0)
            else:
                open_rows[k].append(i)
                room[k] -= n
            if rows is not None and len(self.done) >= rows:
                return True
        return False


def pack(lengths: Iterable[int], seq_len: int, *, rows: int | None = None,
         window: int = 16) -> list[list[int]]:
    """Documents of these lengths (each at most ``seq_len``) packed into sequences of
    ``seq_len``, in stream order: each goes to the first open sequence it fits in, else
    opens one; with more than ``window`` open, the oldest is closed. Returns the
    sequences as lists of document indices, in the order they close (the open ones at
    the end, oldest first). With ``rows``, only closed sequences, at most that many,
    stopping once that many have closed: the documents still open are not used."""
    packer = Packer(seq_len, window)
    packer.feed(lengths, rows)
    # The stream ended (or ``rows`` closed): with ``rows``, only what closed (the caller
    # draws more); without, the open sequences too.
    return packer.done if rows is not None else packer.done + packer.open_rows


def fit(sizes: SampleSizes, tokens: Tokens, seq_len: int) -> SampleSizes:
    """``sizes`` of the sample cut to ``seq_len`` (itself when it fits). A sample whose
    sequence would be empty (its first item alone is longer than ``seq_len``) keeps its
    text without its items instead."""
    lay = layout_of(sizes, tokens, seq_len)
    if not lay.cut:
        return sizes
    if lay.length == 0 and sizes.text_tokens > 0 and (sizes.image_shapes or sizes.inputs):
        bare = replace(sizes, image_shapes=(), image_at=(),
                       inputs={k: () for k in sizes.inputs},
                       inputs_at={k: () for k in sizes.inputs})
        return replace(fit(bare, tokens, seq_len), cut=1)
    kept: dict[str, int] = {}
    for key, _ in lay.items:
        kept[key] = kept.get(key, 0) + 1
    # Images only: the layout names no keys, its items are the images.
    n = len(lay.image_starts) if not lay.items else \
        sum(c for key, c in kept.items() if key not in sizes.inputs)
    trained = tuple((a, min(b, lay.text)) for a, b in sizes.trained_ranges if a < lay.text)
    return replace(sizes, text_tokens=lay.text, image_shapes=sizes.image_shapes[:n],
                   image_at=sizes.places[:n], trained=trained, cut=1,
                   inputs={k: v[:kept.get(k, 0)] for k, v in sizes.inputs.items()},
                   inputs_at={k: sizes.input_places(k)[:kept.get(k, 0)]
                              for k in sizes.inputs})
