"""Throughput of the preprocessing transport (``dtdsl.feed.wire``), and what authentication
costs, against plain zmq + msgpack measured in the same run.

Two payloads:

- ``microbatch``: what a tiny_cpu-like worker sends per microbatch: 4 uint8 images 3x64x64
  (one array each), 100 int64 tokens, float32 latents 4x8x8 and a small meta (~51 KB);
- ``4MiB``: one float32 array of 4 MiB (a large-image microbatch).

Two paths, each with a fresh sender process (``spawn``) and the receiver in this process,
over ipc and tcp loopback:

- ``wire``: ``Sender.send`` -> ``Receiver.recv``: HMAC-SHA256 on both sides, every check of
  ``decode``, read-only numpy views on receipt;
- ``plain``: the same frames without frame 0 on raw PUSH/PULL sockets: msgpack header packed
  per message, buffers sent with ``copy=False``, header unpacked and ``np.frombuffer`` per
  array on receipt; no tag, no checks. The baseline the HMAC cost is measured against.

Messages/s count the messages after ``--warmup``, from the first to the last received;
GB/s is payload bytes (all frames) per second. The two paths alternate ``--repeats``
times; medians are printed. Also printed: HMAC-SHA256 alone over one message, one core, in
this process. Sender and receiver share this machine's cores (2 on the development
machine), so the figures are for comparison within one run, not absolute capacities.

    python benchmarks/wire_throughput.py [--small 3000] [--large 150] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hmac
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable

import msgpack
import numpy as np
import zmq

from dtdsl.feed.wire import Receiver, Sender, new_secret

HWM = 16


def microbatch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {f"image{i}": rng.integers(0, 256, (3, 64, 64), dtype=np.uint8) for i in range(4)}
    arrays["tokens"] = rng.integers(0, 32_000, 100, dtype=np.int64)
    arrays["latents"] = rng.standard_normal((4, 8, 8)).astype(np.float32)
    return arrays


def large() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)}


PAYLOADS: dict[str, Callable[[], dict[str, np.ndarray]]] = {"microbatch": microbatch,
                                                            "4MiB": large}
META = {"step": 12, "microbatch": 3, "sample_ids": list(range(8))}


def plain_frames(arrays: dict[str, np.ndarray]) -> list:
    specs = [[name, str(a.dtype), list(a.shape), a.nbytes] for name, a in arrays.items()]
    header = msgpack.packb({"kind": "microbatch", "meta": META, "arrays": specs},
                           use_bin_type=True)
    return [header, *(memoryview(a.reshape(-1).view(np.uint8)) for a in arrays.values())]


def plain_decode(frames: list) -> dict[str, np.ndarray]:
    header = msgpack.unpackb(frames[0].buffer, raw=False)
    return {name: np.frombuffer(frame.buffer, dtype=dtype).reshape(shape)
            for (name, dtype, shape, _), frame in zip(header["arrays"], frames[1:],
                                                      strict=True)}


def send(address: str, path: str, payload: str, count: int, secret: bytes, done) -> None:
    """The sender process: ``count`` messages, then hold the socket open until the receiver
    has them all (over ipc libzmq drops what a closed socket still queues,
    zeromq/libzmq#4660)."""
    arrays = PAYLOADS[payload]()
    if path == "wire":
        with Sender(address, secret, hwm=HWM, linger_s=0.0) as sender:
            for _ in range(count):
                if not sender.send("microbatch", META, arrays, timeout_s=60.0):
                    raise SystemExit("the receiver took nothing for 60 s")
            done.wait(120.0)
        return
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, HWM)
    push.connect(address)
    for _ in range(count):
        push.send_multipart(plain_frames(arrays), copy=False)
    done.wait(120.0)
    push.close(linger=0)
    context.term()


