"""Registration behind megatron-core's ``get_forward_backward_func()``.

Megatron-LM binds the function at import time (``from megatron.core.pipeline_parallel import
get_forward_backward_func`` in ``megatron.training.training``), so patching ``schedules``
alone does nothing once training is imported. ``install()`` replaces the attribute in every
loaded module that holds megatron-core's function, and in the package, so modules imported
later bind ours: import order does not matter. Ours returns megatron-core's own function
unless zero bubble is enabled, either by ``configure(settings)`` or by Megatron-LM's parsed
arguments carrying our flags (``add_args`` as ``extra_args_provider``). ``install()`` also hooks
megatron-core and Megatron-LM where a placement megatron does not build itself (the V) needs it
(``placement_hooks``). Every replacement is recorded in ``patching`` under its ``megatron`` scope, with
the runtime's B/W split of megatron-core's linears; ``uninstall()`` undoes that scope.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import patching
from ..compat import is_multi_module_pg_collection, require_supported_megatron_core, signature_of
from . import parsed_args, placement_hooks
from .args import ZeroBubbleSettings
from .parsed_args import megatron_lm_settings
from .training_hooks import hook_training_loop

_original: Callable | None = None
_configured: list = []  # [settings or None] once configure() was called
_runners: dict = {}


def install() -> None:
    """Route every bound copy of ``get_forward_backward_func`` through megatron-zb (idempotent).

    Also hooks Megatron-LM's training loop when it is loaded (``training_hooks``): with
    ``--enable-optimizer-post-validation`` its optimizer is post-validated. With a V placement
    (``placement_hooks``) Megatron-LM builds and feeds the chunks of the V.
    """
    global _original
    require_supported_megatron_core()
    from megatron.core.pipeline_parallel import schedules

    if _original is None:
        _original = schedules.get_forward_backward_func
    patching.replace_everywhere(_original, get_forward_backward_func, "get_forward_backward_func", patching.MEGATRON)
    hook_training_loop(active_settings)  # optimizer post-validation in Megatron-LM's train_step
    placement_hooks.install()
    from . import norms  # imports torch: only once installing

    norms.install()  # zero-centred gamma and sequence parallelism for megatron-core's torch norms


def uninstall() -> None:
    """Undo the ``megatron`` scope: megatron-core's function back everywhere ours was bound, every other hook.

    Modules imported since that bound ours get megatron-core's too. The runners go: each holds its
    latest model, optimizer backend and process groups.
    """
    patching.undo(patching.MEGATRON)
    parsed_args.forget()
    _runners.clear()


def installed() -> bool:
    from megatron.core.pipeline_parallel import get_forward_backward_func as bound

    return bound is get_forward_backward_func


def configure(settings: ZeroBubbleSettings | None) -> None:
    """Enable zero bubble with ``settings`` (None: megatron-core's schedules), overriding parsed arguments."""
    _configured[:] = [settings]


def megatron_core_forward_backward_func() -> Callable:
    """megatron-core's own ``get_forward_backward_func`` (whether or not we are installed)."""
    if _original is not None:
        return _original
    from megatron.core.pipeline_parallel import schedules

    return schedules.get_forward_backward_func


def get_forward_backward_func(*args, **kwargs):
    """megatron-zb's runner when zero bubble is enabled, else megatron-core's choice.

    Extra arguments of newer megatron-core versions (0.19's ``schedule_pg_collection=``, ...) are
    passed through to megatron-core's function. Ours takes its groups from the ``pg_collection``
    given to the runner; a multi-module collection (0.19's bridge schedule) is refused.
    """
    settings = active_settings()
    if settings is None:
        return megatron_core_forward_backward_func()(*args, **kwargs)
    collection = signature_of(megatron_core_forward_backward_func()).bind(*args, **kwargs).arguments
    if is_multi_module_pg_collection(collection.get("schedule_pg_collection")):
        raise NotImplementedError(
            "megatron-zb schedules run one model per pipeline (one process-group grid); a multi-module "
            "schedule_pg_collection needs megatron-core's bridge schedule: turn zero bubble off for this model"
        )
    return runner_for(settings)


def active_settings() -> ZeroBubbleSettings | None:
    if _configured:
        return _configured[0]
    return megatron_lm_settings()


def runner_for(settings: ZeroBubbleSettings):
    """One ForwardBackward per settings, so its planned schedules (and its re-plan) outlive an iteration.

    Only the latest settings' runner is kept: a runner holds its latest model and process groups,
    which a run with other settings (a new model, new groups) must not keep alive.
    """
    if settings not in _runners:
        _runners.clear()
        from ..runtime import ForwardBackward
        from ..runtime.replan import ReplanWindow

        window = None
        if settings.timers is not None:
            window = ReplanWindow(*settings.timers, costs_file=settings.costs_file)
        _runners[settings] = ForwardBackward(
            settings.schedule,
            memory_limit=settings.memory_limit,
            chunks=settings.chunks,
            timeout_s=settings.p2p_timeout_s,
            losses_to_last_rank=True,
            replan=window,
            post_validation=settings.post_validation,
            breadth_first_microbatches=settings.breadth_first_microbatches,
            layers=settings.layers,
            overlap_f_b=settings.overlap_f_b,
        )
    return _runners[settings]
