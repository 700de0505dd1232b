"""Public import path of the conv -> attention conversion (DESIGN section 4: ``core.reparam.to_tcnn``); the
code lives in `core.models.conversion`."""

from core.models.conversion import attention_modules, gpsa_modules, model_stages, to_attention, to_tcnn

__all__ = ["attention_modules", "gpsa_modules", "model_stages", "to_attention", "to_tcnn"]
