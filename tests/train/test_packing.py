"""Sequence packing (``train.packing``): documents packed into sequences of ``seq_len``
with document-level attention (no attention across documents, positions restarting per
document), as Megatron-LM packs data; a packed run equals the reference across TP, SP
and PP ranks, and a dataset's packed epoch uses every sample once."""

from __future__ import annotations

import pytest
import torch

from dtdsl.data.batch import SyntheticSource
from dtdsl.data.sample import join_sizes
from dtdsl.ir import program as ir
from dtdsl.ir.layout import layout_of, pack, sequence_layout
from dtdsl.ir.program import ImageTokens
from dtdsl.ir.sizes import SampleSizes
from dtdsl.models.multimodal import (
    backbone_input,
    backbone_layers,
    build_model,
    conditioning,
    encode,
    sample_layout,
)
from tests.dist import run
from tests.helpers.runs import _train_tp, plan_for, reference
from tests.specs import small, variant

P8 = ImageTokens(patch=8)     # the tiny spec's image tokens: its patches


def packed(batch: int = 8):
    """The tiny spec packed, in sequences of 256 positions (several documents each; the
    CPU's attention over packed documents is the flex operator's reference, which scores
    every pair: shorter rows keep the multi-rank runs short)."""
    p = variant("  seq_len          = 512\n",
                "  seq_len          = 256\n  packing          = true\n")
    return p.model_copy(update={"train": p.train.model_copy(update={"global_batch": batch})})


def test_first_fit_in_a_window_of_open_sequences():
    assert pack([5, 5, 3, 7, 2], 10) == [[0, 1], [2, 3], [4]]
    assert pack([6, 6, 3], 10) == [[0, 2], [1]]           # back to the first that fits
    # window 1: next-fit (each sequence closes when a document does not fit)
    assert pack([6, 6, 3], 10, window=1) == [[0], [1, 2]]
    assert pack([6, 6, 6, 6], 10, window=2, rows=1) == [[0]]
    with pytest.raises(ValueError, match="more than seq_len"):
        pack([11], 10)


@pytest.mark.parametrize("part", [1, 7, 64])
def test_a_stream_packed_in_parts_closes_the_sequences_of_the_whole(part):
    # draw_samples packs each new draw on from where the stream stopped (it re-packed
    # the whole stream each time: quadratic, minutes for short samples in long rows).
    import numpy as np

    from dtdsl.ir.layout import Packer

    lengths = np.random.default_rng(part).integers(1, 300, 2000).tolist()
    for rows in (None, 40):
        packer = Packer(1024)
        for at in range(0, len(lengths), part):
            if packer.feed(lengths[at:at + part], rows):
                break
        got = packer.done if rows is not None else packer.done + packer.open_rows
        assert got == pack(lengths, 1024, rows=rows)
    assert len(got) == 40


def test_documents_keep_their_layouts_in_a_packed_sequence():
    a = SampleSizes(text_tokens=5, image_shapes=((16, 16),), gen_counts={"g": 1},
                    image_at=(1,), trained=((1, 5),))
    b = SampleSizes(text_tokens=3, image_shapes=(), gen_counts={"g": 0}, trained=((0, 3),))
    row = join_sizes([a, b])
    assert row.docs() == [a, b] and row.num_docs == 2
    lay = layout_of(row, P8, 64)
    # a: token 0, image (4 tokens), tokens 1..4 -> positions 0..8; b: tokens at 9..11
    assert lay.spans == ((0, 9), (9, 3)) and lay.length == 12
    # b's first token starts its document: it is no target (nothing before it in b)
    assert lay.loss_positions() == [(4, 8), (9, 11)] and lay.loss_tokens == 6
    with pytest.raises(ValueError, match="exceed seq_len"):
        layout_of(row, P8, 10)
    assert sequence_layout(3, [], [], [(0, 3)], 8).spans == ((0, 3),)


def test_attention_never_crosses_a_document():
    """Each document of a packed sequence gives the hidden states it gives alone; changing
    one document changes none of the others'."""
    program = packed()
    torch.manual_seed(0)
    model = build_model(program)
    source = SyntheticSource(program)
    rows = [source.sample(0, i) for i in range(4)]
    row = next(r for r in rows if r.doc_text is not None and len(r.doc_text) >= 3)
    llm = model.unit("llm")
    rule, seq_len = model.image_tokens, model.seq_len

    def hidden(samples):
        layouts = [sample_layout(s, rule, seq_len) for s in samples]
        batch = backbone_input(llm, encode(model, samples), [s.tokens for s in samples],
                               layouts)
        x = backbone_layers(llm, batch.embeds, positions=batch.positions, mask=batch.mask)
        return x, layouts

    with torch.no_grad():
        states, (lay,) = hidden([row])
        x = states[0]
        spans = lay.spans
        # alone: document k of the row as a sample of its own
        docs = _documents(row)
        for k, (doc, (start, n)) in enumerate(zip(docs, spans, strict=True)):
            alone, _ = hidden([doc])
            torch.testing.assert_close(x[start:start + n], alone[0, :n], rtol=1e-5,
                                       atol=1e-5, msg=f"document {k}")
        # perturb the first document's text: only its own states change
        tokens = row.tokens.clone()
        tokens[: row.doc_text[0]] = (tokens[: row.doc_text[0]] + 1) % 512
        other, _ = hidden([_replace_tokens(row, tokens)])
        start0, n0 = spans[0]
        assert not torch.allclose(other[0, start0:start0 + n0], x[start0:start0 + n0])
        rest = spans[1][0]
        assert torch.equal(other[0, rest:lay.length], x[rest:lay.length])
        # the conditioning of a packed sequence is each document's last tokens
        cond = conditioning(x[None], [lay])[0]
        assert cond.shape[0] == sum(min(ir.COND_TOKENS, n) for _, n in spans)
        assert any(n > ir.COND_TOKENS for _, n in spans), "a document longer than the window"


