"""The torch runtime: executes any schedule of the schedule core on megatron-core model chunks."""

from .forward_backward import ForwardBackward
from .p2p import DEFAULT_TIMEOUT_S, P2PError, P2PTimeoutError
from .wgrad import WeightGradStore

__all__ = ["DEFAULT_TIMEOUT_S", "ForwardBackward", "P2PError", "P2PTimeoutError", "WeightGradStore"]
