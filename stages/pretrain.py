"""Stage `pretrain`: train the CNN (SGD + momentum, warmup then per-step cosine over `pretrain.epochs`).

Outputs (under `root/runs/pretrain/`, published only when the run completes):
  ckpt/ckpt-epoch-XXX.pt  full training state after XXX epochs, for every t1 the config or a sweep asks for
                      (reparam.epoch, pretrain.checkpoint_epochs, sweep.grid["reparam.epoch"], and the last)
  cnn-final.pt        the trained CNN (model checkpoint: model + model_spec + normalization)
  history.csv/.json   per epoch: lr, train/val loss and accuracy, images/s
  metrics.json        final train/val/test loss and accuracy, timings

With `pretrain.source` the stage imports the CNN instead (`stages.imported_cnn`, `core.models.importing`): the
same outputs, its one checkpoint at t1 = 0, an empty history, and metrics naming the source, its sha256 and
the normalization every stage then feeds it with.

While running, state lives in `root/runs/.partial/pretrain/` (outside DVC's outs, which DVC deletes before a
stage runs); a rerun with the same params and data resumes from it exactly (see core.training.loop.fit). The
run's pieces (the epochs it keeps, network, identity, optimizer, metrics): `stages.harness.pretraining`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from core.config import Params
from core.training.environment import deterministic, seed_everything
from core.training.loop import fit
from core.training.model_eval import TrainLoss
from core.utils.hashing import stable_hash
from stages.harness import chain, pretraining
from stages.harness import training as T
from stages.harness.pretraining import NAME, check_network, checkpoint_epochs, model_spec, network_code
from stages.harness.runner import stage_main
from stages.imported_cnn import check_source, import_cnn, import_identity

__all__ = ["NAME", "check", "identity", "main", "run", "run_hash"]


def identity(
    params: Params, spec: dict[str, Any], data_fingerprint: str, device: str, workers: int | None = None
) -> dict[str, Any]:
    """What pretraining's result depends on (`stages.harness.identity`; the sweep names shared pretraining runs
    by it): a training run's (`stages.harness.pretraining.training_identity`) or an import's
    (`stages.imported_cnn.import_identity`), and the network code dvc.yaml does not list
    (`stages.harness.pretraining.network_code`: another kind's, a user's builder), so that an edit of it is another
    pretraining."""
    if params.imports_cnn:
        found = import_identity(params, spec, data_fingerprint, device)
    else:
        found = pretraining.training_identity(params, spec, data_fingerprint, device, workers)
    code = network_code(params)  # what dvc.yaml does not list: a sweep runs without DVC
    return {**found, "network_code": code} if code else found


def run_hash(params: Params, spec: dict[str, Any], data_fingerprint: str, device: str) -> str:
    """The resume identity of a run: :func:`identity` and the epochs it keeps."""
    return stable_hash(
        {**identity(params, spec, data_fingerprint, device), "keep": checkpoint_epochs(params)}
    )


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Pretrain the CNN that reparam converts into a T-CNN at epoch t1 ([TCNN21]), resuming an interrupted run
    of the same identity, and publish its checkpoints, history and metrics; an imported CNN: `import_cnn`."""
    if params.imports_cnn:
        return import_cnn(params, root=root)
    t_wall = time.perf_counter()
    root = Path(root)
    out_dir, work_dir = root / chain.run_dir(NAME), root / chain.partial_dir(NAME)
    p = params.pretrain
    device = T.training_device()
    ds = T.datasets(params, root)
    keep = checkpoint_epochs(params)

    seed_everything(params.cnn_seed)
    spec = model_spec(params, ds.num_classes, ds.in_chans)
    model = pretraining.build_model(params, spec)
    image_size = params.data.image_size
    augment = params.augment_for(NAME)
    loaders, spe = pretraining.loaders(params, ds, augment)
    optimizer, scheduler = pretraining.optimization(params, model, spe)
    channels_last = T.use_channels_last(device)
    extra = {**T.extra_state(spec, ds, image_size), "network_code": network_code(params)}

    with deterministic(device):
        result = fit(
            model,
            optimizer,
            scheduler,
            loaders.train,
            epochs=range(0, p.epochs),
            work_dir=work_dir,
            run_hash=run_hash(params, spec, ds.fingerprint, device.type),
            loss_fn=TrainLoss(augment.label_smoothing),
            val_loader=loaders.val,
            device=device,
            channels_last=channels_last,
            precision=params.precision,
            checkpoint_every_steps=T.checkpoint_every_steps(params, NAME),
            epoch_checkpoints=keep,
            extra_state=extra,
            desc=NAME,
        )
        test = T.evaluate_split(model, loaders.test, device, channels_last, params)

    metrics = pretraining.metrics(params, ds, model, result, test, keep, device, t_wall)
    pretraining.publish(work_dir, out_dir, model, extra, result, metrics)
    return metrics


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the prepared dataset exists, the checkpoint cadence is readable; the network this
    config pretrains takes the data's images, or an import's weights file has the sha256 params give."""
    T.require_dataset(params, root)
    T.checkpoint_every_steps(params, NAME)
    source = params.pretrain.source
    if source is None:
        check_network(params, root)
    else:
        check_source(source)


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, data_parallel=T.data_parallel, check=check)


if __name__ == "__main__":
    sys.exit(main())
