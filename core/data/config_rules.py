"""The data science's answers to the config (`core.config.rules`): the dataset names and records of the
catalog (`core.data.catalog.DATASETS`)."""

from __future__ import annotations

from core.config import rules
from core.data.catalog import DATASETS

rules.register_names(rules.DATASETS, lambda: DATASETS)
rules.register_rule(rules.DATASET, DATASETS.__getitem__)
