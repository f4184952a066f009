"""LLaVA-style conversation sets (a JSON of records and an image folder), read directly:
the index, damaged records counted and skipped, placeholders and the loss mask as the
runtime sees them, and a pipeline-parallel run on them equal to the reference."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

from dtdsl import cli
from dtdsl.data.llava import LlavaDataset
from dtdsl.data.shards import DatasetError
from dtdsl.data.sources import open_dataset, source_problem
from dtdsl.driver import run_frontend
from tests.text_models import make_tokenizer

SPEC = """
spec llava_tiny

model {{
  encoder vit (image) {{
    arch = transformer(layers=2, hidden=32, heads=4, ffn=64, patch=8)
  }}
  backbone llm {{
    arch = transformer(layers=4, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=512, swiglu)
  }}
  projector vit -> llm : mlp(depth=2)
}}

data llava {{
  text.tokens   ~ lognormal(median=48, sigma=0.5) clamp [8, 192]
  image.count   ~ choice([0, 1, 2], p=[0.2, 0.6, 0.2])
  image.patches ~ choice([16, 30], p=[0.5, 0.5])
  source    = "llava.json"
  tokenizer = "tok"
  image_folder = "images"
}}

cluster local {{
  gpu           = custom(name="cpu", memory=4 GiB, peak=0.1 TFLOPS)
  gpus          = 4
  gpus_per_node = 4
  intra_node_bw = 4 GB/s
  inter_node_bw = 4 GB/s
}}

train {{
  global_batch  = 8
  micro_batch   = 2
  seq_len       = {seq_len}
  schedule      = 1f1b
  optimizer     = adamw(lr=1e-3, weight_decay=0.01)
  precision     = fp32
  steps         = 3
  seed          = 3
}}
"""

QUESTIONS = ["What is in the image?", "Describe the picture in detail.", "Where is the dog?",
             "What colour is the chair?"]
ANSWERS = ["A dog running in the park.", "A man rides a bicycle along the river.",
           "The quick brown fox jumps over the lazy dog.", "It is red."]


def _jpeg(rng, w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def write_llava(root: Path, n: int = 24, *, damaged: bool = False) -> list[dict]:
    """``n`` records as LLaVA's instruction sets have them: one image with its <image>
    placeholder, one image without, two images, or none; one to three rounds. With
    ``damaged``, three more that cannot be samples (a missing image, a corrupt one, no
    conversation). Returns the good records."""
    rng = np.random.default_rng(0)
    (root / "images" / "coco").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        kind = i % 4
        names = []
        for k in range(2 if kind == 2 else 0 if kind == 3 else 1):
            name = f"coco/{i:06d}_{k}.jpg"
            w, h = [(32, 32), (48, 40)][(i + k) % 2]
            (root / "images" / name).write_bytes(_jpeg(rng, w, h))
            names.append(name)
        turns = []
        for r in range(1 + i % 3):
            q = QUESTIONS[(i + r) % 4]
            if r == 0 and kind == 0:
                q = "<image>\n" + q
            if r == 0 and kind == 2:
                q = "<image> and <image>: " + q
            turns += [{"from": "human", "value": q}, {"from": "gpt", "value": ANSWERS[(i + r) % 4]}]
        record = {"id": f"r{i:04d}", "conversations": turns}
        if names:
            record["image"] = names[0] if len(names) == 1 else names
        records.append(record)
    out = list(records)
    if damaged:
        (root / "images" / "coco" / "bad.jpg").write_bytes(b"\xff\xd8 not a jpeg")
        out += [{"id": "gone", "image": "coco/missing.jpg",
                 "conversations": [{"from": "human", "value": "<image>"}]},
                {"id": "bad", "image": "coco/bad.jpg",
                 "conversations": [{"from": "human", "value": "<image>"}]},
                {"id": "empty", "image": names[0] if names else None}]
    (root / "llava.json").write_text(json.dumps(out, ensure_ascii=False, indent=1))
    return records


def test_records_images_and_damage(tmp_path):
    good = write_llava(tmp_path, n=8, damaged=True)
    with open_dataset("llava.json", base_dir=tmp_path, image_folder=tmp_path / "images") as ds:
        assert isinstance(ds, LlavaDataset) and len(ds) == 8
        assert ds.skipped == {"missing image": 1, "unreadable image": 1, "no conversation": 1}
        assert [ds.key(i) for i in range(8)] == [r["id"] for r in good]
        raw = ds.read(2)
        assert raw.meta["conversations"] == good[2]["conversations"]
        assert [(im.width, im.height) for im in raw.images] == [(32, 32), (48, 40)]
        assert ds.info(3).images == ()
    # the index is built once: a second open reads it, a changed file makes a new one
    first = LlavaDataset.open(tmp_path / "llava.json", tmp_path / "images").index.cached
    assert first is not None and first.is_file()
    (tmp_path / "llava.json").write_text(json.dumps(good[:3]))
    assert len(LlavaDataset.open(tmp_path / "llava.json", tmp_path / "images")) == 3
    # an image changed after indexing is an error when read, not a silent other image
    with open_dataset("llava.json", base_dir=tmp_path, image_folder=tmp_path / "images") as ds:
        (tmp_path / "images" / good[0]["image"]).write_bytes(b"x")
        with pytest.raises(DatasetError, match="changed since it was indexed"):
            ds.read(0)



def test_a_lone_surrogate_skips_its_record(tmp_path):
    """JSON may escape half a UTF-16 pair ("\\ud800"): no character, text no tokenizer
    or file system takes. Its record is skipped and counted, as WebDataset's txt is."""
    good = write_llava(tmp_path, n=2)
    records = json.loads((tmp_path / "llava.json").read_text())
    records += [{"id": "half", "conversations": [{"from": "human", "value": "bad \ud800 x"},
                                                 {"from": "gpt", "value": "y"}]},
                {"id": "clip", "audio": "a\ud800.wav",
                 "conversations": [{"from": "human", "value": "<audio>"}]}]
    (tmp_path / "llava.json").write_text(json.dumps(records))     # ASCII, escaped
    with open_dataset("llava.json", base_dir=tmp_path, image_folder=tmp_path / "images") as ds:
        assert [ds.key(i) for i in range(len(ds))] == [r["id"] for r in good]
        assert ds.skipped == {"text not UTF-8": 1, "unreadable audio": 1}