def _documents(row):
    """The documents of a packed sample, each a sample of its own."""
    from dtdsl.models.inputs import Sample
    from dtdsl.models.multimodal import sample_sizes_of

    out, t0, i0 = [], 0, 0
    for d, doc in enumerate(sample_sizes_of(row).docs()):
        out.append(Sample(step=row.step, index=d, tokens=row.tokens[t0:t0 + doc.text_tokens],
                          images=row.images[i0:i0 + len(doc.image_shapes)], targets={},
                          image_at=doc.image_at, trained=doc.trained))
        t0, i0 = t0 + doc.text_tokens, i0 + len(doc.image_shapes)
    return out


def _replace_tokens(row, tokens):
    from dataclasses import replace

    return replace(row, tokens=tokens)


def test_synthetic_packed_batches_fill_their_sequences():
    program = packed(8)
    source = SyntheticSource(program)
    sizes = source.sizes(0)
    assert len(sizes) == 8 and len(source.keys(0)) == 8
    seq_len = program.train.seq_len
    lengths = [layout_of(z, P8, seq_len).length for z in sizes]
    assert all(n <= seq_len for n in lengths) and sum(z.num_docs for z in sizes) > 16
    assert sum(lengths) / (8 * seq_len) > 0.8       # packed, not one document each
    assert source.sizes(0) == sizes                 # a function of the step


def test_packed_sizes_are_priced_by_their_documents():
    """The cost model's view of real packed sequences (what reordering weighs) keeps
    their documents' squared lengths: attention is per document."""
    from dtdsl.data.batch import sample_set

    program = packed(8)
    sizes = SyntheticSource(program).sizes(0)
    squares = sample_set(program, sizes).doc_squares
    layouts = [layout_of(z, P8, 512) for z in sizes]
    assert squares.tolist() == [sum(n * n for _, n in lay.spans) for lay in layouts]
    assert sum(squares) < sum(lay.length ** 2 for lay in layouts)
    plain = small(8)
    assert sample_set(plain, SyntheticSource(plain).sizes(0)).doc_squares is None


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    (("vit", "encoder", 1, 1, 1), ("llm", "backbone", 2, 1, 2), ("gen", "generator", 1, 1, 1)),
    (("vit", "encoder", 1, 1, 1), ("llm", "backbone", 1, 2, 1), ("gen", "generator", 1, 1, 1)),
], ids=["tp2-sp-pp2", "dp2"])
def test_a_packed_run_equals_the_reference(layout):
    # Each step's loss and the final parameters are held to the reference. 4 steps (not
    # TP_STEPS' 6): attention across a document shows from the first step, and Adam's
    # moments go through several updates.
    program = packed(8)
    steps = 4
    losses, params = reference(program, steps)
    plan = plan_for(program, *layout)
    run(_train_tp, plan.gpus_used, program, plan, losses, params, steps, timeout=300)


def test_a_packed_epoch_of_a_dataset_uses_every_sample_once(tmp_path):
    """WebDataset shards with a tokenizer, packed: the sequences of epoch 0, read step by
    step, hold every sample exactly once, each cut to fit and none over seq_len; the
    next epoch starts right after, in another order; the reference trains on them."""
    from dtdsl.driver import run_frontend
    from dtdsl.feed.source import DatasetSource
    from dtdsl.train.reference import train_reference
    from tests.helpers.media import write_shards
    from tests.specs import TINY
    from tests.text_models import make_tokenizer

    keys = write_shards(tmp_path / "shards", n=40, per_shard=10)
    make_tokenizer(tmp_path / "tok")
    text = TINY.read_text().replace('source = "data/tiny"',
                                    'source = "shards"\n  tokenizer = "tok"').replace(
        "  seed             = 1234\n", "  seed             = 1234\n  packing = true\n").replace(
        "seq_len          = 512", "seq_len          = 128")
    spec = tmp_path / "tiny.dt"
    spec.write_text(text)
    program = run_frontend(str(spec), text.encode()).program
    source = DatasetSource(program, tmp_path / "shards")
    batch = program.train.global_batch
    rows = source.sequences_in_epoch(0)
    assert rows < len(keys)                     # several samples per sequence
    seen = []
    for step in range(-(-rows // batch)):
        for position, key in enumerate(source.keys(step)):
            if step * batch + position < rows:
                seen.extend(key.split("+"))
            assert layout_of(source.sizes(step)[position], P8, 128).length <= 128
    assert sorted(seen) == keys
    # the reference reads the same sequences (decoded, joined) and trains
    losses = [r["loss"] for r in train_reference(program, 2, source=source)]
    assert all(loss == loss and loss > 0 for loss in losses)
