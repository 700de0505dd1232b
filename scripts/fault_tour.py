"""A tour of bad inputs and faults against a tiny workspace: what each one exits with, what it prints, what it
writes, and whether it leaves an MLflow run RUNNING or a process behind.

    .venv/bin/python scripts/fault_tour.py [--out tour.md] [--keep DIR]

Every case runs against its own copy of a tiny finished chain (Fashion-MNIST slice, one pretraining and one
fine-tuning epoch, a few corrupted sets, tracking on in the workspace's sqlite store), so cases do not see each
other's damage. A case passes when the exit status is the expected one, stderr is one line (MLflow's own INFO
logging aside; stop signals: the last line), nothing unexpected was written, no run is left RUNNING, no sqlite
``-journal`` is left beside a store and no process it started outlives it. Exit status: the number of failing
cases (0 = all behaved).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TINY = """\
seed: 0
data: {{dir: data/fmnist, val_size: 200, sample_fraction: 0.03, fraction_scales_epochs: false}}
model: {{kind: tcnn, arch: resnet10_cifar}}
pretrain: {{epochs: 1, batch_size: 60, warmup_epochs: 0.2}}
reparam: {{epoch: 1}}
finetune: {{epochs: 1, batch_size: 60, warmup_epochs: 0.2}}
robustness: {{dir: data/c, n_images: 60, corruptions: [gaussian_noise, contrast, frost], severities: [1, 3], bootstrap: 50, workers: 2}}
tracking: {{uri: sqlite:///mlruns.db, experiment: tour}}
{extra}"""
CHAIN = ("prepare", "check", "pretrain", "reparam", "finetune", "control", "corrupt", "evaluate", "report")


@dataclass
class Case:
    name: str
    cmd: list[str]
    status: int
    setup: Callable[[Path], None] | None = None
    # (signal, a path that exists once the stage is under way, or seconds to wait)
    signal_after: tuple[int, str | float] | None = None
    may_write: tuple[str, ...] = ()  # path prefixes this case is allowed to create or change
    # (a fault done to the workspace, a path that exists once the stage is under way): a fault while it runs
    during: tuple[Callable[[Path], None], str] | None = None
    store: str = "mlruns.db"  # the store whose runs must not be left RUNNING
    env: dict[str, str] = field(default_factory=dict)
    expect: str = ""  # text the last line must hold (what the ending must say, not only that it ends)
    multi_line: bool = (
        False  # a command that reports progress (a sweep): no traceback instead of one line, and
    )
    # ``expect`` anywhere in its output (a sweep's table and status are on stdout)
    result: dict = field(default_factory=dict)


def stage(name: str, *args: str) -> list[str]:
    return [PY, "-m", f"stages.{name}", *args]


def tcnn(*args: str) -> list[str]:
    return [PY, "-m", "pipelines.cli", *args]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("TCNN_", "MLFLOW_"))}
    return {**e, "TCNN_QUIET": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def listing(root: Path) -> dict[str, float]:
    skip = ("mlruns.db", "mlartifacts", ".tcnn.lock", "mlruns.db.lock", "__pycache__")
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")
            if p.is_file() and not str(p.relative_to(root)).startswith(skip)}  # fmt: skip


def running_runs(root: Path, store: str = "mlruns.db") -> list[str]:
    from mlflow import MlflowClient

    if not (root / store).exists():
        return []
    try:
        client = MlflowClient(f"sqlite:///{root / store}")
        exps = [e.experiment_id for e in client.search_experiments()]
    except Exception:  # the case damaged the store: no run in it can have been opened or left open
        return []
    runs = client.search_runs(exps, "attributes.status = 'RUNNING'") if exps else []
    return [f"{r.info.run_name}" for r in runs]


def build_chain(base: Path) -> None:
    (base / "params.yaml").write_text(TINY.format(extra=""))
    for name in CHAIN:
        p = subprocess.run(stage(name), cwd=base, env=env(), capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"fault_tour: building the tiny chain failed at {name}:\n{p.stderr[-3000:]}")


def run_case(case: Case, base: Path, scratch: Path) -> None:
    import psutil

    ws = scratch / case.name.replace(" ", "_").replace("/", "_")
    shutil.copytree(base, ws, symlinks=True)
    if case.setup:
        case.setup(ws)
    before = listing(ws)
    t0 = time.monotonic()
    proc = subprocess.Popen(case.cmd, cwd=ws, env={**env(), **case.env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    family: set = set()
    if case.during:
        fault, marker = case.during
        _wait_for(proc, ws, marker)
        if proc.poll() is None:
            fault(ws)
    if case.signal_after:
        sig, marker = case.signal_after
        _wait_for(proc, ws, marker)
        with_children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        family = set(with_children)
        if proc.poll() is None:
            proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    time.sleep(0.5)
    left = [p.pid for p in family if _alive(p)]
    with_session = [p.pid for p in psutil.process_iter() if _session(p) == proc.pid and _alive(p)]
    after = listing(ws)
    changed = sorted(k for k, v in after.items() if before.get(k) != v)
    # A run that succeeds writes what it writes; a refused or stopped one only what its case allows.
    unexpected = [c for c in changed if not c.startswith(case.may_write)] if case.status != 0 else []
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and " INFO mlflow." not in ln
             and not re.match(r"\w+ epoch \d+/\d+ \|", ln)]  # fmt: skip  # MLflow's logging, training progress
    one_line = len(lines) == 1 or (case.signal_after is not None and lines and "stopped by" in lines[-1])
    if case.status == 0 or case.multi_line:
        one_line = "Traceback" not in err and bool(lines or case.status == 0)
    # a refusal's one line says it; a run that goes on (exit 0, a sweep) says it somewhere in its output
    said = (
        case.expect in out + err
        if case.multi_line or case.status == 0
        else case.expect in (lines[-1] if lines else "")
    )
    running = running_runs(ws, case.store)
    journals = [str(p.relative_to(ws)) for p in ws.rglob("*-journal")] if ws.is_dir() else []
    ok = (
        proc.returncode == case.status
        and one_line
        and said
        and not unexpected
        and not running
        and not journals
        and not left + with_session
    )
    case.result = {"ok": ok, "status": proc.returncode, "line": lines[-1][:160] if lines else "", "written": changed,
                   "unexpected": unexpected, "running": running, "journals": journals, "left": left + with_session, "stderr": lines[-4:],
                   "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


def _wait_for(proc: subprocess.Popen, ws: Path, marker: str | float) -> None:
    """Until ``marker`` (a path in ``ws``) exists, or for ``marker`` seconds, or until the process ended."""
    deadline = time.monotonic() + (marker if isinstance(marker, float) else 600)
    while proc.poll() is None and time.monotonic() < deadline:
        if isinstance(marker, str) and (ws / marker).exists():
            time.sleep(0.5)
            break
        time.sleep(0.05)


def _alive(p) -> bool:
    """Running and not a zombie (this sandbox's init does not always reap orphans at once)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _session(p) -> int | None:
    try:
        return os.getsid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


def flip(rel: str, where: float = 0.5) -> Callable[[Path], None]:
    def do(ws: Path) -> None:
        path = ws / rel
        data = bytearray(path.read_bytes())
        data[int(len(data) * where)] ^= 0xFF
        path.write_bytes(bytes(data))

    return do


def truncate(rel: str) -> Callable[[Path], None]:
    def do(ws: Path) -> None:
        path = ws / rel
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])

    return do


def remove(*rels: str) -> Callable[[Path], None]:
    def do(ws: Path) -> None:
        for rel in rels:
            p = ws / rel
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)

    return do


