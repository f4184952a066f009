"""The resolve stage: the files a spec names, read for the checker (``frontend.files.Files``).

Hugging Face configs and the headers of their weights (``models.hf``), VAEs
(``models.vae``), tokenizers (``data.text``) and measured distributions. It sits above
the front end and the models, so that the checker imports neither ``models`` nor ``data``;
each reader imports them only when a spec names such a file, so a spec that names none is
checked without torch.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtdsl.codes import DT309, DT311, DT312, DT315, DT316
from dtdsl.frontend.schema import Ctx
from dtdsl.frontend.tables import MAX_EMPIRICAL_BYTES, MAX_EMPIRICAL_VALUES
from dtdsl.ir import program as ir
from dtdsl.source import Span

__all__ = ["SpecFiles"]


def _unreadable(code: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A reader whose path the system refuses (a name too long, a file among its folders)
    reports ``code`` at its span, as a missing file does, not an internal error."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def reader(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except OSError as err:
                bound = signature.bind(*args, **kwargs).arguments
                return bound["ctx"].error(code, f"cannot read {bound['text']}: "
                                          f"{err.strerror or err}", bound["span"])
        return reader
    return wrap


class SpecFiles:
    """The files of one spec, its relative paths taken from ``base_dir`` (its folder)."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir

    def path(self, text: str) -> Path:
        path = Path(text).expanduser()
        return (path if path.is_absolute() else self.base_dir / path).resolve()

    @_unreadable(DT311)
    def hf_model(self, ctx: Ctx, text: str, role: str, feature_layer: int | None,
                 span: Span) -> Any:
        from dtdsl.models.hf.config import HFError, read_hf

        try:
            model = read_hf(self.path(text), role=role, feature_layer=feature_layer)
        except HFError as err:
            missing = not self.path(text).exists() and not Path(text).is_absolute()
            return ctx.error(DT311, err.message, span, hint=err.hint or (
                "paths are relative to the spec's folder" if missing else None))
        return model.arch, model.source, tuple(model.notes)

    @_unreadable(DT311)
    def pretrained(self, ctx: Ctx, text: str, role: str, name: str, arch: Any,
                   source: ir.HFSource, span: Span) -> Any:
        """Every tensor there, in its shape, floating point; every file's header checked
        against the file; nothing read but the headers."""
        from dtdsl.models.hf import HFError, WeightsFileError, pretrained_problems, read_hf

        try:
            weights = read_hf(self.path(text), role=role)
        except HFError as err:
            return ctx.error(DT311, err.message, span, hint=err.hint)
        if weights.source.family != source.family:
            return ctx.error(DT312, f"{text} holds a {weights.source.family} model, but "
                             f"the architecture is a {source.family}", span)
        try:
            problems = pretrained_problems(weights, role, arch)
        except WeightsFileError as err:
            return ctx.error(DT316, err.message, span, hint=err.hint)
        except HFError as err:
            return ctx.error(DT312, err.message, span, hint=err.hint)
        if problems:
            more = len(problems) - 5
            return ctx.error(DT312, f"the weights in {text} do not fit {role} "
                             f"{name}: {problems[0]}", span,
                             notes=problems[1:5] + ([f"and {more} more"] if more > 0 else []),
                             hint="point pretrained at the checkpoint of this architecture")
        return str(weights.weights_dir)

    @_unreadable(DT311)
    def vae(self, ctx: Ctx, text: str | None, span: Span | None, source: Any, name: str,
            name_span: Span, latent_channels: int | None) -> Any:
        from dtdsl.models.hf import HFError, WeightsFileError
        from dtdsl.models.vae import VAEConfig, VAEError, find_vae, vae_problems

        if text is not None:
            path = self.path(text)
        elif (found := find_vae(source.path)) is not None:
            path, span = found, name_span
        else:
            return None
        try:
            cfg = VAEConfig.read(path)
        except VAEError as err:
            return ctx.error(DT311, str(err), span,
                             hint="point vae at a diffusers AutoencoderKL folder (config.json "
                             "and safetensors)")
        if latent_channels is not None and cfg.latent_channels != latent_channels:
            return ctx.error(DT312, f"the VAE in {path} makes {cfg.latent_channels}-channel "
                             f"latents; generator {name} denoises {latent_channels}", span,
                             hint="use the VAE the generator was trained with")
        # Its weights are read on every generator rank: checked here, headers only.
        try:
            problems = vae_problems(cfg)
        except WeightsFileError as err:
            return ctx.error(DT316, err.message, span, hint=err.hint)
        except HFError as err:
            return ctx.error(DT312, f"the VAE in {path}: {err.message}", span,
                             hint=err.hint)
        if problems:
            return ctx.error(DT312, f"the weights of the VAE in {path} do not fit its "
                             f"config: {problems[0]}", span, notes=problems[1:5])
        return cfg.arch()

    @_unreadable(DT315)
    def tokenizer(self, ctx: Ctx, text: str | None, span: Span | None, backbone: Any,
                  chat: Any, chat_span: Span | None) -> Any:
        if text is not None:
            path = self.path(text)
        elif backbone is not None and backbone.pretrained is not None and \
                (Path(backbone.pretrained) / "tokenizer.json").is_file():
            path, span = Path(backbone.pretrained), None
        else:
            return None
        if backbone is None or not isinstance(getattr(backbone.arch, "vocab", None), int):
            return str(path)
        from dtdsl.data.text import TokenizerError, load_tokenizer

        try:
            load_tokenizer(path, backbone.arch.vocab, chat)
        except TokenizerError as err:
            where = span or (chat_span if chat_span is not None else backbone.span)
            return ctx.error(DT315, f"the tokenizer cannot be used: {err}", where,
                             hint="point `tokenizer` at a tokenizer.json or a Hugging "
                             "Face folder holding one, made for the backbone")
        return str(path)

    def empirical(self, ctx: Ctx, text: str, key: str | None, quantity: str,
                  span: Span) -> Any:
        """Read whole, but bounded in size (MAX_EMPIRICAL_BYTES)."""
        path = Path(text)
        if not path.is_absolute():
            path = self.base_dir / path
        from dtdsl.data.paths import Refused, open_regular

        try:
            # A regular file only (a device or FIFO would be read without end), and no
            # more of it than the limit.
            with open_regular(path) as f:
                raw = f.read(MAX_EMPIRICAL_BYTES + 1)
            if len(raw) > MAX_EMPIRICAL_BYTES:
                return ctx.error(DT309, f"{text} is over {MAX_EMPIRICAL_BYTES:,} bytes; "
                                 "empirical files are limited to that", span)
        except Refused as err:
            return ctx.error(DT309, str(err), span)
        except FileNotFoundError:
            return ctx.error(DT309, f"no such file: {text}", span,
                             notes=[f"looked for {_shown(path)}"],
                             hint="paths are relative to the spec's folder")
        except OSError as err:
            return ctx.error(DT309, f"cannot read {text}: {err.strerror or err}", span)
        try:
            values = _parse_samples(raw, path.suffix, key or quantity)
        except ValueError as err:
            return ctx.error(DT309, f"{text}: {err}", span,
                             hint="give a JSON list of numbers, a JSON object of such lists "
                             "by quantity, or one number per line")
        return ir.Empirical(path=text, key=key, sha256=hashlib.sha256(raw).hexdigest(),
                            values=values)


