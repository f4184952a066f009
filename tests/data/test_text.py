"""Text as the backbone reads it: Hugging Face tokenizers (made here with ``tokenizers``),
special tokens, chat formats, image placeholders and the loss mask, held against
``transformers``' own tokenizer and chat templates; the sequence layout rule."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dtdsl.data.text import HFTokenizer, TokenizerError, load_tokenizer
from dtdsl.ir.layout import fit, layout_of, sequence_layout
from dtdsl.ir.program import ImageTokens
from dtdsl.ir.sizes import SampleSizes
from tests.helpers.text import (
    CHATML,
)
from tests.text_models import make_tokenizer

P8 = ImageTokens(patch=8)


# LLaVA-1.5's (Vicuna v1) conversation, as its conv_templates write it.
LLAVA = """{{ bos_token }}{%- for m in messages -%}
{%- if m['role'] == 'system' -%}{{ m['content'] + ' ' }}
{%- elif m['role'] == 'user' -%}{{ 'USER: ' + m['content'] + ' ' }}
{%- else -%}{{ 'ASSISTANT: ' }}{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}
{%- endif -%}
{%- endfor -%}"""

CONVERSATION = [
    {"from": "human", "value": "<image>\nWhat is in the image?"},
    {"from": "gpt", "value": "A dog running in the park."},
    {"from": "human", "value": "And here? <image> Describe the picture in detail."},
    {"from": "gpt", "value": "A man rides a bicycle along the river."},
]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("chatml"), bos=None, eos="<|endoftext|>",
                          specials=["<|im_start|>", "<|im_end|>", "<image>"])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("llama"), specials=["<image>"])


def _theirs(path, template, conversation):
    """transformers' ids and assistant mask of a conversation (``<image>`` is one special
    token in these tokenizers): their chat template, their tokenization."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    messages = [{"role": roles[t["from"]], "content": t["value"]} for t in conversation]
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    image = tok.convert_tokens_to_ids("<image>")
    return list(out["input_ids"]), list(out["assistant_masks"]), image


def _ours_as_theirs(layout, image_id):
    """Our layout written as transformers' ids (an ``<image>`` id at each image's place)
    and mask."""
    ids, mask = [], []
    trained = np.zeros(len(layout.ids), dtype=bool)
    for a, b in layout.trained:
        trained[a:b] = True
    places = list(layout.image_at)
    for t in range(len(layout.ids) + 1):
        while places and places[0] == t:
            ids.append(image_id)
            mask.append(0)
            places.pop(0)
        if t < len(layout.ids):
            ids.append(int(layout.ids[t]))
            mask.append(int(trained[t]))
    return ids, mask


@pytest.mark.parametrize("fmt", ["chatml", "llava"])
def test_conversations_match_transformers_chat_templates(fmt, chatml, llama):
    """Placeholders at the images' places and the loss on assistant turns only, compared
    with transformers' apply_chat_template and its assistant mask."""
    path, template = (chatml, CHATML) if fmt == "chatml" else (llama, LLAVA)
    tok = HFTokenizer.load(path)
    assert tok.chat.name == fmt
    layout = tok.layout("", 2, CONVERSATION)
    ids, mask, image = _theirs(path, template, CONVERSATION)
    assert _ours_as_theirs(layout, image) == (ids, mask)
    assert len(layout.image_at) == 2 and len(layout.trained) == 2
    # the mask is not trivial: headers and user turns carry no loss
    assert 0 < sum(mask) < len(mask) // 2


def test_images_without_placeholders_open_the_first_user_turn(chatml):
    tok = HFTokenizer.load(chatml)
    conversation = [{"from": "human", "value": "What is in the image?"},
                    {"from": "gpt", "value": "A cat."}]
    placed = [{"from": "human", "value": "<image>\nWhat is in the image?"},
              {"from": "gpt", "value": "A cat."}]
    a, b = tok.layout("", 1, conversation), tok.layout("", 1, placed)
    assert a.ids.tolist() == b.ids.tolist() and a.image_at == b.image_at
    assert tok.encode("\nWhat")[0] == a.ids[a.image_at[0]]      # the image, then \n
    with pytest.raises(TokenizerError, match="2 <image> placeholders"):
        tok.layout("", 1, [{"from": "human", "value": "<image><image>"}])
    with pytest.raises(TokenizerError, match="from 'bot'"):
        tok.layout("", 0, [{"from": "bot", "value": "hi"}])


