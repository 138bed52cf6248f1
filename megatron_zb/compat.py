"""What differs between the megatron-core versions megatron-zb runs on, in one place.

Supported: megatron-core ``>=0.16.1,<0.20`` (``SUPPORTED_RANGE``; setup.py's extras say the same),
and Megatron-LM checkouts from core_v0.16.1 to main, whose ``package_info`` already says 0.20.0.
The runtime refuses anything else when it is imported (``require_supported_megatron_core``).

Everything else here is a feature check on the megatron-core that is loaded (an attribute, a
signature), never a version comparison, so a backport or a checkout between releases gets the
code path that matches what it has. What changed, and who copes with it:

- 0.17: the linear function lost ``async_grad_allreduce`` (``runtime/linear_split.py`` binds
  arguments by the original's signature); ``ModelType.encoder_and_decoder`` is gone
  (``encoder_and_decoder_model_type``).
- 0.19: the linear function gained ``gtp_remat_size`` (GTP-sharded weights, refused inside our
  passes); ``get_main_grads_for_grad_norm`` became ``get_grads_for_grad_norm(grad_norm_group=None)``
  with MTP parameters in their own norm group (``grads_for_grad_norm``, ``separate_grad_norm_params``);
  the first clipped step runs one cached MAX all-reduce over the grad-stats group
  (``optimizer_checks_grad_norm_groups``); ``get_forward_backward_func(schedule_pg_collection=)``
  (``accepts``); MoE, MTP and attention-variant losses are scaled through
  config hooks (``runtime/steps.py``, ``attention_variant_loss_scale_func``); DDP's
  ``start_grad_sync`` calls ``torch.cuda.current_stream()`` (shimmed in ``megatron_zb.cpu``); the MoE loss
  tracker became a ``MoEMetricsTracker`` object (``clear_moe_metrics``, from 0.17).

Nothing here imports torch or megatron-core at import time.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

SUPPORTED_RANGE = ">=0.16.1,<0.20"
MINIMUM = (0, 16, 1)
BELOW = (0, 20)  # releases below this; tested up to 0.19.2
CHECKOUT_BELOW = (0, 21)  # Megatron-LM checkouts: main is the 0.20 development line
ALLOW_ENV = "MZB_ALLOW_UNSUPPORTED_MEGATRON_CORE"


class UnsupportedMegatronCoreError(ImportError):
    """The megatron-core found is outside the range megatron-zb's runtime supports."""


# -- the version check --------------------------------------------------------------------------


def megatron_core_package_info() -> Path | None:
    """``megatron/core/package_info.py`` of the megatron-core that ``import megatron.core`` loads.

    Found without importing megatron-core (seconds of imports, and the refusal should come first).
    """
    core = sys.modules.get("megatron.core")
    if core is not None and getattr(core, "__file__", None):
        return Path(core.__file__).parent / "package_info.py"
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for entry in (spec.submodule_search_locations or []) if spec is not None else []:
        if Path(entry, "core", "__init__.py").is_file():
            return Path(entry, "core", "package_info.py")
    return None


def read_version(package_info: Path) -> str | None:
    """The version a ``package_info.py`` declares, read without running it (main's runs git)."""
    try:
        tree = ast.parse(package_info.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    fields = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
                    fields[target.id] = node.value.value
    if not {"MAJOR", "MINOR", "PATCH"} <= fields.keys():
        return None
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE') or ''}"


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: "0.20.0rc0" -> (0, 20, 0)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


def _is_pip_installed(package_info: Path) -> bool:
    """Whether ``package_info`` belongs to an installed megatron-core distribution (not a checkout)."""
    from importlib import metadata

    try:
        installed = metadata.distribution("megatron-core").locate_file("megatron/core/package_info.py")
    except metadata.PackageNotFoundError:
        return False
    try:
        return Path(installed).resolve() == package_info.resolve()
    except OSError:
        return False


def check_version(version: str | None, checkout: bool = False) -> None:
    """Refuse a megatron-core ``version`` outside the supported range (``checkout``: from Megatron-LM's tree)."""
    if version is None:
        raise UnsupportedMegatronCoreError(
            f"megatron-zb's runtime needs megatron-core {SUPPORTED_RANGE}, and none was found: "
            f"pip install 'megatron-core{SUPPORTED_RANGE}' (or 'megatron-zb[runtime]'), or put a Megatron-LM "
            "checkout on PYTHONPATH"
        )
    numbers = version_tuple(version)
    below = CHECKOUT_BELOW if checkout else BELOW
    if MINIMUM <= numbers < below:
        return
    where = "a Megatron-LM checkout of megatron-core" if checkout else "megatron-core"
    message = (
        f"megatron-zb supports megatron-core {SUPPORTED_RANGE} (and Megatron-LM checkouts from core_v0.16.1 to "
        f"main); found {where} {version}. Install a supported one, e.g. pip install 'megatron-core{SUPPORTED_RANGE}' "
        f"(0.17 and later need Python 3.12), or set {ALLOW_ENV}=1 to try this one anyway"
    )
    if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        warnings.warn(message, stacklevel=3)
        return
    raise UnsupportedMegatronCoreError(message)


def require_supported_megatron_core() -> None:
    """Refuse to run on a megatron-core outside the supported range (the runtime calls this at import)."""
    package_info = megatron_core_package_info()
    if package_info is None:
        check_version(None)
        return
    check_version(read_version(package_info), checkout=not _is_pip_installed(package_info))


# -- feature checks -----------------------------------------------------------------------------


def encoder_and_decoder_model_type():
    """``ModelType.encoder_and_decoder`` where it is a real member (0.16 has a property there), else None."""
    from megatron.core.enums import ModelType

    member = ModelType.__dict__.get("encoder_and_decoder")
    return member if isinstance(member, ModelType) else None


def signature_of(func: Callable) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(func))