def test_json_sources_that_cannot_be_read_say_why(tmp_path):
    assert "No such file" in source_problem("missing.json", tmp_path)
    (tmp_path / "empty.json").write_text("  ")
    assert "is empty" in source_problem("empty.json", tmp_path)
    (tmp_path / "obj.json").write_text('{"a": 1}')
    assert "not a JSON array" in source_problem("obj.json", tmp_path)
    (tmp_path / "cut.json").write_text('[{"id": 1, "conversations": []}, {"id"')
    with pytest.raises(DatasetError, match="not valid JSON|ends inside"):
        open_dataset("cut.json", base_dir=tmp_path)


def _program(root: Path, seq_len: int = 256):
    make_tokenizer(root / "tok", bos=None, eos="<|endoftext|>",
                   specials=["<|im_start|>", "<|im_end|>"])
    spec = root / "llava.dt"
    spec.write_text(SPEC.format(seq_len=seq_len))
    result = run_frontend(str(spec), spec.read_bytes())
    assert result.ok, [d.message for d in result.diagnostics]
    return result.program


def _assistant_tokens(tok_dir: Path, record: dict) -> int:
    """The assistant tokens of a record, counted by transformers' chat template (ChatML)."""
    from transformers import PreTrainedTokenizerFast

    from tests.helpers.text import CHATML

    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    roles = {"human": "user", "gpt": "assistant"}
    messages = [{"role": roles[t["from"]], "content": t["value"].replace("<image>", "")}
                for t in record["conversations"]]
    out = tok.apply_chat_template(messages, chat_template=CHATML, tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    return sum(out["assistant_masks"])


def test_the_runtime_sees_placeholders_and_trains_on_assistant_turns(tmp_path):
    from dtdsl.data.batch import normalizer_of
    from dtdsl.feed.source import DatasetSource

    records = write_llava(tmp_path, n=24)
    program = _program(tmp_path)
    source = DatasetSource(program, tmp_path / "llava.json")
    by_key = {r["id"]: r for r in records}
    sizes = source.sizes(0)
    for position, (key, sz) in enumerate(zip(source.keys(0), sizes, strict=True)):
        record = by_key[key]
        images = record.get("image")
        n_images = 0 if images is None else 1 if isinstance(images, str) else len(images)
        assert len(sz.image_shapes) == len(sz.image_at) == n_images
        # the trained tokens are exactly the assistant's (transformers' count), and the
        # images sit where the first user turn's text puts them
        assert sum(b - a for a, b in sz.trained) == _assistant_tokens(tmp_path / "tok", record)
        decoded = source.decode(0, position)
        assert decoded.tokens.shape == (sz.text_tokens,)
        if n_images:
            assert sz.image_at[0] < sz.trained[0][0]
    # every assistant token has a target (none starts a sequence): the denominators
    assert normalizer_of(program, sizes).text_tokens == sum(
        _assistant_tokens(tmp_path / "tok", by_key[k]) for k in source.keys(0))


def test_data_stats_count_with_the_spec_tokenizer(tmp_path, capsys):
    write_llava(tmp_path, n=12)
    program_dir = tmp_path
    _program(program_dir)
    assert cli.main(["data", "stats", str(tmp_path / "llava.json"), "--spec",
                     str(tmp_path / "llava.dt"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    from dtdsl.data.text import HFTokenizer

    tok = HFTokenizer.load(tmp_path / "tok")
    records = json.loads((tmp_path / "llava.json").read_text())
    want = [len(tok.layout("", len([r["image"]] if isinstance(r.get("image"), str) else
                                    r.get("image", [])), r["conversations"]).ids)
            for r in records]
    assert stats["text.tokens"] == want
    assert stats["image.count"] == [0 if "image" not in r else 1 if isinstance(r["image"], str)
                                    else 2 for r in records]


def _train_llava(rank: int, world: int, program, plan, losses, data: str) -> None:
    from dtdsl.data.batch import LocalBatches
    from dtdsl.feed.source import DatasetSource
    from dtdsl.parallel.mesh import build_groups
    from dtdsl.schedule.lower import lower
    from dtdsl.train.executor import StageExecutor
    from tests.helpers.runs import LOSS_RTOL

    groups = build_groups(plan)
    feed = LocalBatches(program, plan, groups.role, source=DatasetSource(program, data))
    ex = StageExecutor(program, plan, lower(plan, program), rank=rank, groups=groups,
                       feed=feed)
    for r, want in zip(ex.train(len(losses)), losses, strict=True):
        assert math.isclose(r["loss"], want, rel_tol=LOSS_RTOL), (r["step"], r["loss"], want)


@pytest.mark.slow
def test_a_pipeline_trains_on_conversations_as_the_reference(tmp_path):
    """The encoder on one rank, the backbone over two pipeline stages, trained on LLaVA
    conversations with images at their placeholders; a short seq_len cuts some of them:
    the same losses as dtc reference on the same data."""
    from dtdsl.feed.source import DatasetSource
    from dtdsl.train.reference import train_reference
    from tests.dist import run
    from tests.helpers.runs import plan_for

    write_llava(tmp_path, n=24)
    program = _program(tmp_path, seq_len=64)
    data = str(tmp_path / "llava.json")
    source = DatasetSource(program, data)
    cut = sum(sz.text_tokens < len(source.decoder.layout(source.dataset.read_text(i),
                                                         len(source.dataset.info(i).images)).ids)
              for i, sz in zip(source.indices(0), source.sizes(0), strict=True))
    assert cut > 0, "seq_len 64 cuts some conversations"
    assert sum(z.cut for z in source.sizes(0)) == cut       # and each is counted
    losses = [r["loss"] for r in train_reference(program, 3, source=source)]
    plan = plan_for(program, ("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 1, 2))
    run(_train_llava, plan.gpus_used, program, plan, losses, data, timeout=300)


def test_role_and_content_turns_read_as_from_and_value(tmp_path):
    # The chat format's {"role", "content"} turns: their text is read, not dropped (the
    # record check took "role" and the text came from "value" alone, empty).
    from dtdsl.feed.source import DatasetSource

    records = write_llava(tmp_path / "a", n=8)
    program = _program(tmp_path / "a")
    roles = {"human": "user", "gpt": "assistant"}
    chat = [{**r, "conversations": [{"role": roles[t["from"]], "content": t["value"]}
                                    for t in r["conversations"]]} for r in records]
    (tmp_path / "a" / "chat.json").write_text(json.dumps(chat))
    plain = DatasetSource(program, tmp_path / "a" / "llava.json")
    other = DatasetSource(program, tmp_path / "a" / "chat.json")
    assert other.keys(0) == plain.keys(0)
    for got, want in zip(other.sizes(0), plain.sizes(0), strict=True):
        assert (got.text_tokens, got.trained, got.image_at) == \
            (want.text_tokens, want.trained, want.image_at)
    for position in range(len(plain.keys(0))):
        assert np.array_equal(other.decode(0, position).tokens,
                              plain.decode(0, position).tokens)
    images = tmp_path / "a" / "images"
    assert LlavaDataset.open(tmp_path / "a" / "chat.json", images).read_text(0).text == \
        LlavaDataset.open(tmp_path / "a" / "llava.json", images).read_text(0).text


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_byte_order_mark_before_the_records_is_read_past(tmp_path, suffix):
    records = write_llava(tmp_path, n=6)
    plain = tmp_path / f"plain{suffix}"
    marked = tmp_path / f"marked{suffix}"
    body = (json.dumps(records) if suffix == ".json" else
            "\n".join(json.dumps(r) for r in records) + "\n").encode()
    plain.write_bytes(body)
    marked.write_bytes(b"\xef\xbb\xbf" + body)
    assert source_problem(str(marked), tmp_path) is None
    want = LlavaDataset.open(plain, tmp_path / "images")
    got = LlavaDataset.open(marked, tmp_path / "images")
    assert len(got) == len(want) == 6 and not got.skipped
    for i in range(6):
        assert got.read_text(i).text == want.read_text(i).text
