"""Unit tests for examples/digits_common.py (IDX reader, dataset loading, batching)."""

from __future__ import annotations

import gzip
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import digits_common as dc  # noqa: E402

_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


def idx_bytes(arr: np.ndarray) -> bytes:
    """Serialize ``arr`` in IDX format (big-endian header and data)."""
    code = _CODES[arr.dtype.type]
    header = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, arr: np.ndarray) -> Path:
    data = idx_bytes(arr)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


# --------------------------------------------------------------------------- IDX reader


def test_read_idx_uint8_images_and_labels(tmp_path: Path) -> None:
    images = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    labels = np.array([7, 0, 9], dtype=np.uint8)
    img_path = write_idx(tmp_path / "imgs-idx3-ubyte", images)
    lbl_path = write_idx(tmp_path / "lbls-idx1-ubyte", labels)
    assert img_path.read_bytes()[:4] == b"\x00\x00\x08\x03"
    assert lbl_path.read_bytes()[:4] == b"\x00\x00\x08\x01"

    got_images = dc.read_idx(img_path)
    got_labels = dc.read_idx(lbl_path)
    assert got_images.dtype == np.uint8 and got_images.shape == (3, 4, 5)
    np.testing.assert_array_equal(got_images, images)
    assert got_labels.dtype == np.uint8 and got_labels.shape == (3,)
    np.testing.assert_array_equal(got_labels, labels)


def test_read_idx_gzip(tmp_path: Path) -> None:
    images = np.random.default_rng(0).integers(0, 256, size=(2, 3, 3), dtype=np.uint8)
    got = dc.read_idx(write_idx(tmp_path / "imgs-idx3-ubyte.gz", images))
    np.testing.assert_array_equal(got, images)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.float32, np.float64])
def test_read_idx_other_dtypes_are_big_endian(tmp_path: Path, dtype: type) -> None:
    arr = (np.arange(12).reshape(2, 6) - 5).astype(dtype) * (1.5 if np.issubdtype(dtype, np.floating) else 1)
    arr = arr.astype(dtype)
    got = dc.read_idx(write_idx(tmp_path / "x.idx", arr))
    assert got.dtype == np.dtype(dtype)  # native byte order
    assert got.dtype.isnative
    np.testing.assert_array_equal(got, arr)


def test_read_idx_int32_known_bytes(tmp_path: Path) -> None:
    path = tmp_path / "one.idx"
    path.write_bytes(bytes.fromhex("0000 0C 01 00000002 00000001 FFFFFFFE"))
    np.testing.assert_array_equal(dc.read_idx(path), np.array([1, -2], dtype=np.int32))


@pytest.mark.parametrize("cut", [1, 7, 20])
def test_read_idx_truncated_raises(tmp_path: Path, cut: int) -> None:
    data = idx_bytes(np.zeros((2, 4, 4), dtype=np.uint8))
    path = tmp_path / "short-idx3-ubyte"
    path.write_bytes(data[: len(data) - cut] if cut < len(data) else b"")
    with pytest.raises(ValueError, match="short-idx3-ubyte"):
        dc.read_idx(path)


def test_read_idx_truncated_header_raises(tmp_path: Path) -> None:
    path = tmp_path / "hdr-idx3-ubyte"
    path.write_bytes(bytes([0, 0, 8, 3]) + struct.pack(">I", 2))  # 1 of 3 dims present
    with pytest.raises(ValueError, match="hdr-idx3-ubyte"):
        dc.read_idx(path)


def test_read_idx_trailing_bytes_raises(tmp_path: Path) -> None:
    path = tmp_path / "long-idx1-ubyte"
    path.write_bytes(idx_bytes(np.zeros(3, dtype=np.uint8)) + b"\x00")
    with pytest.raises(ValueError, match="long-idx1-ubyte"):
        dc.read_idx(path)


