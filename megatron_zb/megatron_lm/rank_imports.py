"""What a Megatron-LM ``--cpu`` rank imports, loaded once by the fork server that starts the ranks.

As ``training/rank_imports.py`` for megatron-zb's own loop: Megatron-LM's training loop and
megatron-core (about 8 CPU seconds a process on megatron-core 0.19.2), imported once, every
rank a fork of the server (``launch.spawn_cpu``). The fork server imports them from the
launcher's ``sys.path``; a rank checks it got the launcher's copies (``launch._same_megatron``).
"""

import warnings

warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # "Apex is not installed", ...

import megatron.core.models.gpt.gpt_layer_specs  # noqa: E402,F401
import megatron.training.training  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

from megatron_zb.megatron_lm import cpu, launch  # noqa: E402,F401
from megatron_zb.training import supervise, watchdog  # noqa: E402,F401
