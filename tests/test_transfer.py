"""Uploads through the pinned ring: every upload arrives intact, also after the ring wrapped
many times while earlier copies may still be in flight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridsim.device import transfer
from hybridsim.device.transfer import to_device, upload, upload_many


def test_upload_on_cpu_keeps_values_and_dtype():
    assert upload([3, -1, 7], "cpu").tolist() == [3, -1, 7]
    assert upload(np.array([[1.5, 2.0]]), "cpu", torch.float32).dtype == torch.float32
    assert upload(torch.tensor([1, 2]), "cpu", torch.int32).dtype == torch.int32


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_upload_many_keeps_shapes_values_and_16_byte_alignment(device, dtype):
    parts = [np.arange(5), np.array([[1, -2, 3]] * 3), np.zeros(0, dtype=np.int64), [7], np.arange(6).reshape(2, 3)]
    out = upload_many(parts, device, dtype)
    for p, t in zip(parts, out):
        assert t.dtype == dtype and t.device.type == device
        assert np.array_equal(t.cpu().numpy(), np.asarray(p).reshape(np.asarray(p).shape))
        assert (t.data_ptr() - out[0].data_ptr()) % 16 == 0


@pytest.mark.gpu
def test_ring_uploads_arrive_intact_across_wraps():
    dev = torch.device("cuda")
    rng = np.random.default_rng(5)
    sent, got = [], []
    big = torch.empty(1 << 26, device=dev)  # device work queued between uploads keeps copies in flight
    for i in range(600):  # ~ 10 MB of uploads: the 8 MB ring wraps
        n = int(rng.integers(1, 4096))
        a = rng.integers(-2**40, 2**40, size=n)
        sent.append(a)
        got.append(upload(a, dev) if i % 3 else to_device(torch.from_numpy(a.astype(np.float32)), dev))
        if i % 50 == 0:
            big.mul_(1.0001)
    whole = transfer.RING_SEGMENT * transfer.RING_SEGMENTS
    assert sum(a.nbytes for a in sent) > whole
    for i, (a, g) in enumerate(zip(sent, got)):
        want = a if i % 3 else a.astype(np.float32)
        assert np.array_equal(g.cpu().numpy(), want), i
    assert upload(np.zeros(0, dtype=np.int64), dev).shape == (0,)
    large = rng.integers(0, 9, size=transfer.RING_SEGMENT // 4)  # above a segment: pinned on its own
    assert np.array_equal(upload(large, dev).cpu().numpy(), large)


@pytest.mark.gpu
def test_ring_segments_are_reused_only_after_every_stream_read_them():
    """Uploads queued from a second stream that is held back: when the ring comes back to their
    segment it waits for that stream too, so what the held-back copies read is still theirs."""
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    rng = np.random.default_rng(9)
    sent, got = [], []
    with torch.cuda.stream(side):
        torch.cuda._sleep(300_000_000)  # the side stream's copies wait behind this
        for _ in range(8):
            a = rng.integers(-2**40, 2**40, size=2048)
            sent.append(a)
            got.append(upload(a, dev))
    for _ in range(transfer.RING_SEGMENTS * transfer.RING_SEGMENT // (8 * 4096) + 8):  # the ring wraps on main
        upload(rng.integers(0, 9, size=4096), dev)
    torch.cuda.synchronize()
    for a, g in zip(sent, got):
        assert np.array_equal(g.cpu().numpy(), a)


@pytest.mark.gpu
def test_to_device_takes_a_tensor_already_on_a_device():
    t = torch.arange(5, device="cuda")
    assert torch.equal(to_device(t, "cuda"), t) and to_device(t, "cpu").device.type == "cpu"