@pytest.mark.parametrize("magic", [b"\x01\x00\x08\x01", b"\x00\x00\x07\x01", b"\x00\x00\x08\x00", b"PK\x03\x04"])
def test_read_idx_bad_magic_raises(tmp_path: Path, magic: bytes) -> None:
    path = tmp_path / "bad-magic.idx"
    path.write_bytes(magic + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(ValueError, match="bad-magic.idx"):
        dc.read_idx(path)


def test_read_idx_corrupt_gzip_raises(tmp_path: Path) -> None:
    path = tmp_path / "broken-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros(100, dtype=np.uint8)))[:-12])
    with pytest.raises(ValueError, match="broken-idx1-ubyte.gz"):
        dc.read_idx(path)


# --------------------------------------------------------------------------- MNIST loading


def make_mnist(directory: Path, n_train: int = 20, n_test: int = 10, gz: bool = False) -> None:
    rng = np.random.default_rng(1)
    sfx = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte{sfx}", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{sfx}", rng.integers(0, 10, n, dtype=np.uint8))


@pytest.mark.parametrize("gz", [False, True])
def test_load_dataset_mnist(tmp_path: Path, gz: bool) -> None:
    make_mnist(tmp_path, gz=gz)
    ds = dc.load_dataset(f"mnist:{tmp_path}", seed=0)
    assert ds.in_features == 784
    assert ds.train_x.shape == (20, 28, 28) and ds.train_x.dtype == torch.float32
    assert ds.test_x.shape == (10, 28, 28) and ds.test_x.dtype == torch.float32
    assert ds.train_y.shape == (20,) and ds.train_y.dtype == torch.int64
    assert ds.test_y.shape == (10,) and ds.test_y.dtype == torch.int64
    assert 0.0 <= float(ds.train_x.min()) and float(ds.train_x.max()) <= 1.0
    raw = dc.read_idx(next(tmp_path.glob("train-images-idx3-ubyte*")))
    np.testing.assert_array_equal(ds.train_x.numpy(), raw.astype(np.float32) / np.float32(255))
    # The MLP accepts the 784-pixel input.
    torch.manual_seed(0)
    assert dc.build_model(ds.in_features)(ds.test_x).shape == (10, 10)


def test_load_dataset_mnist_missing_file(tmp_path: Path) -> None:
    make_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        dc.load_dataset(f"mnist:{tmp_path}", seed=0)


def test_load_dataset_mnist_count_mismatch(tmp_path: Path) -> None:
    make_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(19, dtype=np.uint8))
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte"):
        dc.load_dataset(f"mnist:{tmp_path}", seed=0)


def test_load_dataset_unknown_spec() -> None:
    with pytest.raises(ValueError, match="unknown dataset spec"):
        dc.load_dataset("cifar", seed=0)


# --------------------------------------------------------------------------- digits split


def test_digits_split_deterministic_and_disjoint() -> None:
    a = dc.load_dataset("digits", seed=0)
    b = dc.load_dataset("digits", seed=0)
    assert a.in_features == 64
    assert len(a.train_y) + len(a.test_y) == 1797
    assert abs(len(a.test_y) / 1797 - 0.2) < 0.01
    assert a.train_x.shape[1:] == (8, 8) and a.train_x.dtype == torch.float32
    assert float(a.train_x.min()) == 0.0 and float(a.train_x.max()) == 1.0
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    # Disjoint: the sklearn digits set has no duplicate images, so compare rows.
    train_rows = {row.numpy().tobytes() for row in a.train_x.reshape(len(a.train_x), -1)}
    test_rows = {row.numpy().tobytes() for row in a.test_x.reshape(len(a.test_x), -1)}
    assert len(train_rows) == len(a.train_x) and len(test_rows) == len(a.test_x)
    assert not train_rows & test_rows
    # A different seed gives a different split.
    c = dc.load_dataset("digits", seed=1)
    assert not torch.equal(a.test_y, c.test_y)


# --------------------------------------------------------------------------- batching


