"""Corrupted sets are byte-identical across processes (and Python hash seeds) and worker counts."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core import corruptions as C

REPO = Path(__file__).resolve().parents[1]
FMNIST = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")

_SCRIPT = """
import gzip, sys
import numpy as np
from core import corruptions as C
with gzip.open(sys.argv[1]) as f:
    x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28, 1)[:6]
idx = np.arange(40, 46)
labels = np.arange(6) % 10
pairs = [(c, s) for c in C.CORRUPTIONS for s in (1, 5)]
for c, s, out in C.iter_sets(x, pairs, seed=7, indices=idx, workers=1, chunk_size=4):
    meta = C.set_meta(c, s, seed=7, band="cifar", image_shape=out.shape[1:], n=len(out), source="t")
    C.write_set(C.set_path(sys.argv[2], c, s), out, labels, idx, meta)
"""


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.parquet"))}


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    if not FMNIST.is_file():
        pytest.skip("Fashion-MNIST IDX files not installed")
    with gzip.open(FMNIST) as f:
        return np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28, 1)[:6].copy()


@pytest.mark.slow  # two fresh interpreters: ~3 s on an idle machine, more when it is shared
def test_two_processes_write_byte_identical_sets(tmp_path, images):
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = []
    for out, hash_seed in zip(outs, ("1", "2")):  # different str hashes: nothing may depend on hash()
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        procs.append(
            subprocess.Popen([sys.executable, "-c", _SCRIPT, str(FMNIST), str(out)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    a, b = _files(outs[0]), _files(outs[1])
    assert len(a) == 38 and a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name
    # and the files hold what this process computes
    for c in ("glass_blur", "impulse_noise", "frost"):
        got = C.read_set(C.set_path(outs[0], c, 5)).images
        assert np.array_equal(got, C.corrupt_batch(images, c, 5, seed=7, indices=np.arange(40, 46))), c


@pytest.mark.slow
def test_worker_pool_gives_the_same_sets_as_one_process(images):
    pairs = [(c, 3) for c in C.CORRUPTIONS]
    idx = np.arange(100, 106)
    one = {(c, s): x for c, s, x in C.iter_sets(images, pairs, seed=2, indices=idx, workers=1)}
    two = {(c, s): x for c, s, x in C.iter_sets(images, pairs, seed=2, indices=idx, workers=2, chunk_size=2)}
    assert one.keys() == two.keys() == set(pairs)
    for key in pairs:
        assert np.array_equal(one[key], two[key]), key
