"""megatron-zb: zero-bubble pipeline parallelism for megatron-core.

``install()`` routes megatron-core's ``get_forward_backward_func()`` through megatron-zb and
``add_args(parser)`` adds the zero-bubble flags (Megatron-LM's ``extra_args_provider``;
``extra_args_provider(other)`` chains them after a script's own). ``check_flags_before_init()``
refuses bad flags in Megatron-LM's ``validate_args``. None imports torch until it is called.
"""

from .megatron.args import add_args, extra_args_provider
from .megatron.install import configure, install, uninstall
from .megatron_lm.validation import check_flags_before_init

__version__ = "0.1.0"
__all__ = ["add_args", "check_flags_before_init", "configure", "extra_args_provider", "install", "uninstall"]
