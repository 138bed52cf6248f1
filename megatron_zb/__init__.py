"""megatron-zb: zero-bubble pipeline parallelism for megatron-core.

``install()`` routes megatron-core's ``get_forward_backward_func()`` through megatron-zb and
``add_args(parser)`` adds the zero-bubble flags (Megatron-LM's ``extra_args_provider``).
Neither imports torch until it is called.
"""

from .megatron.args import add_args
from .megatron.install import configure, install, uninstall

__version__ = "0.1.0"
__all__ = ["add_args", "configure", "install", "uninstall"]
