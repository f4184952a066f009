"""Decoding stored samples into the arrays the model reads (NumPy; no torch here).

``Decoder.for_program(program, seed=...)`` is built once per spec; ``decoder.decode(raw)``
turns a ``RawSample`` into a ``DecodedSample``:

- ``tokens``: int64 ``[T]`` from the spec's tokenizer (``data.text``: a Hugging Face
  tokenizer with the sample's special tokens and chat format, or the hashing tokenizer of
  synthetic data), with ``image_at`` (where each image goes) and ``trained`` (the tokens
  the loss trains on): the sample's ``TokenLayout``;
- ``images``: for the spec's image encoder, uint8 ``[3, H, W]`` per input image, sized as
  that encoder expects (``images.ImagePolicy``: a Hugging Face tower's fixed size and
  crop, or native resolution in whole patches under the clamp high of
  ``image.patches``). Without an image encoder nothing reads them and ``images`` is
  empty;
- ``inputs``: per audio or video encoder and per image encoder after the first (by module
  name), its items as float32 arrays: audio files decoded to the features the encoder
  reads, video files to sampled, sized, normalised frames (``data.media.ClipReader``);
  ``.npy`` audio (a dtdsl dataset's) is taken as precomputed features of the encoder's
  bins (``[frames, C, bins]`` for one of ``C > 1`` input channels: a clip without that
  channel axis, or with another count, is a ``DatasetError``), cut to whole rows of
  patches under the clamp high of ``audio.frames``; images sized by that encoder's own
  ``ImagePolicy`` and normalised with its mean and std. ``inputs_at``: where each goes
  (its placeholder, ``data.text``);
- ``audio``: the ``.npy`` clips as stored (float32 ``[frames, bins]``, or ``[frames,
  channels, bins]``);
- ``gen``: per generator (by module name) ``LatentTargets``: ``latents`` float32 ``[G, C,
  L, L]`` (``C`` the generator's ``latent_channels``, ``L`` its ``latent``), ``noise``
  float32 ``[G, C, L, L]`` and ``timesteps`` int64 ``[G]`` below the generator's timesteps.
  An image generator's targets are the sample's ``gen_images``, an audio generator's its
  ``gen_audio`` (two generators of one modality share them).

**Several encoders of one modality** (hybrid towers: DeepSeek-VL's SigLIP and SAM,
Cambrian, Eagle) share the sample's items of that modality, as two generators share
their targets: every encoder encodes each of the sample's images (audio clips, video
clips), each at its own size, and each item's placeholder (``<image>``, ``<audio>``,
``<video>``) holds the tokens of every such encoder, in spec order (``ir.layout``:
items before the same text token go in the encoders' spec order, so items that share a
place, those without a placeholder, take the first encoder's run, then the second's).
This is the reading the cost model prices (``cost.samples``: one draw of a modality's
items, one ``SampleSet.items`` key per encoder) and synthetic samples draw
(``data.sample.sample_sizes``); the clamps cut each encoder's items alike.

The latents are a fixed, deterministic stand-in for a VAE encoder, not a learnt one. An
image is box-filtered to ``L x L``, its pixels mapped to ``[-1, 1]`` and its three colour
channels to ``C`` by a fixed matrix (unit rows drawn once from a seed of ``C``) times
``IMAGE_LATENT_SCALE``, which gives about unit variance on synthesised images. Audio
frames are resized (bilinear) to ``L x L`` and multiplied by a fixed unit vector of ``C``
weights and ``AUDIO_LATENT_SCALE`` (standardised log-mel frames are already about unit
variance). The noise and timesteps come from a NumPy generator seeded by a SHA-256 of
``(seed, key, generator name)``, so a sample decodes the same in any process and order.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dtdsl.data.images import ImagePolicy, patch_grid
from dtdsl.data.media import ClipReader
from dtdsl.data.shards import (
    DatasetError,
    EncodedAudio,
    EncodedClip,
    EncodedImage,
    RawSample,
    SampleInfo,
)
from dtdsl.data.text import (
    HashTokenizer,
    HFTokenizer,
    TokenizerError,
    TokenLayout,
    conversation_of,
    load_tokenizer,
)
from dtdsl.ir import program as ir
from dtdsl.ir.modal import encoder_inputs

__all__ = [
    "AUDIO_LATENT_SCALE",
    "DIFFUSION_STEPS",
    "IMAGE_LATENT_SCALE",
    "DecodedSample",
    "Decoder",
    "LatentTargets",
    "decode_sample",
    "join_decoded",
    "patch_grid",
]

DIFFUSION_STEPS = 1000      # DDPM's discrete timesteps, the default of a generator's
IMAGE_LATENT_SCALE = 2.0
_GEN_AUDIO_FRAMES = 998     # 10 s of fbank frames: an audio generation target's
AUDIO_LATENT_SCALE = 1.0


def _seed(*parts: object) -> int:
    """A 63-bit seed from a SHA-256 of ``parts`` (never ``hash()``: it varies by process)."""
    text = ":".join(map(str, ("dtdsl-decode", *parts)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True, eq=False)
class LatentTargets:
    """One generator's targets for one sample (G items, G may be 0): the clean latents, or
    for a generator with a VAE the images and the posterior's noise that its ranks turn
    into latents (``models.vae``)."""

    latents: np.ndarray | None   # [G, C, L, L] float32 (None: ``pixels`` instead)
    noise: np.ndarray            # [G, C, L, L] float32
    timesteps: np.ndarray        # [G] int64 in [0, the generator's timesteps)
    pixels: np.ndarray | None = None   # [G, 3, S, S] uint8, S = L x the VAE's downscale
    eps: np.ndarray | None = None      # [G, C, L, L] float32: the VAE posterior's noise

    def __len__(self) -> int:
        return int(self.noise.shape[0])


@dataclass(frozen=True, eq=False)
class DecodedSample:
    key: str
    tokens: np.ndarray                   # [T] int64
    images: tuple[np.ndarray, ...]       # each [3, H, W] uint8
    audio: tuple[np.ndarray, ...]        # each [frames, bins] float32
    gen: dict[str, LatentTargets]        # generator name -> its targets
    image_at: tuple[int, ...] = ()       # per image: the text tokens before it
    trained: tuple[tuple[int, int], ...] = ()   # text-token ranges with a loss
    doc_text: tuple[int, ...] | None = None     # a packed sequence's documents
    doc_images: tuple[int, ...] | None = None   # (``data.sample.SampleSizes``)
    doc_gen: dict[str, tuple[int, ...]] | None = None
    # per audio or video encoder and image encoder after the first (by name): its items,
    # where they go, per document
    inputs: dict[str, tuple[np.ndarray, ...]] = field(default_factory=dict)
    inputs_at: dict[str, tuple[int, ...]] | None = None
    doc_inputs: dict[str, tuple[int, ...]] | None = None


@dataclass(frozen=True, eq=False)
class _Generator:
    name: str
    modality: str
    channels: int
    latent: int
    weights: np.ndarray      # [C, 3] for images, [C] for audio
    timesteps: int           # the generator's discrete timesteps
    vae_size: int | None = None   # with a VAE: the side of the images it encodes


def _generator(module: ir.Module) -> _Generator:
    arch = module.arch
    assert isinstance(arch, (ir.UNetArch, ir.DiTArch))
    c = arch.latent_channels
    rng = np.random.default_rng(_seed("latent-map", module.modality, c))
    if module.modality == "image":
        weights = rng.standard_normal((c, 3))
        weights /= np.linalg.norm(weights, axis=1, keepdims=True)
        weights *= IMAGE_LATENT_SCALE
    else:
        weights = rng.choice([-1.0, 1.0], size=c) * AUDIO_LATENT_SCALE
    vae_size = arch.latent * module.vae.downscale if module.vae is not None else None
    return _Generator(name=module.name, modality=module.modality or "", channels=c,
                      latent=arch.latent, weights=weights.astype(np.float32),
                      timesteps=arch.timesteps, vae_size=vae_size)


@dataclass(frozen=True, eq=False)
class Decoder:
    """Decodes samples for one spec; build it once (``for_program``), decode many."""

    tokenizer: HFTokenizer | HashTokenizer
    seed: int
    images: ImagePolicy | None        # the image encoder's; None: no image encoder
    audio: bool                       # the spec has an audio encoder
    max_frames: int | None
    generators: tuple[_Generator, ...]
    # every audio and video encoder's reader, by encoder name
    readers: dict[str, ClipReader] = field(default_factory=dict)
    # every image encoder's but the first's (whose items are ``images``): its policy
    image_inputs: dict[str, ImagePolicy] = field(default_factory=dict)

    @classmethod
    def for_program(cls, program: ir.Program, *, seed: int) -> Decoder:
        """``text.TokenizerError`` for a tokenizer that does not load; ValueError for a
        video generator (nothing makes its targets)."""
        for module in program.generators:
            if module.modality == "video":
                raise ValueError(f"'{module.name}' generates video; samples carry image and "
                                 "audio generation targets only")
        readers = {m.name: ClipReader.for_encoder(program, m) for m in program.encoders
                   if m.modality in ("audio", "video")}
        image = next((m for m in program.encoders if m.modality == "image"), None)
        policy = None
        if image is not None:
            policy = ImagePolicy.for_encoder(image, program.data.high("image", "patches"),
                                             block=program.image_tokens().block)
        rules = encoder_inputs(program)
        image_inputs = {r.name: ImagePolicy.for_encoder(
            program.module(r.name), program.data.high("image", "patches"),
            block=r.image.block if r.image is not None else 1)
            for r in rules.others if r.modality == "image"}
        tokenizer = load_tokenizer(program.data.tokenizer, program.backbone.arch.vocab,
                                   program.data.chat)
        return cls(tokenizer=tokenizer, seed=seed, images=policy,
                   audio=any(m.modality == "audio" for m in program.encoders),
                   max_frames=program.data.high("audio", "frames"),
                   generators=tuple(_generator(m) for m in program.generators),
                   readers=readers, image_inputs=image_inputs)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The modalities besides images whose items (and placeholders) are read, once
        each however many encoders read them."""
        return tuple(dict.fromkeys(r.modality for r in self.readers.values()))

    @property
    def input_encoders(self) -> tuple[str, ...]:
        """The encoders whose items are a sample's ``inputs``."""
        return (*self.image_inputs, *self.readers)

    def input_places(self, image_at: tuple[int, ...],
                     items_at: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Per ``inputs`` encoder, where its items go: the places of its modality's items
        (``image_at`` for images, ``items_at`` per other modality; module docstring)."""
        out = {name: tuple(image_at) for name in self.image_inputs}
        out.update({name: tuple(items_at.get(r.modality, ()))
                    for name, r in self.readers.items()})
        return out

    def _items(self, raw: RawSample) -> dict[str, int]:
        return {r.modality: len(raw.audio if r.modality == "audio" else raw.video)
                for r in self.readers.values()}

    def layout(self, raw: RawSample, images: int) -> TokenLayout:
        """The sample's token layout (``data.text``). DatasetError when its text and
        items do not go together (more ``<image>`` placeholders than images, a turn from
        nobody known, a conversation with synthetic data's tokenizer)."""
        try:
            return self.tokenizer.layout(raw.text, images, conversation_of(raw.meta),
                                         self._items(raw))
        except (TokenizerError, DatasetError) as err:
            raise DatasetError(f"sample {raw.key}: {err}") from None

    def input_shapes(self, info: SampleInfo) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Per audio or video encoder, the shapes of a sample's items from its index
        alone (``ClipReader.shape``; ``.npy`` audio by its frames). DatasetError for an
        item that gives no token."""
        out = {name: tuple((3, *policy.shape(w, h)) for w, h in info.images)
               for name, policy in self.image_inputs.items()}
        for name, reader in self.readers.items():
            if reader.modality == "audio":
                out[name] = tuple(self._npy_shape(reader, f, info.key) for f in info.audio) + \
                    tuple(reader.shape(c) for c in info.audio_clips)
            else:
                out[name] = tuple(reader.shape(c) for c in info.videos)
        return out

    def _npy_shape(self, reader: ClipReader, frames: int, key: str) -> tuple[int, ...]:
        rule = reader.rule
        assert reader.audio is not None
        if rule.whisper_positions:
            return (2 * rule.whisper_positions, rule.channels)
        most = reader.audio.max_frames
        rows = min(frames, most if most is not None else frames) // rule.patch
        if rows < 1:
            raise DatasetError(f"sample {key}: a clip of {frames} frames, fewer than " +
                               ("one" if rule.frames else
                                f"one row of {rule.patch} frames of patches"))
        return (rows * rule.patch, *rule.item_shape)

    def _inputs(self, raw: RawSample, opened: list[Any]) -> dict[str, tuple[np.ndarray, ...]]:
        """Every ``inputs`` encoder's items; ``opened``: the sample's images, decoded once
        for every image encoder."""
        out = {}
        if self.image_inputs:
            for name, policy in self.image_inputs.items():
                mean = np.asarray(policy.mean, dtype=np.float32).reshape(3, 1, 1)
                std = np.asarray(policy.std, dtype=np.float32).reshape(3, 1, 1)
                # normalised here (``images.normalize``'s arithmetic): an encoder's inputs
                # travel as float32 and the device reads them as they are
                out[name] = tuple((policy.resize(img).astype(np.float32) / np.float32(255)
                                   - mean) / std for img in opened)
        for name, reader in self.readers.items():
            items = raw.audio if reader.modality == "audio" else raw.video
            out[name] = tuple(self._item(raw, reader, item) for item in items)
        return out

    def _item(self, raw: RawSample, reader: ClipReader, item: EncodedAudio | EncodedClip
              ) -> np.ndarray:
        if isinstance(item, EncodedClip):
            try:
                return reader.read(item)
            except DatasetError as err:
                raise DatasetError(f"sample {raw.key}: {err}") from None
        array = self._clip(raw, item, reader.rule.channels)     # .npy: precomputed
        shape = self._npy_shape(reader, array.shape[0], raw.key)
        if array.shape[1:] != shape[1:]:     # [frames, bins] or [frames, channels, bins]
            raise DatasetError(f"sample {raw.key}: audio features of {_per_frame(array.shape)}"
                               f"; encoder '{reader.rule.name}' reads {_per_frame(shape)}")
        if array.shape[0] < shape[0]:
            raise DatasetError(f"sample {raw.key}: audio features of {array.shape[0]} frames; "
                               f"encoder '{reader.rule.name}' reads {shape[0]}")
        return np.ascontiguousarray(array[:shape[0]])

    def decode(self, raw: RawSample) -> DecodedSample:
        """The arrays of one sample. DatasetError for an image or clip that does not
        decode, or text that does not go with its items."""
        layout = self.layout(raw, len(raw.images))
        reads_images = self.images is not None or bool(self.image_inputs)
        opened = [self._open(raw, image) for image in raw.images] if reads_images else []
        images: tuple[np.ndarray, ...] = ()
        if self.images is not None:
            images = tuple(self.images.resize(img) for img in opened)
        audio: tuple[np.ndarray, ...] = ()
        if self.audio:
            audio = tuple(self._clip(raw, clip, clip.channels)[:self.max_frames]
                          for clip in raw.audio
                          if isinstance(clip, EncodedAudio))
        gen = {g.name: self._targets(raw, g) for g in self.generators}
        at = self.input_places(layout.image_at, layout.items_at)
        return DecodedSample(key=raw.key, tokens=layout.ids, images=images, audio=audio,
                             gen=gen, image_at=layout.image_at, trained=layout.trained,
                             inputs=self._inputs(raw, opened), inputs_at=at)

    @property
    def reads(self) -> tuple[str, ...]:
        """The parts of a sample this decoder decodes (what ``check`` checks)."""
        parts = []
        if self.images is not None:
            parts.append("images")
        if self.audio:
            parts.append("audio")
        if any(r.modality == "video" for r in self.readers.values()):
            parts.append("video")
        modalities = {g.modality for g in self.generators}
        if "image" in modalities:
            parts.append("gen_images")
        if "audio" in modalities:
            parts.append("gen_audio")
        return tuple(parts)

    def check(self, raw: RawSample) -> None:
        """That every part of ``raw`` that ``decode`` decodes does decode (the images'
        pixels, not only their headers; the clips' arrays): DatasetError saying which
        does not. The text is checked by its layout (``data.text.token_layouts``)."""
        parts = self.reads
        images = (raw.images if "images" in parts else ()) + \
            (raw.gen_images if "gen_images" in parts else ())
        for image in images:
            self._open(raw, image).close()
        for reader in self.readers.values():
            items = raw.audio if reader.modality == "audio" else raw.video
            for item in items:
                self._item(raw, reader, item)
        for clip in raw.gen_audio if "gen_audio" in parts else ():
            self._gen_frames(raw, clip)

    def stand_in(self, key: str, text_tokens: int, images: tuple[tuple[int, int], ...],
                 gen_counts: dict[str, int],
                 inputs: dict[str, tuple[tuple[int, ...], ...]] | None = None
                 ) -> DecodedSample:
        """What a run trains on in place of a sample that stopped decoding after the run's
        samples were chosen (its file changed since): the sizes it was chosen with
        (``text_tokens`` token ids 0, mid-grey images of the policy's shapes for these
        ``(width, height)``, zero targets), with the noise and timesteps ``decode`` would
        draw. The same in every process, so the batch's shapes and routing hold."""
        grey = tuple(np.full((3, *self.images.shape(w, h)), 128, dtype=np.uint8)
                     for w, h in images) if self.images is not None else ()
        gen = {}
        for g in self.generators:
            n = gen_counts.get(g.name, 0)
            shape = (n, g.channels, g.latent, g.latent)
            rng = np.random.default_rng(_seed(self.seed, key, g.name))
            timesteps = rng.integers(0, g.timesteps, size=n, dtype=np.int64)
            noise = rng.standard_normal(shape, dtype=np.float32)
            if g.vae_size is None:
                gen[g.name] = LatentTargets(latents=np.zeros(shape, np.float32), noise=noise,
                                            timesteps=timesteps)
            else:
                eps = rng.standard_normal(shape, dtype=np.float32)
                pixels = np.full((n, 3, g.vae_size, g.vae_size), 128, dtype=np.uint8)
                gen[g.name] = LatentTargets(latents=None, noise=noise, timesteps=timesteps,
                                            pixels=pixels, eps=eps)
        return DecodedSample(key=key, tokens=np.zeros(text_tokens, dtype=np.int64),
                             images=grey, audio=(), gen=gen,
                             inputs={k: tuple(np.zeros(s, np.float32) for s in v)
                                     for k, v in (inputs or {}).items()})

    def _open(self, raw: RawSample, image: EncodedImage):
        """The image's pixels in RGB (``_on_white``); DatasetError where they do not
        decode."""
        from dtdsl.data.shard_format import open_image

        try:
            img = open_image(io.BytesIO(image.data))
            img.load()
            return img if img.mode == "RGB" else _on_white(img)
        except Exception as err:  # noqa: BLE001 - Pillow raises many kinds on broken data
            # (OSError for a corrupt or cut-off body, SyntaxError, ValueError, EOFError,
            # struct.error, DecompressionBombError for malformed headers and chunks)
            raise DatasetError(f"sample {raw.key}: cannot decode a {image.format} image: "
                               f"{err}") from None

    def _gen_frames(self, raw: RawSample, clip: EncodedAudio | EncodedClip) -> np.ndarray:
        """An audio generation target's frames: ``.npy`` as stored; an audio file as BEATs'
        fbank (128 bins) of its first 10 s (an audio generator's latent stand-in reads
        frames, not a waveform)."""
        if isinstance(clip, EncodedAudio):
            return self._clip(raw, clip)
        from dtdsl.data.audio import AudioPolicy, FbankFeatures

        try:
            return AudioPolicy(FbankFeatures.beats(), max_frames=_GEN_AUDIO_FRAMES).features(
                clip.data, clip.info.name)
        except DatasetError as err:
            raise DatasetError(f"sample {raw.key}: {err}") from None

    def _clip(self, raw: RawSample, clip: EncodedAudio, channels: int = 1) -> np.ndarray:
        """A ``.npy`` clip's float32 ``[frames, bins]``, ``[frames, channels, bins]`` for
        an encoder of ``channels > 1`` (an audio generator's targets: one channel)."""
        try:
            array = clip.array()
        except Exception as err:  # noqa: BLE001 - NumPy raises many kinds on broken data
            raise DatasetError(f"sample {raw.key}: cannot decode audio: {err}") from None
        want = "[frames, bins]" if channels == 1 else f"[frames, {channels}, bins]"
        if array.dtype != np.float32 or array.ndim != (2 if channels == 1 else 3):
            raise DatasetError(f"sample {raw.key}: audio is {array.dtype} "
                               f"{list(array.shape)}, not float32 {want}")
        return array

    def _targets(self, raw: RawSample, g: _Generator) -> LatentTargets:
        from PIL import Image

        size = (g.latent, g.latent)
        if g.vae_size is not None:
            return self._vae_targets(raw, g)
        if g.modality == "image":
            latents = []
            for image in raw.gen_images:
                img = self._open(raw, image).resize(size, Image.Resampling.BOX)
                pixels = np.asarray(img, dtype=np.float32) * (2 / 255) - 1     # [L, L, 3]
                latents.append(np.einsum("cr,hwr->chw", g.weights, pixels))
        else:
            latents = []
            for clip in raw.gen_audio:
                frames = Image.fromarray(self._gen_frames(raw, clip))  # mode "F"
                small = np.asarray(frames.resize(size, Image.Resampling.BILINEAR))
                latents.append(g.weights[:, None, None] * small[None])
        shape = (len(latents), g.channels, g.latent, g.latent)
        stacked = (np.stack(latents).astype(np.float32, copy=False) if latents
                   else np.zeros(shape, dtype=np.float32))
        rng = np.random.default_rng(_seed(self.seed, raw.key, g.name))
        timesteps = rng.integers(0, g.timesteps, size=len(latents), dtype=np.int64)
        noise = rng.standard_normal(shape, dtype=np.float32)
        return LatentTargets(latents=stacked, noise=noise, timesteps=timesteps)


    def _vae_targets(self, raw: RawSample, g: _Generator) -> LatentTargets:
        """A VAE generator's targets: its images at the VAE's size (the shorter side
        resized, the centre cropped, as diffusers' training scripts do), the posterior's
        noise, the diffusion noise and timesteps."""
        assert g.vae_size is not None
        side = g.vae_size
        policy = ImagePolicy(patch=1, size=(side, side), shortest_edge=side)
        images = [policy.resize(self._open(raw, image)) for image in raw.gen_images]
        pixels = (np.stack(images) if images else np.zeros((0, 3, side, side), np.uint8))
        shape = (len(images), g.channels, g.latent, g.latent)
        rng = np.random.default_rng(_seed(self.seed, raw.key, g.name))
        timesteps = rng.integers(0, g.timesteps, size=len(images), dtype=np.int64)
        noise = rng.standard_normal(shape, dtype=np.float32)
        eps = rng.standard_normal(shape, dtype=np.float32)
        return LatentTargets(latents=None, noise=noise, timesteps=timesteps, pixels=pixels,
                             eps=eps)


def join_decoded(docs: list[DecodedSample], sizes: Any = None) -> DecodedSample:
    """Decoded samples packed into one sequence whose sizes are ``sizes`` (``join_sizes``
    of theirs): their arrays one after the other (one sample: itself)."""
    if len(docs) == 1:
        return docs[0]
    assert sizes is not None
    gen = {}
    for name in docs[0].gen:
        parts = [d.gen[name] for d in docs]

        def cat(field: str, parts: list = parts) -> np.ndarray | None:
            values = [getattr(t, field) for t in parts]
            return None if values[0] is None else np.concatenate(values)

        gen[name] = LatentTargets(latents=cat("latents"), noise=cat("noise"),
                                  timesteps=cat("timesteps"), pixels=cat("pixels"),
                                  eps=cat("eps"))
    return DecodedSample(
        key="+".join(d.key for d in docs), tokens=np.concatenate([d.tokens for d in docs]),
        images=tuple(im for d in docs for im in d.images),
        audio=tuple(a for d in docs for a in d.audio), gen=gen, image_at=sizes.image_at,
        trained=sizes.trained, doc_text=sizes.doc_text, doc_images=sizes.doc_images,
        doc_gen=sizes.doc_gen,
        inputs={k: tuple(x for d in docs for x in d.inputs.get(k, ())) for k in sizes.inputs},
        inputs_at=sizes.inputs_at, doc_inputs=sizes.doc_inputs)


def decode_sample(program: ir.Program, raw: RawSample, *, seed: int) -> DecodedSample:
    """Decode one sample (builds a ``Decoder``; keep one to decode many)."""
    return Decoder.for_program(program, seed=seed).decode(raw)


def _per_frame(shape: tuple[int, ...]) -> str:
    """A clip's features per frame in words: ``128 bins``, ``2 channels of 128 bins``."""
    if len(shape) == 2:
        return f"{shape[1]} bins"
    return " x ".join(map(str, shape[1:-1])) + f" channels of {shape[-1]} bins"


def _on_white(img: Any) -> Any:
    """A Pillow image of any mode in RGB as transformers' ``convert_to_rgb`` makes it (the
    CLIP and SigLIP processors'): laid over a white background, so a transparent pixel
    is white, not the colour stored under it (``convert("RGB")`` drops the alpha)."""
    from PIL import Image

    rgba = img.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