def test_captions_are_bos_images_text_eos(llama):
    """A caption: the tokenizer's BOS (its post-processor's), the images, the caption as
    transformers tokenizes it, EOS; trained on the caption and EOS."""
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(str(llama))
    tok = HFTokenizer.load(llama)
    text = "a photo of a cat sitting on a red chair"
    layout = tok.layout(text, 2)
    want = theirs(text)["input_ids"] + [theirs.eos_token_id]
    assert want[0] == theirs.bos_token_id and layout.ids.tolist() == want
    assert layout.image_at == (1, 1) and layout.trained == ((1, len(want)),)
    # an <image> in the caption puts the image there (one before, the other in place)
    placed = tok.layout("a photo of <image> a cat", 2)
    assert placed.image_at[0] == 1 and placed.image_at[1] > 1
    assert "<image>" not in theirs.decode(placed.ids.tolist())


def test_text_of_any_script_counts_tokens_not_words(llama):
    tok = HFTokenizer.load(llama)
    chinese = tok.layout("两只猫在沙发上睡觉", 0)
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(str(llama))
    assert len(chinese.ids) == len(theirs("两只猫在沙发上睡觉")["input_ids"]) + 1 > 3


def test_tokenizers_that_cannot_be_used_say_why(tmp_path, llama, chatml):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nope", 512)
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(TokenizerError, match="save_pretrained"):
        load_tokenizer(tmp_path / "sp", 512)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "tokenizer.json").symlink_to("/dev/zero")
    with pytest.raises(TokenizerError, match="tokenizer.json is not a regular file"):
        load_tokenizer(tmp_path / "dev", 512)
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a tokenizers"):
        load_tokenizer(tmp_path / "junk.json", 512)
    # A file the library's Rust code panics on (a PanicException, not an Exception).
    (tmp_path / "panic.json").write_text(json.dumps({
        "version": "1.0", "model": {"type": "WordLevel", "unk_token": "a", "vocab": {"a": 0}},
        "normalizer": {"type": "Precompiled", "precompiled_charsmap": "/////wAAAAA="}}))
    with pytest.raises(TokenizerError, match="not a tokenizers tokenizer.json: .*precompiled"):
        load_tokenizer(tmp_path / "panic.json", 512)
    with pytest.raises(TokenizerError, match="beyond the backbone's vocabulary of 128"):
        load_tokenizer(llama, 128)
    with pytest.raises(TokenizerError, match="needs the special token <|im_start|>"):
        load_tokenizer(llama, 512, chat="chatml")
    assert load_tokenizer(chatml / "tokenizer.json", 512).chat.name == "chatml"
    # tokenizer_config.json nested past Python's recursion limit, or not an object
    for name, text in (("deep", "[" * 100_000), ("list", "[1, 2]")):
        folder = tmp_path / name
        shutil.copytree(llama, folder)
        (folder / "tokenizer_config.json").write_text(text)
        with pytest.raises(TokenizerError, match="tokenizer_config.json is not"):
            load_tokenizer(folder, 512)


def test_a_tokenizer_saved_padded_or_truncated_encodes_as_transformers_does(tmp_path, llama):
    """A tokenizer.json keeps the padding and truncation of the encode before its save;
    transformers' tokenizer ignores them unless asked, and so do we (no pad ids between
    images, no answer cut short)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    text = "hello world, the quick brown fox jumps over the lazy dog again and again"
    plain = HFTokenizer.load(llama)
    want = PreTrainedTokenizerFast.from_pretrained(str(llama))(text).input_ids
    for name, setting in (("padded", lambda t: t.enable_padding(length=64)),
                          ("truncated", lambda t: t.enable_truncation(max_length=4))):
        folder = tmp_path / name
        shutil.copytree(llama, folder)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        setting(tok)
        tok.save(str(folder / "tokenizer.json"))
        loaded = HFTokenizer.load(folder)
        assert list(loaded.prefix) + loaded.encode(text) == want, name
        assert (loaded.layout(text, 1).ids.tolist()
                == plain.layout(text, 1).ids.tolist()), name
        assert loaded.fingerprint != plain.fingerprint     # an index of the old reading


def test_a_tokenizer_is_bounded_by_its_largest_id_and_its_errors_are_ours(tmp_path):
    """Ids with gaps: the largest, not their count, must fit the backbone. The library's
    own errors (a WordLevel model with no unknown token) are TokenizerErrors."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    sparse = Tokenizer(models.WordLevel({"a": 0, "b": 3, "far": 5000}, unk_token="a"))
    sparse.pre_tokenizer = pre_tokenizers.Whitespace()
    sparse.save(str(tmp_path / "sparse.json"))
    assert HFTokenizer.load(tmp_path / "sparse.json").vocab_size == 5001
    with pytest.raises(TokenizerError, match="ids up to 5000, beyond the backbone's "
                                             "vocabulary of 512"):
        load_tokenizer(tmp_path / "sparse.json", 512)
    no_unk = Tokenizer(models.WordLevel({"a": 0, "b": 1}))
    no_unk.pre_tokenizer = pre_tokenizers.Whitespace()
    no_unk.save(str(tmp_path / "no_unk.json"))
    tok = load_tokenizer(tmp_path / "no_unk.json", 512)
    with pytest.raises(TokenizerError, match="cannot tokenize the text: .*Missing"):
        tok.layout("a b c", 0)


