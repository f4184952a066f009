"""Tokenizers made in the tests with the ``tokenizers`` package (nothing downloaded): a
byte-level BPE trained on a few sentences, saved as a Hugging Face folder
(``tokenizer.json`` and ``tokenizer_config.json``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

TEXTS = [
    "a photo of a cat sitting on a red chair",
    "What is in the image? There is a dog running in the park.",
    "Describe the picture in detail. A man rides a bicycle along the river.",
    "两只猫在沙发上睡觉", "def main():\n    return 42\n",
    "The quick brown fox jumps over the lazy dog.",
] * 4


def make_tokenizer(root: Path, *, vocab: int = 400, bos: str | None = "<s>",
                   eos: str = "</s>", specials: Sequence[str] = (),
                   texts: Sequence[str] = TEXTS) -> Path:
    """A byte-level BPE tokenizer in ``root``: ``bos`` added before every text by its
    post-processor (Llama's way; None: nothing, Qwen's way), ``eos`` named by its config,
    ``specials`` (e.g. ``<|im_start|>``) as special tokens. Returns ``root``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    names = [t for t in (bos, eos, *specials) if t is not None]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=names, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer)
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if bos is not None:
        config["bos_token"] = bos
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root
