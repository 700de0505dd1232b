"""The stage harness: what every stage and the sweep use around a stage's own work, none of it a stage.

- `runner`: a stage's command line, its checks before any run opens, its one-line endings and exit statuses;
- `stage_run`, `tracking`, `tracking_names`, `catalogue`, `store_location`: the MLflow runs of a stage
  (parent and child, params, metrics, artifacts, the model catalogue, a copied store's locations);
- `chain`: the stage graph and each stage's outputs, read from dvc.yaml;
- `identity`: what a stage's result depends on (its key, shared by DVC and the sweep);
- `training`: data loaders, checkpoint I/O, publishing outputs, data-parallel launch;
- `pretraining`, `fine_tuning`: the training runs the pretrain stage composes, and the finetune and control
  stages share; `t1_checkpoint`: the pretrained network at t1 that reparam and the control start from;
- `parent_watch`: a stage started by DVC ends when DVC does.
"""