def run(transport: str, path: str, payload: str, count: int, warmup: int) -> tuple[float, int]:
    """Messages per second and bytes per message of one sender process -> this one."""
    secret = new_secret()
    with tempfile.TemporaryDirectory(prefix="dtw", dir="/tmp") as folder:
        if path == "wire":
            receiver = (Receiver(f"ipc://{folder}/feed", secret, hwm=HWM)
                        if transport == "ipc" else Receiver.on_free_port(secret, hwm=HWM))
            address = receiver.address

            def receive() -> int:
                message = receiver.recv(timeout_s=60.0)
                if message is None:
                    raise SystemExit(f"nothing valid for 60 s; dropped: {receiver.dropped}")
                return message.nbytes
            close = receiver.close
        else:
            pull = zmq.Context.instance().socket(zmq.PULL)
            pull.setsockopt(zmq.RCVHWM, HWM)
            pull.setsockopt(zmq.LINGER, 0)
            if transport == "ipc":
                address = f"ipc://{folder}/feed"
                pull.bind(address)
            else:
                address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"

            def receive() -> int:
                if not pull.poll(60_000):
                    raise SystemExit("nothing for 60 s")
                arrays = plain_decode(pull.recv_multipart(copy=False))
                return sum(a.nbytes for a in arrays.values())
            close = pull.close

        context = mp.get_context("spawn")
        done = context.Event()
        sender = context.Process(target=send, args=(address, path, payload, warmup + count,
                                                    secret, done))
        sender.start()
        try:
            for _ in range(warmup):
                receive()
            start = time.perf_counter()
            nbytes = sum(receive() for _ in range(count))
            elapsed = time.perf_counter() - start
        finally:
            done.set()
            sender.join(30.0)
            close()
    return count / elapsed, nbytes // count


def hmac_alone(payload: str, repeats: int) -> tuple[float, float]:
    """Seconds per message and GB/s of HMAC-SHA256 over one message's buffers."""
    buffers = [memoryview(a.reshape(-1).view(np.uint8)) for a in PAYLOADS[payload]().values()]
    nbytes = sum(len(b) for b in buffers)
    secret = new_secret()
    start = time.perf_counter()
    for _ in range(repeats):
        mac = hmac.new(secret, digestmod="sha256")
        for buffer in buffers:
            mac.update(buffer)
        mac.digest()
    per_message = (time.perf_counter() - start) / repeats
    return per_message, nbytes / per_message / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=3000, help="microbatch messages per run")
    parser.add_argument("--large", type=int, default=150, help="4 MiB messages per run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    print(f"{'payload':<11} {'transport':<9} {'wire msg/s':>11} {'GB/s':>7} "
          f"{'plain msg/s':>12} {'GB/s':>7} {'wire/plain':>11} {'time +%':>8}")
    for payload, count in (("microbatch", args.small), ("4MiB", args.large)):
        for transport in ("ipc", "tcp"):
            rates: dict[str, list[float]] = {"wire": [], "plain": []}
            nbytes = 0
            for _ in range(args.repeats):
                for path in ("wire", "plain"):     # alternate: drift hits both alike
                    rate, nbytes = run(transport, path, payload, count, args.warmup)
                    rates[path].append(rate)
            wire, plain = (statistics.median(rates[p]) for p in ("wire", "plain"))
            print(f"{payload:<11} {transport:<9} {wire:>11,.0f} {wire * nbytes / 1e9:>7.2f} "
                  f"{plain:>12,.0f} {plain * nbytes / 1e9:>7.2f} {wire / plain:>10.2f}x "
                  f"{(plain / wire - 1) * 100:>7.0f}%")
    for payload in PAYLOADS:
        per_message, rate = hmac_alone(payload, 200 if payload == "4MiB" else 5000)
        print(f"HMAC-SHA256 alone, {payload}: {per_message * 1e6:,.1f} us/message "
              f"({rate:.2f} GB/s, one core; wire pays it on both sides)")


if __name__ == "__main__":
    main()