def write(rel: str, text: str) -> Callable[[Path], None]:
    def do(ws: Path) -> None:
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)

    return do


def holder(ws: Path) -> None:
    """Another live process holds the workspace (it is killed by the scratch cleanup)."""
    code = ("import sys,time; from core.utils.workspace import workspace_lock\n"
            "with workspace_lock(sys.argv[1], 'python -m stages.pretrain'):\n print('held', flush=True); time.sleep(600)")  # fmt: skip
    p = subprocess.Popen([PY, "-c", code, str(ws)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    HOLDERS.append(p)


def dead_holder(ws: Path) -> None:
    holder(ws)
    p = HOLDERS.pop()
    p.kill()
    p.wait()


HOLDERS: list[subprocess.Popen] = []


def busy_after_dvc_removed(rel: str) -> Callable[[Path], None]:
    """What a second `dvc repro` meets while a stage holds the workspace: DVC has removed the stage's outputs
    (``rel``) before starting it, and the lock is held."""

    def do(ws: Path) -> None:
        remove(rel)(ws)
        holder(ws)

    return do


def wrapped_checkpoint(ws: Path) -> None:
    """A checkpoint whose state dict sits under a key no loader knows, named by params.yaml's pretrain.source."""
    import hashlib

    import torch
    import yaml

    torch.save({"weights": {"conv.weight": torch.zeros(2, 1, 3, 3)}, "epoch": 3}, ws / "w.pt")
    raw = yaml.safe_load((ws / "params.yaml").read_text())
    digest = hashlib.sha256((ws / "w.pt").read_bytes()).hexdigest()
    raw["pretrain"]["source"] = {"weights": "w.pt", "sha256": digest, "mean": [0.5], "std": [0.5]}
    (ws / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def replace_by_file(rel: str) -> Callable[[Path], None]:
    def do(ws: Path) -> None:
        remove(rel)(ws)
        (ws / rel).write_text("a file where a folder should be\n")

    return do


def replace_by_dir(rel: str) -> Callable[[Path], None]:
    def do(ws: Path) -> None:
        remove(rel)(ws)
        (ws / rel).mkdir()

    return do


def dangling(rel: str) -> Callable[[Path], None]:
    def do(ws: Path) -> None:
        remove(rel)(ws)
        (ws / rel).symlink_to(ws / "gone")

    return do


def respec(rel: str, **spec: str) -> Callable[[Path], None]:
    """Rewrite a checkpoint as another run's (its model_spec changed, its content checksum made anew)."""

    def do(ws: Path) -> None:
        import torch

        from core.training.checkpoint import atomic_save

        ckpt = torch.load(ws / rel, map_location="cpu", weights_only=False)
        ckpt.pop("_content_sha256", None)
        atomic_save({**ckpt, "model_spec": {**ckpt["model_spec"], **spec}}, ws / rel)

    return do


def store_held(ws: Path) -> None:
    """Another process holds the sqlite store's write lock for 60 s (killed by the scratch cleanup)."""
    code = ("import sqlite3,sys,time; c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); time.sleep(60)")  # fmt: skip
    p = subprocess.Popen([PY, "-c", code, str(ws / "mlruns.db")], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    HOLDERS.append(p)


def store_in(folder: str) -> Callable[[Path], None]:
    """A copy of the workspace's store in ``folder`` (the case runs with tracking.uri naming it)."""

    def do(ws: Path) -> None:
        (ws / folder).mkdir()
        shutil.copy2(ws / "mlruns.db", ws / folder / "mlruns.db")

    return do


def replace_store(ws: Path) -> None:
    """Another file, not an sqlite database, renamed into the store's place (as an editor or a copy does)."""
    (ws / "other").write_text("not a database\n" * 100)
    os.replace(ws / "other", ws / "mlruns.db")


def under_size_limit(cmd: list[str], above_store: int) -> list[str]:
    """``cmd`` under a file-size limit (RLIMIT_FSIZE) of the store's size plus ``above_store`` bytes: the
    store's first write that grows the file fails (EFBIG; Python ignores SIGXFSZ), as on a disk filling up."""
    limit = f"$(( $(stat -c %s mlruns.db) + {above_store} ))"
    return ["sh", "-c", f'exec prlimit --fsize={limit} "$@"', "sh", *cmd]


def read_only_store_case() -> Case:
    """The store cannot be written: a read-only bind mount of its folder where this runs as root (root writes
    a file whatever its mode) and may mount (``unshare -m``), else the store's file made read-only."""
    uri = "tracking.uri=sqlite:///store/mlruns.db"
    mount = 'mount --bind store store && mount -o remount,bind,ro store && exec "$@"'
    can_mount = os.geteuid() == 0 and shutil.which("unshare") is not None
    if can_mount and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0:
        return Case("mlruns.db in a read-only folder", ["unshare", "-m", "sh", "-c", mount, "sh", *stage("report", "-S", uri)],
                    74, store_in("store"), store="store/mlruns.db")  # fmt: skip
    return Case("mlruns.db read-only", stage("report"), 74, lambda ws: (ws / "mlruns.db").chmod(0o444))


def cifar_c_of(shape: tuple[int, ...], labels_dtype: str = "int64") -> Callable[[Path], None]:
    """A CIFAR-10-C-layout folder ``pub`` of the tour's corruptions: zero images of ``shape``, 60 labels."""

    def do(ws: Path) -> None:
        import numpy as np

        (ws / "pub").mkdir()
        for c in ("gaussian_noise", "contrast", "frost"):
            np.save(ws / "pub" / f"{c}.npy", np.zeros(shape, np.uint8))
        np.save(ws / "pub" / "labels.npy", (np.arange(shape[0]) % 10).astype(labels_dtype))

    return do


def cases() -> list[Case]:
    c = []
    add = c.append
    bad = "runs/", "results/", "data/"
    # -- params: one line, exit 2, nothing written
    add(Case("validate a directory", tcnn("validate", "."), 2))
    add(Case("params file missing", stage("pretrain", "--params", "nope.yaml"), 2))
    add(
        Case(
            "duplicate YAML key",
            stage("pretrain", "--params", "dup.yaml"),
            2,
            write("dup.yaml", "pretrain: {epochs: 1, epochs: 7}\n"),
        )
    )
    add(
        Case(
            "YAML syntax error",
            stage("pretrain", "--params", "bad.yaml"),
            2,
            write("bad.yaml", "seed: 0\ndata:\n  name: [x\n"),
        )
    )
    add(
        Case(
            "top level not a mapping",
            stage("pretrain", "--params", "list.yaml"),
            2,
            write("list.yaml", "- 1\n- 2\n"),
        )
    )
    add(Case("unknown key", stage("pretrain", "-S", "pretrain.epochz=3"), 2))
    add(Case("override without =", stage("pretrain", "-S", "pretrain.epochs"), 2))
    add(Case("negative epochs", stage("pretrain", "-S", "pretrain.epochs=-1"), 2))
    add(Case("sample_fraction 1.5", stage("pretrain", "-S", "data.sample_fraction=1.5"), 2))
    add(Case("unknown dataset", stage("prepare", "-S", "data.name=mnist"), 2))
    add(Case("unknown model kind", stage("pretrain", "-S", "model.kind=vit"), 2))
    add(Case("unknown arch", stage("pretrain", "-S", "model.arch=resnet9000"), 2))
    add(Case("t1 beyond pretraining", stage("reparam", "-S", "reparam.epoch=5"), 2))
    add(Case("batch not divisible by workers", stage("pretrain", "-S", "workers_per_trial=7"), 2))
    # issue 37: non-finite floats, a seed beyond 64 bits, an override that is not YAML
    add(Case("alpha_init NaN", stage("reparam", "-S", "reparam.alpha_init=.nan"), 2))
    add(Case("lambda_init infinite", stage("reparam", "-S", "reparam.lambda_init=.inf"), 2))
    add(Case("lr infinite", stage("finetune", "-S", "finetune.lr=.inf"), 2))
    add(Case("seed beyond 64 bits", stage("pretrain", "-S", f"seed={2**64}"), 2))
    add(Case("override with an unclosed {", stage("pretrain", "-S", "pretrain.epochs={"), 2))
    add(Case("alexnet baseline on 28 px", stage("evaluate", "-S", "robustness.baseline=alexnet"), 2))
    add(Case("corrupted sets inside data.dir", stage("corrupt", "-S", "robustness.dir=data/fmnist/c"), 2))
    add(
        Case(
            "evaluate asks for more images than the sets hold",
            stage("evaluate", "-S", "robustness.n_images=90"),
            2,
        )
    )
    add(Case("report from a damaged equivalence.json", stage("report"), 2,
             write("runs/reparam/equivalence.json", '{"max_abs_logit_diff": 0.1')))  # fmt: skip
    public = "robustness.public={kind: cifar10_c, dir: pub, use: add}"
    add(Case("published sets of 32 px RGB on 28 px grayscale", stage("evaluate", "-S", public), 2,
             cifar_c_of((300, 32, 32, 3))))  # fmt: skip
    add(
        Case(
            "validate: CIFAR-10-C for a Fashion-MNIST run",
            tcnn("validate", "-S", public),
            2,
            cifar_c_of((300, 32, 32, 3)),
        )
    )
    # named cifar10, so that the layout fits by name: the arrays are checked against the 28 px test split
    add(Case("published sets with float labels", stage("evaluate", "-S", public, "-S", "data.name=cifar10"), 2,
             cifar_c_of((300, 28, 28, 1), "float64")))  # fmt: skip
    add(Case("model option drop_rate 2", stage("pretrain", "-S", "model.options={drop_rate: 2}"), 2))
    add(
        Case(
            "model option in_chans 3 on 1-channel data",
            stage("pretrain", "-S", "model.options={in_chans: 3}"),
            2,
        )
    )
    add(Case("a 224 px ViT on 28 px images",
             stage("pretrain", "-S", "model.kind=cnn", "-S", "model.arch=vit_tiny_patch16_224"), 2))  # fmt: skip
    add(Case("unknown corruption", stage("corrupt", "-S", "robustness.corruptions=[rain]"), 2))
    add(Case("severity 6", stage("corrupt", "-S", "robustness.severities=[6]"), 2))
    add(Case("precision fp64", stage("pretrain", "-S", "precision=fp64"), 2))
    add(Case("stride mode unknown", stage("reparam", "-S", "reparam.stride_mode=s2"), 2))
    add(
        Case(
            "select over a non-grid key",
            tcnn("validate", "params.yaml", "-S", "sweep.select.over=[finetune.lr]"),
            2,
        )
    )
    add(
        Case(
            "published sets dir missing",
            stage("evaluate", "-S", "robustness.public={kind: cifar10_c, dir: nowhere}"),
            2,
        )
    )
    add(Case("bad checkpoint-steps env", stage("pretrain"), 2, env={"TCNN_CHECKPOINT_EVERY_STEPS": "abc"}))
    # -- inputs: checked before any run opens
    add(
        Case(
            "archive missing",
            stage(
                "prepare",
                "-S",
                "data.name=imagefolder",
                "-S",
                "data.source=nowhere.tar.gz",
                "-S",
                "data.dir=data/x",
            ),
            2,
        )
    )
    add(Case("archive truncated", stage("prepare", "-S", "data.name=imagefolder", "-S", "data.source=t.tar.gz", "-S", "data.dir=data/x"), 2,
             write("t.tar.gz", "\x1f\x8b\x08\x00garbage")))  # fmt: skip
    add(Case("data.dir is not a dataset", stage("prepare", "-S", "data.dir=runs"), 2))
    add(
        Case(
            "more corrupted images than the test split",
            stage("corrupt", "-S", "robustness.n_images=20000"),
            2,
        )
    )
    add(Case("baseline file missing", stage("evaluate", "-S", "robustness.baseline=nowhere.json"), 2))
    add(
        Case(
            "baseline file not JSON",
            stage("evaluate", "-S", "robustness.baseline=b.json"),
            2,
            write("b.json", "{not json"),
        )
    )
    add(Case("evaluate without checkpoints", stage("evaluate"), 2, remove("runs/finetune")))
    add(Case("reparam without pretraining", stage("reparam"), 2, remove("runs/pretrain")))
    add(Case("finetune without reparam", stage("finetune"), 2, remove("runs/reparam")))
    add(Case("MLflow server down", stage("corrupt", "-S", "tracking.uri=http://127.0.0.1:9"), 2))
    # -- damaged data: found where it is read (after the stage's runs opened: they end FAILED)
    opened = ("runs/mlflow_runs.json",)
    add(
        Case(
            "damaged training shard",
            stage("pretrain"),
            2,
            flip("data/fmnist/train-00000.parquet"),
            may_write=opened,
        )
    )
    add(Case("damaged corrupted set: evaluate", stage("evaluate"), 2, flip("data/c/contrast/1.parquet"),
             may_write=opened))  # fmt: skip
    add(Case("damaged corrupted set: corrupt regenerates", stage("corrupt"), 0, flip("data/c/contrast/1.parquet"),
             may_write=("data/c/",)))  # fmt: skip
    add(Case("truncated pretraining checkpoint", stage("reparam"), 2, truncate("runs/pretrain/ckpt/ckpt-epoch-001.pt"),
             may_write=opened))  # fmt: skip
    add(
        Case(
            "damaged T-CNN checkpoint",
            stage("evaluate"),
            2,
            flip("runs/finetune/tcnn-final.pt", 0.7),
            may_write=opened,
        )
    )
    add(
        Case(
            "checkpoint that is JSON",
            stage("evaluate"),
            2,
            write("runs/finetune/tcnn-final.pt", "{}"),
            may_write=opened,
        )
    )
    # -- one writer
    add(Case("second writer", stage("pretrain"), 2, holder))
    add(Case("lock of a SIGKILLed holder", stage("corrupt"), 0, dead_holder, may_write=("data/c/",)))
    # -- I/O and store faults: one line naming the file (or the store), exit 74 (EX_IOERR), no run left RUNNING
    add(Case("runs is a file", stage("corrupt", "-S", "robustness.dir=data/c2"), 74, replace_by_file("runs"),
             may_write=bad))  # fmt: skip
    add(Case("data is a dangling symlink", stage("pretrain"), 2, dangling("data")))
    add(Case("the lock path is a folder", stage("report"), 74, replace_by_dir(".tcnn.lock")))
    add(Case("mlruns.db damaged", stage("report"), 74, write("mlruns.db", "not a database\n" * 100)))
    add(Case("mlruns.db held by another writer", stage("report"), 74, store_held, may_write=bad))
    # the store's file gone, replaced, unwritable or full while a stage runs (issue 47): one line naming it
    under_way = "runs/.partial/pretrain"
    add(Case("mlruns.db deleted during pretraining", stage("pretrain"), 74, remove("runs/pretrain"), may_write=bad,
             during=(remove("mlruns.db"), under_way)))  # fmt: skip
    add(Case("mlruns.db replaced by a file that is not a database during pretraining", stage("pretrain"), 74,
             remove("runs/pretrain"), may_write=bad, during=(replace_store, under_way)))  # fmt: skip
    add(Case("mlruns.db removed with its folder during pretraining",
             stage("pretrain", "-S", "tracking.uri=sqlite:///store/mlruns.db"), 74, remove("runs/pretrain"),
             may_write=(*bad, "store/"), during=(remove("store"), under_way), store="store/mlruns.db"))  # fmt: skip
    add(read_only_store_case())
    add(Case("mlruns.db of a copied workspace larger than the file-size limit",
             ["prlimit", "--fsize=100000", *stage("report")], 74))  # fmt: skip
    add(Case("mlruns.db write past the file-size limit (a disk filling up)", under_size_limit(stage("report"), 4096), 74,
             may_write=bad))  # fmt: skip
    add(Case("checkpoint write past the file size limit (a full disk)",
             ["prlimit", "--fsize=1000000", *stage("pretrain", "-S", "tracking.enabled=false")], 74,
             remove("runs/pretrain"), may_write=bad))  # fmt: skip
    # -- inputs of another run in this one's place
    add(Case("a pretraining checkpoint of another arch at reparam", stage("reparam"), 2,
             respec("runs/pretrain/ckpt/ckpt-epoch-001.pt", arch="resnet18")))  # fmt: skip
    add(Case("a cnn-final.pt of another arch at evaluate", stage("evaluate"), 2,
             respec("runs/pretrain/cnn-final.pt", arch="resnet18")))  # fmt: skip
    # -- stop signals anywhere: runs KILLED, workers ended, 75 / 130
    add(Case("SIGTERM in pretraining", stage("pretrain", "-S", "pretrain.epochs=2"), 75, remove("runs/pretrain"),
             (signal.SIGTERM, "runs/.partial/pretrain"), may_write=bad))  # fmt: skip
    add(Case("SIGINT in pretraining", stage("pretrain", "-S", "pretrain.epochs=2"), 130, remove("runs/pretrain"),
             (signal.SIGINT, "runs/.partial/pretrain"), may_write=bad))  # fmt: skip
    add(Case("SIGHUP in the corrupt pool", stage("corrupt", "-S", "robustness.n_images=2000", "-S", "robustness.dir=data/c2"),
             75, None, (signal.SIGHUP, "data/c2"), may_write=bad))  # fmt: skip
    add(
        Case(
            "SIGTERM in evaluate",
            stage("evaluate"),
            75,
            None,
            (signal.SIGTERM, "runs/mlflow_runs.json"),
            may_write=bad,
        )
    )
    add(
        Case(
            "SIGTERM in the report",
            stage("report"),
            75,
            None,
            (signal.SIGTERM, "runs/mlflow_runs.json"),
            may_write=bad,
        )
    )
    add(Case("SIGUSR1 in fine-tuning", stage("finetune"), 75, remove("runs/finetune"), (signal.SIGUSR1, "runs/.partial/finetune"),
             may_write=bad))  # fmt: skip
    # -- issue 47's kinds: what was chosen is said, what the params let us check is refused before compute
    add(Case("MLFLOW_TRACKING_URI names another store", stage("corrupt", "-S", "robustness.dir=data/c2"), 0,
             env={"MLFLOW_TRACKING_URI": "sqlite:///elsewhere.db"}, expect="is not used: runs go to tracking.uri"))  # fmt: skip
    add(Case("sha256 in upper case", tcnn("validate", "-S", "pretrain.source={weights: w.pt, sha256: " + "AB" * 32 + "}"),
             2, expect="write the sha256 in lower case"))  # fmt: skip
    add(Case("grid control_lr beside select over lr",
             tcnn("validate", "-S", "sweep.grid.finetune.lr=[0.001,0.002]", "-S", "sweep.grid.finetune.control_lr=[0.001]",
                  "-S", "sweep.select.over=[finetune.lr]"), 2, expect="control_lr"))  # fmt: skip
    add(Case("a reparam pattern that matches no conv", stage("reparam", "-S", "reparam.stages=[nomatch.*]"), 2,
             expect="last first:"))  # fmt: skip
    add(
        Case(
            "a checkpoint under an unknown key",
            stage("pretrain"),
            2,
            wrapped_checkpoint,
            expect="top-level keys",
        )
    )
    add(Case("a second dvc repro on a busy workspace", stage("reparam"), 2, busy_after_dvc_removed("runs/reparam"),
             env={"DVC_STAGE": "reparam"}, expect="`dvc checkout reparam` brings them back"))  # fmt: skip
    # -- sweeps
    add(Case("a sweep point the stage refuses fails once",
             tcnn("sweep", "--name", "r", "-S", "sweep.grid.reparam.stages=[[-1], [nomatch.*]]", "-S", "sweep.max_failures=2"),
             1, may_write=("sweeps/",), multi_line=True, expect="refused"))  # fmt: skip
    add(Case("sweep over an unknown key", tcnn("sweep", "-S", "sweep.grid.pretrain.epochz=[1,2]"), 2))
    add(
        Case(
            "search range upside down",
            tcnn("sweep", "-S", "sweep.search={space: {finetune.lr: {loguniform: [0.1, 0.001]}}}"),
            2,
            expect="loguniform needs [lo, hi] with 0 < lo < hi",
        )
    )
    add(
        Case(
            "scheduler without a search",
            tcnn("sweep", "-S", "sweep.scheduler={kind: asha}"),
            2,
            expect="early stopping acts on the trials of a search",
        )
    )
    add(
        Case(
            "a scheduler that could stop no trial",
            tcnn("sweep", "-S", "sweep.search={space: {finetune.lr: {loguniform: [0.001, 0.1]}}, num_samples: 3}",
                 "-S", "finetune.epochs=3", "-S", "sweep.scheduler={kind: asha}"),
            2,
            expect="so the scheduler could stop none",
        )
    )  # fmt: skip
    add(Case("sweep --resume of nothing", tcnn("sweep", "--name", "none", "--resume"), 2))
    issue59_cases(add)
    add(Case("sweep --address bogus", tcnn("sweep", "--address", "not an address"), 2))
    add(Case("sweep name with a slash", tcnn("sweep", "--name", "a/b"), 2))
    return c + issue59_view_cases()


def refused_under_dvc(recorded: bool) -> Callable[[Path], None]:
    """params.yaml with pretrain.epochs -1, and (``recorded``) a dvc.lock whose last pretrain run had 1."""

    def do(ws: Path) -> None:
        text = (ws / "params.yaml").read_text()
        (ws / "params.yaml").write_text(text.replace("pretrain: {epochs: 1,", "pretrain: {epochs: -1,"))
        if recorded:
            lock = "schema: '2.0'\nstages:\n  pretrain:\n    cmd: scripts/stage pretrain\n    params:\n"
            (ws / "dvc.lock").write_text(lock + "      params.yaml:\n        pretrain.epochs: 1\n")

    return do


def issue59_view_cases() -> list[Case]:
    """Issue 59's faults of what a run leaves and what its views say."""
    c: list[Case] = []
    add = c.append
    # a store fault after evaluate wrote results/* (the git-tracked headline too): the last finished run's
    # outputs are back in place (stages.harness.previous); only runs/ (the run ids) may change. The marker: the
    # run ids, written once the stage's runs opened (the store deleted before would simply be made anew)
    add(Case("mlruns.db deleted during evaluate", stage("evaluate"), 74, remove("runs/mlflow_runs.json"),
             may_write=("runs/",), during=(remove("mlruns.db"), "runs/mlflow_runs.json"),
             expect="was deleted during the run"))  # fmt: skip
    # a value refused under DVC: the value to put back when dvc.lock records an earlier one, no such advice else
    add(Case("a refused value under DVC names the one to put back", stage("pretrain"), 2, refused_under_dvc(True),
             env={"DVC_STAGE": "pretrain"}, expect="its last run had pretrain.epochs: 1)"))  # fmt: skip
    add(Case("a refused value with no earlier one", stage("pretrain"), 2, refused_under_dvc(False),
             env={"DVC_STAGE": "pretrain"}, expect="pretrain.epochs: Input should be"))  # fmt: skip
    # DVC's views after a fault (pipelines/views.py): the missing file and the command that brings it back
    add(Case("tcnn show metrics without the headline", tcnn("show", "metrics"), 2, remove("results/headline"),
             expect="`git checkout -- results/headline`"))  # fmt: skip
    page = "[plots]\n    html_template = ../infra/dvc/plots/offline.html\n"
    add(Case("tcnn show plots without its page template", tcnn("show", "plots"), 2, write(".dvc/config", page),
             expect="`.venv/bin/python scripts/dvc_plots_page.py` writes it"))  # fmt: skip
    return c


def _gpus_here() -> int:
    """The GPUs a local Ray finds here (torch's count: Ray's own detection agrees on CUDA machines)."""
    import torch

    return torch.cuda.device_count()


def issue59_cases(add: Callable[[Case], None]) -> None:
    """Issue 59: each kind refused before any compute, one line, exit 2, nothing written."""
    space = "space: {finetune.lr: {loguniform: [1e-4, 1e-2]}}"
    # a bound a library enforces (numpy / Optuna: seeds below 2**32) is enforced at validation, as are counts
    add(Case("search seed beyond numpy's 2**32 - 1", tcnn("sweep", "-S", f"sweep.search={{{space}, seed: 4294967296}}"),
             2, expect="sweep.search.seed: Input should be less than or equal to 4294967295"))  # fmt: skip
    add(Case("search of 10**20 points", tcnn("sweep", "-S", f"sweep.search={{{space}, num_samples: {10**20}}}"), 2,
             expect="sweep.search.num_samples: Input should be less than or equal to 10000"))  # fmt: skip
    add(Case("grid of 20,000 trials", tcnn("validate", "-S", f"sweep.grid.seed={list(range(200))}",
                                           "-S", f"sweep.grid.finetune.lr={[1e-4] * 100}"), 2,
             expect="sweep.grid: 20000 trials"))  # fmt: skip
    # numbers in flow style read as YAML 1.2 (and DVC) read them
    add(Case("search range in flow style with exponents", tcnn("validate", "-S", f"sweep.search={{{space}}}"), 0,
             expect="params.yaml: ok"))  # fmt: skip
    # a trial no node can hold: refused once Ray's resources are known (locally), and in the SLURM request
    gpus = _gpus_here() + 1
    add(Case(f"{gpus} GPU(s) per trial on a machine with {gpus - 1}",
             tcnn("sweep", "--num-cpus", "2", "-S", f"sweep.gpus_per_trial={gpus}"), 2,
             expect=f"sweep.gpus_per_trial: a trial needs {gpus} GPU on one node"))  # fmt: skip
    add(Case("a GPU per trial in a SLURM request of none", tcnn("sweep", "--slurm", "-S", "sweep.gpus_per_trial=1"), 2,
             expect="no node of the SLURM job (1 node(s) x 1 CPUs, 0 GPUs"))  # fmt: skip
    # output paths checked before compute
    add(Case("study run --readme under /proc", tcnn("study", "run", "params.yaml", "--name", "x", "--out", "o",
                                                    "--readme", "/proc/nope/R.md"), 2,
             expect="--readme /proc/nope/R.md: cannot create files in /proc"))  # fmt: skip
    add(Case("study export into /proc", tcnn("study", "export", "sweeps/none", "/proc/nope"), 2,
             expect="OUT_DIR /proc/nope: cannot create files in /proc"))  # fmt: skip
    add(Case("sweep.storage under /proc", tcnn("sweep", "-S", "sweep.storage=/proc/nope"), 2,
             expect="sweep.storage /proc/nope: cannot create files in /proc"))  # fmt: skip
    # a published set checked from its .npy headers and labels before any training, and before prepare
    public = "robustness.public={kind: cifar10_c, dir: pub, use: add}"
    add(Case("published sets with float labels: the check stage refuses before pretrain",
             stage("check", "-S", public, "-S", "data.name=cifar10"), 2, cifar_c_of((300, 28, 28, 1), "float64"),
             expect="check: error: robustness.public: pub/labels.npy: labels must be integers"))  # fmt: skip
    add(Case("published sets of 32 px on the prepared 28 px: the check stage refuses before pretrain",
             stage("check", "-S", public, "-S", "data.name=cifar10"), 2, cifar_c_of((300, 32, 32, 3)),
             expect="the clean test images are uint8 [N, 28, 28, 1]"))  # fmt: skip
    add(Case("published sets with float labels: a sweep refuses before Ray",
             tcnn("sweep", "-S", public, "-S", "data.name=cifar10"), 2, cifar_c_of((300, 28, 28, 1), "float64"),
             expect="tcnn sweep: error: robustness.public: pub/labels.npy: labels must be integers"))  # fmt: skip
    add(Case("validate: a CIFAR-10-C copy of 28 px before prepare",
             tcnn("validate", "-S", public, "-S", "data.name=cifar10", "-S", "data.dir=data/none"), 2,
             cifar_c_of((300, 28, 28, 3)), expect="the clean test images are uint8 [N, 32, 32, 3]"))  # fmt: skip
    # model.code as the docs say: relative to the workspace, inside it, existing (where dvc.yaml is)
    add(Case("model.code absolute", tcnn("validate", "-S", "model.code=/etc/hostname"), 2,
             expect="model.code: /etc/hostname is not inside the workspace"))  # fmt: skip
    add(Case("model.code above the workspace", tcnn("validate", "-S", "model.code=../shared"), 2,
             expect="model.code: ../shared is not inside the workspace"))  # fmt: skip
    add(Case("model.code missing in a DVC workspace", tcnn("validate", "-S", "model.code=nets/nope.py"), 2,
             write("dvc.yaml", "stages: {}\n"), expect="model.code: nets/nope.py does not exist in the workspace"))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="keep the workspaces here")
    ap.add_argument("-k", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    scratch = Path(args.keep or tempfile.mkdtemp(prefix="tcnn-tour-"))
    scratch.mkdir(parents=True, exist_ok=True)
    base = scratch / "_base"
    if not (base / "results" / "report.html").exists():
        base.mkdir(exist_ok=True)
        t0 = time.monotonic()
        build_chain(base)
        print(f"fault_tour: tiny chain built in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    todo = [c for c in cases() if args.k in c.name]
    try:
        for case in todo:
            run_case(case, base, scratch)
            r = case.result
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {case.name}: exit {r['status']} ({r['seconds']} s) {r['line']}",
                  file=sys.stderr, flush=True)  # fmt: skip
            if not r["ok"]:
                print(f"     {r}", file=sys.stderr, flush=True)
    finally:
        for p in HOLDERS:
            p.kill()
    lines = [f"Fault tour on {socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M')}: "
             f"{sum(c.result['ok'] for c in todo)}/{len(todo)} behaved.", "",
             "| # | fault | expected | exit | what it printed (last line) | written | RUNNING runs | processes left |",
             "|---:|---|---:|---:|---|---|---|---|"]  # fmt: skip
    for i, c in enumerate(todo, 1):
        r = c.result
        written = ", ".join(r["written"][:3]) + (" ..." if len(r["written"]) > 3 else "") or "nothing"
        lines.append(f"| {i} | {c.name} | {c.status} | {r['status']}{'' if r['ok'] else ' **FAIL**'} | "
                     f"`{r['line'].replace('|', '/')}` | {written} | {len(r['running'])} | {len(r['left'])} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return sum(not c.result["ok"] for c in todo)


if __name__ == "__main__":
    sys.exit(main())
