"""Robustness: the common-corruption suite (`suite`: names; `corruptions`: the seeded corruptions and their
stored sets; `corruption_build`: the corrupt stage's sets of one test split), CE / mCE metrics and
paired-bootstrap intervals (`metrics`, `intervals`), the public ImageNet-C/A/R readers (`public_sets`) and what
every model is evaluated on (`bench`).

Layer: imports ``core.utils`` only (evaluation takes any ``nn.Module``). Import from the submodules: this
package's import stays light (the config validates corruption names through `suite`)."""
