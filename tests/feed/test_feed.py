"""The feed: batch order over epochs, worker messages against in-process batches, and a
live trainer inbox under hostile messages."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dtdsl import cli
from dtdsl.data.batch import LocalBatches
from dtdsl.feed import wire
from dtdsl.feed.client import FeedTimeout, RemoteBatches
from dtdsl.feed.protocol import BATCH, read_batch
from dtdsl.feed.source import DatasetSource, epoch_permutation, stream_indices
from dtdsl.feed.worker import FeedContext, build_messages
from dtdsl.ir.job import load_job
from dtdsl.parallel.mesh import role_of
from tests.helpers.feed import (
    _Message,
)

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "tiny_cpu.dt"


def test_stream_order_is_a_permutation_per_epoch_and_a_function_of_seed_and_step():
    n, batch = 40, 16
    stream = [i for step in range(5) for i in stream_indices(7, n, step, batch)]
    assert sorted(stream[:n]) == list(range(n))             # epoch 0: each once
    assert sorted(stream[n:2 * n]) == list(range(n))        # epoch 1: each once
    assert stream[:n] != stream[n:2 * n]                    # reshuffled
    assert stream_indices(7, n, 3, batch) == stream[48:64]  # any step alone
    assert not np.array_equal(epoch_permutation(7, 0, n), epoch_permutation(8, 0, n))
    with pytest.raises(ValueError, match="empty"):
        stream_indices(7, 0, 0, batch)


def make_bundle(root: Path, spec: Path, samples: int) -> Path:
    """``spec``'s bundle with one worker, fed by a dataset of ``samples`` synthesised here."""
    data = root / "data"
    assert cli.main(["data", "synth", str(spec), "-o", str(data), "--samples", str(samples),
                     "-q"]) == 0
    out = root / "bundle"
    assert cli.main(["compile", str(spec), "-o", str(out), "--data", str(data),
                     "--workers", "1"]) == 0
    return out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return make_bundle(tmp_path_factory.mktemp("feed"), SPEC, 40)




def _same_sample(a, b) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert len(a.images) == len(b.images)
    for x, y in zip(a.images, b.images, strict=True):
        assert torch.equal(x, y)
    assert a.targets.keys() == b.targets.keys()
    for name in a.targets:
        for field in ("latents", "noise", "timesteps"):
            assert torch.equal(getattr(a.targets[name], field), getattr(b.targets[name], field))


def test_worker_messages_equal_in_process_batches(bundle):
    ctx = FeedContext(bundle)
    # A node's worker builds its ranks' messages only, in the order asked.
    some = build_messages(ctx, 1, [3, 1])
    every = build_messages(ctx, 1)
    assert [m[0] for m in some] == [every[3][0], every[1][0]]
    units = [u.name for u in ctx.plan.units]
    generators = [g.name for g in ctx.program.generators]
    source = DatasetSource(ctx.program, ctx.source.path)
    for step in (0, 2, 3):      # step 2 crosses into the second epoch
        messages = build_messages(ctx, step)
        assert len(messages) == ctx.job.world_size
        for rank, (meta, arrays) in enumerate(messages):
            got = read_batch(_Message(meta, arrays), units, generators)
            want = LocalBatches(ctx.program, ctx.plan, role_of(ctx.plan, rank), source=source,
                                policy=ctx.policy, work_model=ctx.work_model).batch(step)
            assert got.step == want.step and got.normalizer == want.normalizer
            assert [(s.sample_ids, dict(s.assignment)) for s in got.routing] == \
                [(s.sample_ids, dict(s.assignment)) for s in want.routing]
            assert got.samples.keys() == want.samples.keys()
            for i in want.samples:
                _same_sample(got.samples[i], want.samples[i])
            assert got.keys == (want.keys if rank == 0 else ())


def test_a_live_trainer_inbox_takes_only_valid_batches(bundle, tmp_path):
    """Hostile messages (wrong secret, garbage, truncated, oversized), stale and duplicate
    steps against a RemoteBatches: it returns the valid batches in order and counts the rest."""
    job = load_job(bundle)
    ctx = FeedContext(bundle)
    secret = wire.read_secret(bundle / job.secret_file)
    role = role_of(ctx.plan, 1)                     # a backbone rank: tokens
    feed = RemoteBatches(job, bundle, ctx.program, ctx.plan, role, feed_dir=tmp_path,
                         local_rank=1, node_ranks=[0, 1], timeout_s=5.0)
    address = job.feed.trainer_address(tmp_path, 1)
    import zmq

    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.plain_username, raw.plain_password = b"dtdsl", wire.peer_token(secret)
    raw.connect(address)
    good = {step: build_messages(ctx, step)[1] for step in range(3)}
    try:
        frames = wire.encode(BATCH, *good[0], secret)
        raw.send_multipart(wire.encode(BATCH, *good[0], b"x" * 32))       # wrong secret
        raw.send_multipart([b"garbage"])
        raw.send_multipart(frames[:-1])                                   # truncated
        raw.send_multipart([bytes(f) for f in frames[:2]] + [b"\0" * (2 << 20)])  # bad size
        raw.send_multipart(wire.encode(BATCH, *good[1], secret))          # ahead: buffered
        raw.send_multipart(frames)
        raw.send_multipart(frames)                                        # duplicate
        first = feed.batch(0)
        assert first.step == 0 and first.wait_s >= 0
        assert feed.batch(1).step == 1
        raw.send_multipart(frames)                                        # stale
        raw.send_multipart(wire.encode(BATCH, *good[2], secret))
        assert feed.batch(2).step == 2
        assert sum(feed.dropped.values()) >= 4
        feed.timeout_s = 0.5
        start = time.monotonic()
        with pytest.raises(FeedTimeout, match="no data for step 3"):
            feed.batch(3)
        assert time.monotonic() - start < 3
    finally:
        raw.close(0)
        feed.close()


