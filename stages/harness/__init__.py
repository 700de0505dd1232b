"""The stage harness: what every stage and the sweep use around a stage's own work, none of it a stage.

- `runner`: a stage's command line, its checks before any run opens, its one-line endings and exit statuses;
- `stage_run`, `catalogue`: the MLflow runs of a stage over the tracking adapter (stages/tracking/, a package
  of its own): the DVC path's parent and child runs, and what each stage reports (artifacts, models, metrics);
- `chain`: the stage graph and each stage's outputs, read from dvc.yaml;
- `identity`: what a stage's result depends on (its key, shared by DVC and the sweep);
- `training`: data loaders, checkpoint I/O, publishing outputs, data-parallel launch;
- `pretraining`, `fine_tuning`: the training runs the pretrain stage composes, and the finetune and control
  stages share; `t1_checkpoint`: the pretrained network at t1 that reparam and the control start from;
- `parent_watch`: a stage started by DVC ends when DVC does.
"""
