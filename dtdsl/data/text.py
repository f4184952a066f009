"""A sample's text as the backbone reads it: token ids, where its images go, and which tokens
the loss trains on.

``TokenLayout`` is that result for one sample: ``ids`` (the text's token ids, int64, no
placeholder ids), ``image_at`` (per image, how many text tokens come before it: its
embeddings are spliced in there) and ``trained`` (ranges ``[a, b)`` of text-token indices
whose tokens are next-token targets). The backbone's sequence is the text with each image's
embeddings inserted at its place; a trained token is predicted from the position before it
(an image's last patch, when the token follows an image), and a token at the sequence's
first position has nothing to be predicted from (``ir.layout.sequence_layout``).

Two tokenizers:

- ``HFTokenizer``: a ``tokenizer.json`` (or a Hugging Face directory holding one, with its
  ``tokenizer_config.json``) through the ``tokenizers`` package. The special tokens its
  post-processor adds (Llama's BOS) begin every sample, the config's ``eos_token`` ends a
  caption and every assistant turn. A caption (WebDataset ``txt``) is ``BOS, images,
  caption, EOS``, trained on the caption and EOS; an ``<image>`` in the text places an
  image there instead. A conversation (LLaVA's ``conversations``: ``human``/``gpt`` turns,
  optional ``system``) is rendered turn by turn with a ``ChatFormat`` (ChatML for Qwen,
  Llama 3's headers, or LLaVA-1.5's ``USER:``/``ASSISTANT:``; by default the one whose
  special tokens the tokenizer has) and trained on the assistant turns only: their text and
  their end token. Images without an ``<image>`` go at the start of the first user turn, as
  LLaVA puts them. Audio and video clips, for a spec with an encoder that reads them, are
  placed the same way by ``<audio>`` and ``<video>`` (``items``: their counts; per
  modality ``TokenLayout.items_at``); those without a placeholder go at the start too,
  after the images. Without such an encoder ``<audio>`` and ``<video>`` are plain text.
- ``HashTokenizer``: for synthetic data only (``dtc data synth`` and samples drawn from the
  spec): one id per word or punctuation mark, a hash modulo the vocabulary; images first,
  every token but the first trained.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dtdsl.data.shards import DatasetError, text_pieces, turn_text
from dtdsl.errors import DtdslError

__all__ = [
    "CHAT_FORMATS",
    "IMAGE_PLACEHOLDER",
    "PLACEHOLDERS",
    "ChatFormat",
    "HFTokenizer",
    "HashTokenizer",
    "TokenLayout",
    "TokenizerError",
    "conversation_of",
    "dataset_identity",
    "load_tokenizer",
    "item_counts",
    "token_layouts",
    "tokenizer_path",
]

IMAGE_PLACEHOLDER = "<image>"
PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "audio": "<audio>", "video": "<video>"}
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "system": "system"}


class TokenizerError(DtdslError, ValueError):
    """A tokenizer that cannot be loaded or used: the message says why."""


@dataclass(frozen=True, eq=False)
class TokenLayout:
    """One sample's text for the backbone (module docstring)."""

    ids: np.ndarray                             # [T] int64
    image_at: tuple[int, ...]                   # per image: text tokens before it
    trained: tuple[tuple[int, int], ...]        # text-token ranges [a, b) with a loss
    # per other modality read (audio, video): per clip, text tokens before it
    items_at: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.ids)
        for what, at in (("image", self.image_at), *self.items_at.items()):
            if any(not 0 <= p <= n for p in at) or list(at) != sorted(at):
                raise ValueError(f"{what} places {at} are not in order within {n} tokens")
        last = 0
        for a, b in self.trained:
            if not last <= a < b <= n:
                raise ValueError(f"trained ranges {self.trained} are not ordered, disjoint "
                                 f"ranges within {n} tokens")
            last = b

    def to_json(self) -> list[Any]:
        return [len(self.ids), list(self.image_at), [list(r) for r in self.trained]]


# ---- the hashing tokenizer (synthetic data) ------------------------------------------------