def test_a_node_worker_serves_the_ranks_its_trainers_announce_and_follows_restarts(
        bundle, tmp_path):
    """One node's worker knows no ranks until its first trainer announces them; it feeds
    those ranks by local rank. The first trainers take step 0 and die; their restart
    (a new session, the node now holding other ranks, as a new rendezvous may decide)
    gets step 0 again, for the new ranks."""
    import threading

    from dtdsl.feed.protocol import PROGRESS
    from dtdsl.feed.worker import run_worker

    job = load_job(bundle)
    ctx = FeedContext(bundle)
    secret = wire.read_secret(bundle / job.secret_file)
    assert job.world_size == 4 and job.feed.workers_per_node == 1
    status: list[int] = []
    worker = threading.Thread(target=lambda: status.append(run_worker(
        bundle, 0, run_dir=bundle / "run-node", feed_dir=tmp_path, steps=3)), daemon=True)
    worker.start()
    feeds: list[RemoteBatches] = []
    try:
        # The first trainers of this node: ranks 2 and 3, by local rank.
        dead = [wire.Receiver(job.feed.trainer_address(tmp_path, local), secret,
                              max_arrays=1 << 16) for local in range(2)]
        announce = wire.Publisher(job.feed.control_address(tmp_path), secret)
        deadline = time.monotonic() + 60
        got: list = [None, None]
        while None in got and time.monotonic() < deadline:
            announce.publish(PROGRESS, {"next_step": 0, "done": False, "session": "first",
                                        "ranks": [2, 3]})
            for local, inbox in enumerate(dead):
                got[local] = got[local] or inbox.recv(timeout_s=0.2)
        assert [m.meta["step"] for m in got] == [0, 0]
        want = build_messages(ctx, 0, [2, 3])
        assert [m.meta for m in got] == [w[0] for w in want]
        for inbox in dead:                          # ... and they die
            inbox.close(linger_s=0)
        announce.close()
        # The restart: this node now holds ranks 0 and 1.
        feeds = [RemoteBatches(job, bundle, ctx.program, ctx.plan, role_of(ctx.plan, r),
                               feed_dir=tmp_path, local_rank=r, node_ranks=[0, 1],
                               timeout_s=30.0) for r in (0, 1)]
        for feed in feeds:
            batch = feed.batch(0)
            assert batch.step == 0
        assert feeds[0].batch(1).step == 1
    finally:
        for feed in feeds:
            feed.close()                            # local rank 0 says done: the worker exits
        worker.join(timeout=30)
    assert not worker.is_alive() and status == [0]


def test_feed_processes_open_a_bounded_number_of_sockets(bundle, tmp_path):
    """A trainer's and a worker's zmq context refuse sockets past the plan's bound, so a
    large job fails loudly at the first socket too many."""
    import zmq

    job = load_job(bundle)
    limit = job.feed.max_sockets(job.gpus_per_node)
    assert limit == job.gpus_per_node + 3
    context = wire.bounded_context(limit)
    try:
        sockets = [context.socket(zmq.PUSH) for _ in range(limit)]
        with pytest.raises(zmq.ZMQError):
            context.socket(zmq.PUSH)
    finally:
        for sock in sockets:
            sock.close(0)
        context.term()


def test_packed_sequences_travel_with_their_documents(tmp_path):
    """With train.packing, a worker's messages carry each position's documents: the
    trainers' batches equal the in-process ones, sizes (documents included) and all."""
    spec = tmp_path / "packed.dt"
    spec.write_text(SPEC.read_text().replace(
        "  seed             = 1234\n", "  seed             = 1234\n  packing = true\n"))
    ctx = FeedContext(make_bundle(tmp_path, spec, 60))
    assert ctx.program.train.packing
    units = [u.name for u in ctx.plan.units]
    generators = [g.name for g in ctx.program.generators]
    source = DatasetSource(ctx.program, ctx.source.path)
    packed = 0
    for step in (0, 1):
        for rank, (meta, arrays) in enumerate(build_messages(ctx, step)):
            got = read_batch(_Message(meta, arrays), units, generators)
            want = LocalBatches(ctx.program, ctx.plan, role_of(ctx.plan, rank), source=source,
                                policy=ctx.policy, work_model=ctx.work_model).batch(step)
            assert got.sizes == want.sizes and got.normalizer == want.normalizer
            packed += sum(z.num_docs > 1 for z in got.sizes)
            for i in want.samples:
                _same_sample(got.samples[i], want.samples[i])
                assert got.samples[i].doc_text == want.samples[i].doc_text
                assert got.samples[i].doc_gen == want.samples[i].doc_gen
    assert packed > 0