# ---- the layout rule ---------------------------------------------------------------------

def test_images_are_spliced_in_and_targets_follow_the_trained_tokens():
    # 6 text tokens; an image of 4 tokens before token 2, one of 3 after the text
    lay = sequence_layout(6, [4, 3], [2, 6], [(1, 3), (4, 6)], seq_len=100)
    assert lay.length == 13 and not lay.cut
    assert lay.image_starts == (2, 10) and lay.text_runs == ((0, 2, 0), (2, 6, 6))
    # token 1 at position 1 (predicted at 0), token 2 after the image at 6 (predicted at
    # the image's last position, 5), tokens 4, 5 at 8, 9
    assert lay.loss_positions() == [(0, 1), (5, 6), (7, 9)] and lay.loss_tokens == 4
    assert lay.position(2) == 6
    # the sequence's first position predicts nothing
    assert sequence_layout(3, [], [], [(0, 3)], 10).loss == ((1, 3),)
    assert sequence_layout(3, [2], [0], [(0, 3)], 10).loss == ((0, 3),)


def test_a_long_sample_is_cut_and_an_image_that_does_not_fit_is_dropped():
    lay = sequence_layout(6, [4, 3], [2, 6], [(0, 6)], seq_len=8)
    assert lay.cut and lay.text == 4 and lay.image_tokens == (4,) and lay.length == 8
    lay = sequence_layout(6, [4, 3], [2, 6], [(0, 6)], seq_len=5)   # the image would cross
    assert lay.cut and lay.text == 2 and lay.image_tokens == () and lay.length == 2
    sizes = SampleSizes(text_tokens=6, image_shapes=((16, 16), (16, 8)), gen_counts={},
                        image_at=(2, 6), trained=((0, 6),))
    cut = fit(sizes, P8, 8)       # images of 4 and 2 patches of 8 px
    assert cut.text_tokens == 4 and cut.image_shapes == ((16, 16),) and cut.trained == ((0, 4),)
    assert layout_of(cut, P8, 8).length == 8 and not layout_of(cut, P8, 8).cut
    assert fit(cut, P8, 8) is cut


def test_backbone_input_splices_images_at_their_places():
    from dtdsl.ir.program import TransformerArch
    from dtdsl.models.multimodal import IGNORE, backbone_input
    from dtdsl.models.transformer import Backbone

    torch.manual_seed(0)
    bb = Backbone(TransformerArch(layers=1, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=50,
                                  causal=True))
    tokens = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])]
    images = [torch.randn(3, 8), torch.randn(0, 8)]
    layouts = [sequence_layout(4, [3], [1], [(2, 4)], 100),
               sequence_layout(2, [], [], [(1, 2)], 100)]
    batch = backbone_input(bb, images, tokens, layouts)
    emb = bb.tok_embeddings.weight
    assert batch.embeds.shape == (2, 7, 8) and batch.lengths == (7, 2)
    row = batch.embeds[0]
    assert torch.equal(row[0], emb[5]) and torch.equal(row[1:4], images[0])
    assert torch.equal(row[4:7], emb[[6, 7, 8]])
    assert batch.targets[0].tolist() == [IGNORE] * 4 + [7, 8, IGNORE]
    assert batch.targets[1].tolist() == [10] + [IGNORE] * 6
    assert torch.equal(batch.embeds[1, 2:], torch.zeros(5, 8))


def test_backbone_input_of_empty_sequences():
    from dtdsl.ir.program import TransformerArch
    from dtdsl.models.multimodal import backbone_input
    from dtdsl.models.transformer import Backbone

    bb = Backbone(TransformerArch(layers=1, hidden=8, heads=2, kv_heads=2, ffn=16, vocab=50,
                                  causal=True))
    empty = sequence_layout(0, [], [], [], 16)
    batch = backbone_input(bb, [torch.zeros(0, 8)], [torch.zeros(0, dtype=torch.int64)],
                           [empty])
    assert batch.embeds.shape == (1, 0, 8) and batch.targets.shape == (1, 0)
