"""What the checker asks of the files a spec names: the checker itself reads none.

A spec may name a Hugging Face model (``hf("DIR")``, ``pretrained``), a VAE, a tokenizer
and measured distributions (``empirical("FILE")``). Reading them takes ``models`` and
``data`` (torch among them), which sit above the front end, so the checker is handed a
``Files`` (``dtdsl.resolve.SpecFiles`` for every real spec) and stays importable, and a
spec that names no file checkable, without them. The checker needs an ``hf`` model's
architecture to check the rest of the spec against it, so it asks while it checks
rather than leaving the files to a later pass.

Each method reports its own diagnostics into ``ctx`` and returns ``INVALID`` after an
error, as the checker's own steps do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from dtdsl.frontend.schema import Ctx
from dtdsl.ir import program as ir
from dtdsl.source import Span

__all__ = ["Files"]


class Files(Protocol):
    def path(self, text: str) -> Path:
        """A path of the spec: relative to the spec's folder, ``~`` expanded, absolute."""

    def hf_model(self, ctx: Ctx, text: str, role: str, feature_layer: int | None,
                 span: Span) -> Any:
        """``(architecture, ir.HFSource, notes)`` of the Hugging Face model in ``text``,
        or INVALID after a DT311."""

    def pretrained(self, ctx: Ctx, text: str, role: str, name: str, arch: Any,
                   source: ir.HFSource, span: Span) -> Any:
        """The absolute weights directory ``text``, its tensors checked against ``arch``
        (headers only), or INVALID."""

    def vae(self, ctx: Ctx, text: str | None, span: Span | None, source: Any, name: str,
            name_span: Span, latent_channels: int | None) -> Any:
        """Generator ``name``'s VAE architecture: the folder ``text``, else the one beside
        its Hugging Face pipeline ``source``; None when there is none, INVALID on an error."""

    def tokenizer(self, ctx: Ctx, text: str | None, span: Span | None, backbone: Any,
                  chat: Any, chat_span: Span | None) -> Any:
        """The absolute path of the data's tokenizer (``text``, else the backbone's
        pretrained folder when it holds a ``tokenizer.json``; None for neither), loaded once
        against the backbone's vocabulary; INVALID when it cannot be used."""

    def empirical(self, ctx: Ctx, text: str, key: str | None, quantity: str,
                  span: Span) -> Any:
        """``ir.Empirical`` of the measured values in file ``text`` (under ``key``, else
        ``quantity``, in a JSON object), or INVALID after a DT309."""