def test_workers_skip_and_stand_in_for_bad_samples_as_the_in_process_feed_does(tmp_path):
    """A dataset with an image that does not decode, and a sample whose shard changes
    under the running job: the worker's messages never fail, and equal, rank by rank, the
    batches every trainer builds in-process (the same samples skipped, the same stand-in)."""
    from dtdsl.driver import run_frontend
    from tests.helpers.media import corrupt_dataset, image_samples

    program = run_frontend(str(SPEC), SPEC.read_bytes()).program
    some = image_samples(program, 40)
    data = corrupt_dataset(tmp_path / "data", program, 40, {some[1]: ("cut", 0.5),
                                                             some[-2]: ("scramble", 0.0)})
    bundle = tmp_path / "bundle"
    assert cli.main(["compile", str(SPEC), "-o", str(bundle), "--data", str(data),
                     "--workers", "1"]) == 0
    ctx = FeedContext(bundle)
    assert ctx.source.left_out == {"does not decode": 2}
    # A used sample's shard changes after the samples were chosen: its CRC fails now.
    first = ctx.source.rows(0)[0][0]
    info = ctx.source.dataset.info(first)
    shard = data / info.shard
    raw = bytearray(shard.read_bytes())
    raw[info.members[0].offset] ^= 0xFF
    shard.write_bytes(bytes(raw))
    source = DatasetSource(ctx.program, ctx.source.path)
    units = [u.name for u in ctx.plan.units]
    generators = [g.name for g in ctx.program.generators]
    for step in (0, 1):
        for rank, (meta, arrays) in enumerate(build_messages(ctx, step)):
            got = read_batch(_Message(meta, arrays), units, generators)
            want = LocalBatches(ctx.program, ctx.plan, role_of(ctx.plan, rank), source=source,
                                policy=ctx.policy, work_model=ctx.work_model).batch(step)
            assert got.normalizer == want.normalizer and got.samples.keys() == \
                want.samples.keys()
            for i in want.samples:
                _same_sample(got.samples[i], want.samples[i])
    assert first in ctx.source.replaced and first in source.replaced


def test_images_travel_as_uint8_pixels_and_are_normalised_where_they_are_packed(bundle):
    """The feed (worker messages and the in-process feed alike) hands trainers uint8
    pixels, a quarter of float32's bytes to pin and copy; ``Pixels`` normalises each packed
    group on the encoder's device to the bit of the float32 images the trainers used to
    make on the feed's thread (``normalize``)."""
    from dtdsl.data.images import normalize
    from dtdsl.ir.modal import pixel_norm
    from dtdsl.models.inputs import Pixels, pack_images

    ctx = FeedContext(bundle)
    units = [u.name for u in ctx.plan.units]
    generators = [g.name for g in ctx.program.generators]
    source = DatasetSource(ctx.program, ctx.source.path)
    mean, std = pixel_norm(ctx.program)
    patch = next(m for m in ctx.program.encoders).arch.patch
    checked = 0
    for rank, (meta, arrays) in enumerate(build_messages(ctx, 0)):
        got = read_batch(_Message(meta, arrays), units, generators)
        want = LocalBatches(ctx.program, ctx.plan, role_of(ctx.plan, rank), source=source,
                            policy=ctx.policy, work_model=ctx.work_model).batch(0)
        for batch in (got, want):
            images = [list(s.images) for s in batch.samples.values()]
            if not any(images):
                continue
            assert {im.dtype for ims in images for im in ims} == {torch.uint8}
            packed = pack_images(images, patch, Pixels(mean, std))
            before = pack_images([[normalize(im, mean, std) for im in ims] for ims in images],
                                 patch)
            assert len(packed.groups) == len(before.groups)
            for a, b in zip(packed.groups, before.groups, strict=True):
                assert a.dtype == torch.float32 and torch.equal(a, b)
            checked += 1
    assert checked >= 2


def test_pixels_refuse_what_is_not_an_rgb_image():
    from dtdsl.models.inputs import Pixels

    pixels = Pixels((0.5,) * 3, (0.5,) * 3)
    floats = torch.rand(2, 3, 4, 4)
    assert pixels(floats) is floats     # synthetic images: already normalised
    assert torch.equal(pixels(torch.full((3, 2, 2), 255, dtype=torch.uint8)),
                       torch.ones(3, 2, 2))
    with pytest.raises(ValueError, match="3 colour channels"):
        pixels(torch.zeros(4, 2, 2, dtype=torch.uint8))