@dataclass(frozen=True)
class HashTokenizer:
    """A hashing tokenizer: each piece of ``shards.text_pieces`` (a word or a punctuation
    character) is one id, the first 8 bytes of its BLAKE2b digest modulo ``vocab``.
    Deterministic, no vocabulary file; different pieces may share an id. Only for
    synthetic data, whose text is words of a made-up language."""

    vocab: int
    _ids: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.vocab < 1:
            raise ValueError(f"vocab must be at least 1, not {self.vocab}")

    @property
    def fingerprint(self) -> str:
        return f"hash:{self.vocab}"

    def token_id(self, piece: str) -> int:
        found = self._ids.get(piece)
        if found is None:
            digest = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=8)
            found = self._ids[piece] = int.from_bytes(digest.digest(), "little") % self.vocab
        return found

    def encode(self, text: str) -> np.ndarray:
        """int64 ``[T]``: one id per piece of ``text``."""
        return np.fromiter(map(self.token_id, text_pieces(text)), dtype=np.int64)

    def layout(self, text: str, images: int, conversation: Sequence[Mapping[str, Any]] | None
               = None, items: Mapping[str, int] | None = None) -> TokenLayout:
        """Images (and clips) first, then the text, every text token but the first
        trained."""
        if conversation is not None:
            raise TokenizerError("conversations need a real tokenizer (the data block's "
                                 "`tokenizer`), not the hashing one of synthetic data")
        ids = self.encode(text)
        return TokenLayout(ids=ids, image_at=(0,) * images,
                           trained=((1, len(ids)),) if len(ids) > 1 else (),
                           items_at={k: (0,) * n for k, n in (items or {}).items()})


# ---- chat formats ------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatFormat:
    """How a conversation is written out: per role a header before its text and a footer
    after it; an assistant turn trains on its text and ``trained_footer`` (the end token),
    never on the header or the rest of the footer. ``{eos}`` stands for the tokenizer's
    end-of-sequence token."""

    name: str
    headers: Mapping[str, str]
    footers: Mapping[str, str]
    trained_footer: str            # the part of the assistant footer with a loss
    marker: str | None = None      # a special token that says a tokenizer uses this format


