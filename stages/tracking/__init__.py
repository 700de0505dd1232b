"""The MLflow tracking adapter, a room of its own: the stages (stages/harness/) and the sweep (pipelines/sweep/)
both log through it, and it imports neither (.importlinter: tracking-stands-alone).

- `tracker`: :class:`~stages.tracking.tracker.Tracker`, the one adapter (no-ops without MLflow), assembled from
  `state` (what it holds), `runs` (parent and child runs), `stale` (runs a killed process left),
  `logs` (params, metrics, tags, artifacts, datasets, environment, models) and `system_metrics`;
- `store`: opening a store (sqlite under a lock, a server probed over HTTP) and tcnn's experiment in it;
  `store_faults`: a failing sqlite store as one line; `store_location`: a copied store's artifact locations;
- `names`: what runs are called and keyed by (tags, flattened params, labels), no MLflow;
- `view`: the experiment's saved runs-table view.

The DVC path's per-stage protocol over it is stages/harness/stage_run.py; what each stage reports (artifacts,
summary metrics, read from dvc.yaml's outputs) is stages/harness/catalogue.py.
"""
