"""Optimizer post-validation for megatron-core's optimizers (torch is imported by the modules, not here)."""

from .post_validation import CONFIG_ATTRIBUTE, MODES, PostValidation, StepReport

__all__ = ["CONFIG_ATTRIBUTE", "MODES", "PostValidation", "StepReport"]