def _shown(path: Path) -> str:
    """A path as a user would type it: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _parse_samples(raw: bytes, suffix: str, key: str) -> tuple[float, ...]:
    """Measured values from JSON (a list, or an object of lists by quantity) or text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    stripped = text.lstrip()
    if suffix == ".json" or stripped.startswith(("[", "{")):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid JSON at line {err.lineno}: {err.msg}") from None
        except (ValueError, RecursionError):    # an integer over 4300 digits, deep nesting
            raise ValueError("invalid JSON: a number too long, or nested too deep") from None
        if isinstance(doc, dict):
            if key not in doc:
                raise ValueError(f"no key '{key}' (keys: {', '.join(list(doc)[:10])})")
            doc = doc[key]
            if isinstance(doc, dict) and "values" in doc:
                doc = doc["values"]
        if not isinstance(doc, list):
            raise ValueError("expected a list of numbers")
        items = doc
    else:
        items = [line.split("#")[0].strip() for line in text.splitlines()]
        items = [i for i in items if i]
    if not items:
        raise ValueError("no values")
    if len(items) > MAX_EMPIRICAL_VALUES:
        raise ValueError(f"{len(items):,} values; at most {MAX_EMPIRICAL_VALUES:,}")
    values = []
    for i, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, (int, float, str)):
            raise ValueError(f"value {i + 1} is not a number")
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"value {i + 1} ({str(item)[:20]!r}) is not a number") from None
        except OverflowError:       # an integer past a float's range
            raise ValueError(f"value {i + 1} is larger than a count can be") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"value {i + 1} ({value:g}) is not a finite count >= 0")
        values.append(value)
    return tuple(values)
