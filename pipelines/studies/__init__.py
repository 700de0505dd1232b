"""The studies run on the sweep (pipelines/sweep/), each a design and, once finished, its committed results:

- ``<name>.yaml``: a study's design, the params ``tcnn sweep --params pipelines/studies/<name>.yaml`` runs
  (docs/studies.md has each study's commands);
- ``<name>/``: a finished study's small tables and figures (``tcnn study export`` / ``render``);
- ``cli``: the `tcnn study` command; ``render``: the README section and figures from the tables; ``results``:
  the tables, exported from a finished sweep and read back; ``sizing``: how many seeds a difference needs
  (``python -m pipelines.studies.sizing STUDY_DIR``).
"""