def test_batch_indices_deterministic_and_independent_of_global_rng() -> None:
    first = dc.batch_indices(seed=3, step=5, rank=1, world_size=4, batch_size=32, n_train=1437)
    torch.manual_seed(12345)
    torch.rand(100)
    second = dc.batch_indices(seed=3, step=5, rank=1, world_size=4, batch_size=32, n_train=1437)
    assert torch.equal(first, second)
    assert first.dtype == torch.int64 and first.shape == (32,)
    assert not torch.equal(first, dc.batch_indices(4, 5, 1, 4, 32, 1437))  # seed matters


@pytest.mark.parametrize("step", [0, 1, 10, 11, 299])  # 1437 // 128 = 11 steps per epoch
def test_batch_indices_disjoint_across_ranks_and_in_range(step: int) -> None:
    n_train, world, bs = 1437, 4, 32
    batches = [dc.batch_indices(0, step, r, world, bs, n_train) for r in range(world)]
    everything = torch.cat(batches)
    assert everything.unique().numel() == world * bs
    assert int(everything.min()) >= 0 and int(everything.max()) < n_train


def test_batch_indices_cover_each_epoch_exactly_once() -> None:
    n_train, world, bs = 100, 2, 10  # 5 steps per epoch, nothing dropped
    epoch0 = torch.cat([dc.batch_indices(7, s, r, world, bs, n_train) for s in range(5) for r in range(world)])
    epoch1 = torch.cat([dc.batch_indices(7, s, r, world, bs, n_train) for s in range(5, 10) for r in range(world)])
    assert torch.equal(epoch0.sort().values, torch.arange(n_train))
    assert torch.equal(epoch1.sort().values, torch.arange(n_train))
    assert not torch.equal(epoch0, epoch1)  # reshuffled every epoch


def test_batch_indices_drop_last_no_repeats_within_epoch() -> None:
    n_train, world, bs = 105, 2, 10  # 5 steps per epoch, 5 samples dropped per epoch
    epoch0 = torch.cat([dc.batch_indices(1, s, r, world, bs, n_train) for s in range(5) for r in range(world)])
    assert epoch0.unique().numel() == 100
    nxt = dc.batch_indices(1, 5, 0, world, bs, n_train)
    assert not torch.equal(nxt, epoch0[:bs])  # step 5 starts epoch 1 with a fresh permutation


def test_batch_indices_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rank"):
        dc.batch_indices(0, 0, 4, 4, 8, 100)
    with pytest.raises(ValueError, match="exceeds"):
        dc.batch_indices(0, 0, 0, 4, 32, 100)


# --------------------------------------------------------------------------- misc helpers


def test_model_hash_eval_and_final_line() -> None:
    torch.manual_seed(0)
    m1 = dc.build_model()
    torch.manual_seed(0)
    m2 = dc.build_model()
    assert dc.params_sha256(m1) == dc.params_sha256(m2)
    assert len(dc.params_sha256(m1)) == 64
    with torch.no_grad():
        m2[-1].bias.add_(1.0)
    assert dc.params_sha256(m1) != dc.params_sha256(m2)

    x = torch.zeros(6, 8, 8)
    ds = dc.Dataset(train_x=x, train_y=torch.zeros(6, dtype=torch.int64), test_x=x,
                    test_y=torch.tensor([0, 1, 2, 3, 4, 5]), in_features=64)
    acc = dc.evaluate(m1, ds)
    assert acc in {0.0, 1 / 6}  # all-zero input -> one constant prediction
    assert m1.training

    line = dc.final_line(300, 0.0123456789, 0.98765, "ab" * 32)
    assert line == f"final step=300 loss=0.012346 test_accuracy=0.9877 params_sha256={'ab' * 32}"


def test_add_common_args_defaults() -> None:
    import argparse

    args = dc.add_common_args(argparse.ArgumentParser()).parse_args([])
    assert (args.steps, args.batch_size, args.lr, args.momentum, args.seed, args.data) == (
        300, 32, 0.05, 0.9, 0, "digits")