def argument_binder(func: Callable) -> Callable[[tuple, dict], dict]:
    """``(args, kwargs) -> {name: value}`` for calls of ``func``, defaults filled in, as ``Signature.bind`` gives.

    Called on every linear of a pass: a plain call is matched by position and name directly (about a tenth
    of ``bind``'s time); anything unusual (too many or unknown arguments, one given twice, one missing)
    goes to ``bind``, which raises what Python would.
    """
    signature = signature_of(func)
    plain = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature.parameters.values())
    names = tuple(signature.parameters)
    known = frozenset(names)
    defaults = {n: p.default for n, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}

    def slow(args: tuple, kwargs: dict) -> dict:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def bind(args: tuple, kwargs: dict) -> dict:
        if len(args) > len(names) or not known.issuperset(kwargs) or any(n in kwargs for n in names[: len(args)]):
            return slow(args, kwargs)
        call = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
        return call if len(call) == len(names) else slow(args, kwargs)

    return bind if plain else slow


def accepts(func: Callable, name: str) -> bool:
    """Whether ``func`` has an argument ``name`` (0.19's ``get_forward_backward_func(schedule_pg_collection=)``)."""
    return name in signature_of(func).parameters


def grads_for_grad_norm(optimizer) -> list:
    """The gradients megatron-core's main grad norm covers (0.19 renamed the method and leaves MTP out)."""
    if hasattr(optimizer, "get_grads_for_grad_norm"):
        return optimizer.get_grads_for_grad_norm()
    return optimizer.get_main_grads_for_grad_norm()


def separate_grad_norm_params(optimizer) -> int:
    """How many of ``optimizer``'s parameters 0.19 clips with a norm of their own (MTP); 0 before 0.19."""
    try:
        from megatron.core.optimizer.optimizer import GRAD_NORM_GROUP_ATTR
    except ImportError:
        return 0
    return sum(1 for param in optimizer.get_parameters() if getattr(param, GRAD_NORM_GROUP_ATTR, None) is not None)


def optimizer_checks_grad_norm_groups() -> bool:
    """Whether the optimizer's first clipped step all-reduces (MAX) whether any rank has a separate norm group."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    return hasattr(MegatronOptimizer, "has_grad_norm_group")


def attention_variant_loss_scale_func(config) -> Callable | None:
    """The hook that takes the loss scale of an attention variant's auxiliary loss (0.19), as megatron-core finds it."""
    hook = getattr(config, "experimental_attention_variant_loss_scale_func", None)
    if hook is not None:
        return hook
    if not hasattr(config, "experimental_attention_variant_loss_scale_func"):
        return None  # before 0.19 megatron-core's schedules scale no attention-variant loss either
    if getattr(config, "experimental_attention_variant", None) == "dsa":
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        return DSAIndexerLossAutoScaler.set_loss_scale
    return None


def is_multi_module_pg_collection(collection) -> bool:
    """Whether ``collection`` is 0.19's cross-grid ``MultiModuleProcessGroupCollection`` (a bridge schedule)."""
    if collection is None:
        return False
    try:
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
    except ImportError:
        return False
    return isinstance(collection, MultiModuleProcessGroupCollection)


def clear_moe_metrics(fresh: bool = False) -> None:
    """megatron-core's MoE layers add each forward's aux and z losses into a process-wide tracker, which Megatron-LM's
    ``track_moe_metrics`` empties after each step: here too. ``fresh`` drops it (its per-layer tensors are sized by
    the first model that wrote them: a process that trains again, e.g. a pooled test worker, may build another).
    """
    from megatron.core.transformer.moe import moe_utils

    metrics_tracker = getattr(moe_utils, "get_moe_metrics_tracker", None)  # 0.17 on: a MoEMetricsTracker object
    if metrics_tracker is not None:
        tracker = metrics_tracker()
        tracker.metrics.clear() if fresh else tracker.clear()
    else:  # 0.16: a dict of {"values": tensor, ...} per loss
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if fresh:
            tracker.clear()
        else:
            moe_utils.clear_aux_losses_tracker()
