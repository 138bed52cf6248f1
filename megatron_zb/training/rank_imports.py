"""What a ``--cpu`` rank imports, loaded once by the fork server that starts the ranks.

Spawned ranks each imported torch and megatron-core themselves: 6-9 CPU seconds per rank, more
than a short CPU run trains, and on a 2-core machine the ranks' imports queue behind each other.
``training.spawn.start_ranks`` starts them with the ``forkserver`` method instead: a fresh process
imports this module (no threads, no process group, nothing patched), and every rank is a fork of
it. Importing is all this module does: megatron-core's model, DDP, optimizer, checkpointing and
schedules, and megatron-zb's training loop, as a rank builds and runs them.
"""

import warnings

warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # "Apex is not installed", ...

import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt.gpt_layer_specs  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
import torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

from megatron_zb import cpu, process_groups  # noqa: E402,F401
from megatron_zb.megatron import gpt_model, install  # noqa: E402,F401
from megatron_zb.schedule import generators  # noqa: E402,F401
from megatron_zb.training import build, checkpoint, idle, loop, measured, supervise, watchdog  # noqa: E402,F401