CHAT_FORMATS: dict[str, ChatFormat] = {f.name: f for f in (
    # Qwen's (and many others'): <|im_start|>role\n...<|im_end|>\n
    ChatFormat("chatml",
               headers={r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")},
               footers={r: "<|im_end|>\n" for r in ("system", "user", "assistant")},
               trained_footer="<|im_end|>", marker="<|im_start|>"),
    # Llama 3's
    ChatFormat("llama3",
               headers={r: f"<|start_header_id|>{r}<|end_header_id|>\n\n"
                        for r in ("system", "user", "assistant")},
               footers={r: "<|eot_id|>" for r in ("system", "user", "assistant")},
               trained_footer="<|eot_id|>", marker="<|start_header_id|>"),
    # LLaVA-1.5's (Vicuna v1): "SYSTEM USER: ... ASSISTANT: ...</s>"
    ChatFormat("llava",
               headers={"system": "", "user": "USER: ", "assistant": "ASSISTANT: "},
               footers={"system": " ", "user": " ", "assistant": "{eos}"},
               trained_footer="{eos}"),
)}


# ---- Hugging Face tokenizers ---------------------------------------------------------------

def tokenizer_path(path: str | Path) -> Path:
    """The ``tokenizer.json`` that ``path`` names (the file, or a directory holding it).
    TokenizerError when there is none."""
    p = Path(path).expanduser()
    if p.is_dir():
        found = p / "tokenizer.json"
        if found.is_file():
            return found
        if (p / "tokenizer.model").is_file():
            raise TokenizerError(
                f"{p} has a SentencePiece tokenizer.model but no tokenizer.json; write one "
                "with transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
        if found.exists():
            raise TokenizerError(f"{found} is not a regular file (a device, a socket?)")
        raise TokenizerError(f"{p} has no tokenizer.json")
    if p.is_file():
        return p
    if p.exists():
        raise TokenizerError(f"{p} is not a file or a folder (a device, a socket?)")
    raise TokenizerError(f"{p} does not exist")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass(frozen=True, eq=False)
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with what a sample's layout needs from its config."""

    path: Path                       # the tokenizer.json
    tokenizer: Any = field(repr=False)
    prefix: tuple[int, ...]          # what begins every sample (BOS)
    eos: int | None
    eos_text: str | None
    chat: ChatFormat
    fingerprint: str

    @classmethod
    def load(cls, path: str | Path, chat: str | None = None) -> HFTokenizer:
        """The tokenizer at ``path`` (module docstring); ``chat`` names a ``CHAT_FORMATS``
        entry (default: the one whose marker the vocabulary has, else ``llava``)."""
        from tokenizers import Tokenizer

        file = tokenizer_path(path)
        try:
            raw = file.read_bytes()
            tok = Tokenizer.from_str(raw.decode("utf-8"))
        except BaseException as err:
            if not _library_failure(err):
                raise
            raise TokenizerError(f"{file} is not a tokenizers tokenizer.json: {err}") from None
        # A file saved after a padded or truncated encode keeps those settings, and every
        # encode would honour them (pad ids between images, answers cut short); transformers
        # overrides them on each call, and so do we, once.
        reset = tok.padding is not None or tok.truncation is not None
        tok.no_padding()
        tok.no_truncation()
        config: dict[str, Any] = {}
        config_file = file.parent / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError, RecursionError) as err:
                raise TokenizerError(f"{config_file} is not readable JSON: {err}") from None
            if not isinstance(config, dict):
                raise TokenizerError(f"{config_file} is not a JSON object")
        # What the post-processor adds around a text (Llama's BOS): the library's own rule.
        bare = _encode(tok, "a", file).ids
        full = _encode(tok, "a", file, special=True).ids
        at = next((i for i in range(len(full) - len(bare) + 1)
                   if full[i:i + len(bare)] == bare), 0)
        prefix = list(full[:at])
        bos_text = _token_text(config.get("bos_token"))
        if config.get("add_bos_token") and bos_text is not None and not prefix:
            bos = tok.token_to_id(bos_text)
            if bos is not None:
                prefix = [bos]
        eos_text = _token_text(config.get("eos_token"))
        eos = tok.token_to_id(eos_text) if eos_text is not None else None
        if eos is None:       # a bare tokenizer.json: the end token its vocabulary has
            for guess in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"):
                eos = tok.token_to_id(guess)
                if eos is not None:
                    eos_text = guess
                    break
        if eos is None:
            eos_text = None
        vocab = tok.get_vocab(with_added_tokens=True)
        if chat is None:
            fmt = next((f for f in CHAT_FORMATS.values()
                        if f.marker is not None and f.marker in vocab), CHAT_FORMATS["llava"])
        elif chat in CHAT_FORMATS:
            fmt = CHAT_FORMATS[chat]
        else:
            raise TokenizerError(f"unknown chat format {chat!r}; known: "
                                 f"{', '.join(CHAT_FORMATS)}")
        if fmt.marker is not None and fmt.marker not in vocab:
            raise TokenizerError(f"the {fmt.name} chat format needs the special token "
                                 f"{fmt.marker}, which {file} does not have")
        digest = hashlib.sha256(raw)
        digest.update(json.dumps([prefix, eos, fmt.name]).encode())
        if reset:
            digest.update(b"without its padding and truncation")
        return cls(path=file, tokenizer=tok, prefix=tuple(prefix), eos=eos, eos_text=eos_text,
                   chat=fmt, fingerprint=digest.hexdigest())

    @property
    def vocab_size(self) -> int:
        """One more than its largest id (ids may leave gaps: their count is not the bound)."""
        return 1 + max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added (those written in it are read)."""
        return list(_encode(self.tokenizer, text, self.path).ids) if text else []

    def layout(self, text: str, images: int,
               conversation: Sequence[Mapping[str, Any]] | None = None,
               items: Mapping[str, int] | None = None) -> TokenLayout:
        """A caption's or a conversation's layout (module docstring). The sample is written
        out as one string with its images' places, each stretch between two images
        tokenized whole (as a chat template's output is), and a token is trained when its
        characters overlap a trained part of the string (how ``transformers`` finds the
        assistant's tokens). ``items``: the sample's clips per other modality its spec
        reads (``audio``, ``video``), placed by their placeholders as images are.
        TokenizerError for a text with more placeholders of a modality than the sample
        has items of it."""
        eos = self.eos_text or ""
        counts = {"image": images, **(items or {})}
        parts: list[tuple[str, bool]] = []     # (text, trained), items as placeholders
        if conversation is None:
            missing = self._missing(text, counts)
            parts.append((missing, False))
            parts.append((text + eos, True))
        else:
            turns = [(self._role(t), str(turn_text(t))) for t in conversation]
            missing = self._missing("".join(v for _, v in turns), counts)
            chat = self.chat
            for role, value in turns:
                if missing and role == "user":
                    value, missing = missing + "\n" + value, ""
                footer = chat.footers[role].replace("{eos}", eos)
                parts.append((chat.headers[role], False))
                if role == "assistant":
                    end = chat.trained_footer.replace("{eos}", eos)
                    rest = footer[len(end):] if footer.startswith(end) else footer
                    parts.extend(((value + end, True), (rest, False)))
                else:
                    parts.append((value + footer, False))
            if missing:
                raise TokenizerError(f"{images} images but no user turn to place them in")
        return self._tokenize(parts, tuple(counts))

    def _missing(self, text: str, counts: Mapping[str, int]) -> str:
        """The placeholders of the items ``text`` does not place, in modality order;
        TokenizerError when it places more of a modality than the sample has."""
        out = ""
        for kind, n in counts.items():
            mark = PLACEHOLDERS[kind]
            placed = text.count(mark)
            if placed > n:
                raise TokenizerError(f"the text has {placed} {mark} placeholders but the "
                                     f"sample has {n} {kind}{'s' if kind == 'image' else ''}")
            out += mark * (n - placed)
        return out

    def _tokenize(self, parts: list[tuple[str, bool]], kinds: Sequence[str] = ("image",)
                  ) -> TokenLayout:
        ids: list[int] = list(self.prefix)
        places: dict[str, list[int]] = {k: [] for k in kinds}
        marks = {PLACEHOLDERS[k]: k for k in kinds}
        split = re.compile("(" + "|".join(map(re.escape, marks)) + ")")
        flags: list[bool] = [False] * len(ids)
        stretch, spans = "", []          # the text since the last image, its trained spans

        def flush() -> None:
            nonlocal stretch, spans
            if stretch:
                enc = _encode(self.tokenizer, stretch, self.path)
                ids.extend(enc.ids)
                flags.extend(any(s < b and e > a for a, b in spans) for s, e in enc.offsets)
            stretch, spans = "", []

        for piece, trained in parts:
            for k, chunk in enumerate(split.split(piece)):
                if k % 2:                  # a placeholder
                    flush()
                    places[marks[chunk]].append(len(ids))
                    continue
                if trained and chunk:
                    spans.append((len(stretch), len(stretch) + len(chunk)))
                stretch += chunk
        flush()
        trained_ranges: list[tuple[int, int]] = []
        for i, flag in enumerate(flags):
            if flag and trained_ranges and trained_ranges[-1][1] == i:
                trained_ranges[-1] = (trained_ranges[-1][0], i + 1)
            elif flag:
                trained_ranges.append((i, i + 1))
        return TokenLayout(ids=np.asarray(ids, dtype=np.int64),
                           image_at=tuple(places.pop("image")),
                           trained=tuple(trained_ranges),
                           items_at={k: tuple(v) for k, v in places.items()})

    @staticmethod
    def _role(turn: Mapping[str, Any]) -> str:
        who = str(turn.get("from", turn.get("role", "")))
        role = _ROLES.get(who.lower())
        if role is None:
            raise TokenizerError(f"a conversation turn from {who!r}: turns are from human, "
                                 "gpt or system (or user, assistant)")
        return role


def _encode(tok: Any, text: str, file: Path, *, special: bool = False) -> Any:
    """``tok.encode(text)``; the library's own errors (a bare Exception: a WordLevel model
    without its unknown token meeting an unknown word) as TokenizerError."""
    try:
        return tok.encode(text, add_special_tokens=special)
    except BaseException as err:
        if not _library_failure(err):
            raise
        raise TokenizerError(f"{file} cannot tokenize the text: {err}") from None


def _library_failure(err: BaseException) -> bool:
    """Whether ``err`` is the tokenizers library failing on what it was given: an Exception,
    or the ``PanicException`` its Rust code raises on a file it cannot take (a
    BaseException, which ``except Exception`` lets through); not an interrupt or exit."""
    return isinstance(err, Exception) or type(err).__name__ == "PanicException"


def load_tokenizer(path: str | Path | None, vocab: int, chat: str | None = None
                   ) -> HFTokenizer | HashTokenizer:
    """The tokenizer at ``path`` for a backbone of ``vocab`` ids, or the hashing one when
    ``path`` is None. TokenizerError when its ids do not fit the backbone."""
    if path is None:
        return HashTokenizer(vocab)
    tok = HFTokenizer.load(path, chat)
    if tok.vocab_size > vocab:
        raise TokenizerError(f"{tok.path} has token ids up to {tok.vocab_size - 1}, beyond "
                             f"the backbone's vocabulary of {vocab}")
    return tok


def conversation_of(meta: Mapping[str, Any]) -> Sequence[Mapping[str, Any]] | None:
    """A sample's conversation (its record's ``conversations``), or None for a caption.
    DatasetError for a ``conversations`` that is not a list of turns."""
    turns = meta.get("conversations")
    if turns is None:
        return None
    if not isinstance(turns, list) or not all(isinstance(t, Mapping) for t in turns):
        raise DatasetError("conversations is not a list of turns")
    return turns


# ---- layouts of a whole dataset, cached ------------------------------------------------------

_LAYOUTS_FORMAT = "dtdsl-token-layouts"
_LAYOUTS_VERSION = 2        # 2: clips' places (items_at)
# (T, image_at, trained, per other modality read its clips' places)
Layout = tuple[int, tuple[int, ...], tuple[tuple[int, int], ...], dict[str, tuple[int, ...]]]


def item_counts(info: Any, kinds: Sequence[str]) -> dict[str, int]:
    """A sample's clips (``shards.SampleInfo``) of each modality in ``kinds``."""
    return {k: info.audio_count if k == "audio" else len(info.videos) for k in kinds}


def dataset_identity(dataset: Any) -> tuple[str, Path | None]:
    """A fingerprint of a dataset's contents and the folder its caches go in (None: keep
    them in memory only)."""
    index = getattr(dataset, "index", None)
    if index is not None:           # WebDataset shards, a LLaVA JSON: their index's cache
        where = getattr(index, "cached", None) if hasattr(index, "cached") else index.path
        return (where.stem, where.parent) if where is not None else ("", None)
    from dtdsl.data.cache import user_cache_dir

    # A dtdsl dataset: its index and which of its samples are readable. Never beside it:
    # a dataset's folder holds only what dtc data synth wrote.
    return dataset.fingerprint, user_cache_dir()


def token_layouts(dataset: Any, tokenizer: HFTokenizer | HashTokenizer, *,
                  progress: Any = None, kinds: Sequence[str] = ()) -> list[Layout | None]:
    """Every sample's ``(text tokens, image places, trained ranges, clip places)`` under
    ``tokenizer`` (None for a sample whose text does not go with its images: it is left
    out of the run), cached beside the dataset's index, named by the dataset's and the
    tokenizer's fingerprints and ``kinds`` (the modalities besides images whose
    placeholders are read: ``audio``, ``video``). The hashing tokenizer's come from the
    index's counts, nothing read."""
    kinds = tuple(kinds)
    from dtdsl.data.cache import read_cache, write_cache

    n = len(dataset)
    if isinstance(tokenizer, HashTokenizer):
        out: list[Layout | None] = []
        for i in range(n):
            info = dataset.info(i)
            t = info.text_tokens
            out.append((t, (0,) * len(info.images), ((1, t),) if t > 1 else (),
                        {k: (0,) * n for k, n in item_counts(info, kinds).items()}))
        return out
    ident, folder = dataset_identity(dataset)
    name = hashlib.sha256(f"{ident}\0{tokenizer.fingerprint}\0{','.join(kinds)}".encode()
                          ).hexdigest()[:32]
    target = folder / f"tokens-{name}.json" if folder is not None else None
    body = read_cache(target, _LAYOUTS_FORMAT, _LAYOUTS_VERSION) if target else None
    if body is not None:
        try:
            if len(body["layouts"]) == n:
                return [None if e is None else (int(e[0]), tuple(e[1]),
                                                tuple(tuple(r) for r in e[2]),
                                                {str(k): tuple(v) for k, v in e[3].items()})
                        for e in body["layouts"]]
        except (KeyError, TypeError, IndexError, AttributeError):
            pass          # unreadable: count again
    read = getattr(dataset, "read_text", None) or dataset.read
    layouts: list[Layout | None] = []
    failed: dict[str, int] = {}
    for i in range(n):
        raw = read(i)
        try:
            info = dataset.info(i)
            lay = tokenizer.layout(raw.text, len(info.images), conversation_of(raw.meta),
                                   item_counts(info, kinds))
            layouts.append((len(lay.ids), lay.image_at, lay.trained, dict(lay.items_at)))
        except (TokenizerError, DatasetError) as err:
            reason = str(err).split(":")[0][:80]
            failed[reason] = failed.get(reason, 0) + 1
            layouts.append(None)
        if progress is not None and (i % 10_000 == 9_999 or i == n - 1):
            progress(i + 1, n)
    if target is not None:       # not cached when it cannot be written: counted again
        write_cache(target, {
            "format": _LAYOUTS_FORMAT, "version": _LAYOUTS_VERSION,
            "tokenizer": str(tokenizer.path), "skipped": failed,
            "layouts": [None if e is None else [e[0], list(e[1]), [list(r) for r in e[2]],
                                                {k: list(v) for k, v in e[3].items()}]
                        for e in layouts]})
    return layouts
