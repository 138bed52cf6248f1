"""Optimizer settings post-validation refuses, each with what to do instead."""

from __future__ import annotations

from ..checks import first_set


def check_supported(optimizer, mode: str) -> None:
    """ValueError naming the setting when ``optimizer`` cannot be post-validated."""
    subs = getattr(optimizer, "chained_optimizers", None)
    if subs is None:
        raise ValueError(
            f"post-validation wraps megatron-core's ChainedOptimizer (what get_megatron_optimizer returns), "
            f"got {type(optimizer).__name__}"
        )
    if not subs:
        raise ValueError("post-validation needs an optimizer with parameters on this rank")
    config = optimizer.config
    refused = {
        "log_num_zeros_in_grad": "--log-num-zeros-in-grad counts zeros with a global all-reduce every step",
        "overlap_param_gather_with_optimizer_step": "--overlap-param-gather-with-optimizer-step",
        "use_precision_aware_optimizer": "--use-precision-aware-optimizer",
        "optimizer_cpu_offload": "--optimizer-cpu-offload",
    }
    field = first_set(config, refused)
    if field is not None:
        raise ValueError(f"--enable-optimizer-post-validation does not support {refused[field]}; drop one of them")
    if getattr(config, "optimizer", "adam") not in ("adam", "sgd"):
        raise ValueError(
            f"--enable-optimizer-post-validation supports Adam and SGD, not --optimizer {config.optimizer}"
        )
    groups = {id(sub.get_grad_stats_parallel_group()) for sub in subs}
    if len(groups) > 1:
        raise ValueError(
            "--enable-optimizer-post-validation needs one grad-statistics group for all sub-optimizers; MoE expert "
            "optimizers reduce theirs over other ranks (drop --num-experts or post-validation)"
        )
    for sub in subs:
        ddp = getattr(sub, "ddp_config", None)
        if ddp is not None and ddp.overlap_param_gather:
            raise ValueError(
                "--enable-optimizer-post-validation does not support --overlap-param-gather: the all-gather of "
                "updated parameters would run inside forwards that a rolled-back step has to redo; drop it"
            )
        if ddp is not None and getattr(ddp, "use_megatron_fsdp", False):
            raise ValueError("--enable-optimizer-post-validation does not support Megatron FSDP")
        if mode == "in-place" and not getattr(sub, "is_stub_optimizer", False):
            from .rollback import check_invertible

            check_invertible(sub)
