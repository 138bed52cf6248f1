"""megatron-core's ``forward_backward_func`` for any registered schedule, or a schedule file.

``ForwardBackward("zb-h1")`` is a drop-in for the function ``get_forward_backward_func()``
returns: same keyword arguments, a list of model chunks and data iterators for several
chunks per rank, the list of loss dicts on the rank that computes the loss (``[]``
elsewhere). Every rank builds the same schedule from (name, pp, microbatches, chunks), so
nothing is exchanged before the first pass. ``ForwardBackward("file:PATH")`` runs the orders
in a schedule file instead (``schedule_file.build_schedule``), which every rank reads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compat import encoder_and_decoder_model_type, require_supported_megatron_core
from ..schedule import CostModel, Schedule, ScheduleError, ScheduleSpec
from ..schedule.ir import parse_orders
from ..schedule.lower import DataParallel, lower
from ..schedule.schedule_file import build_schedule
from ..schedule.speculation import Speculation, speculation
from . import linear_split, steps
from .dp import DataParallelBackend, backend_for
from .dp.replicas import replica_groups
from .executor import Executor, PrefixCheck, plan_rank
from .p2p import DEFAULT_TIMEOUT_S, PipeComm
from .profiler import NestedProfilers
from .replan import Replanner, ReplanReport, ReplanWindow
from .replay import Replay
from .te_wgrad import delayed_wgrad_layers
from .wgrad import WeightGradStore

require_supported_megatron_core()  # before anything here touches megatron-core: a clear refusal, not an AttributeError

# A post-validated optimizer (megatron_zb.optimizer.PostValidation) sets itself on the model config
# under this name; the runtime then checks its pending step where ``schedule.speculation`` says.
CONFIG_ATTRIBUTE = "megatron_zb_post_validation"


@dataclass(frozen=True)
class Groups:
    pp: dist.ProcessGroup
    tp: dist.ProcessGroup
    cp_size: int


class ForwardBackward:
    """Runs ``schedule`` (a registered name, or ``file:PATH``) with megatron-core's forward_backward contract.

    ``memory_limit``, ``costs``, ``chunks``, ``post_validation`` and ``breadth_first_microbatches`` are passed
    to the generator; ``timeout_s``
    bounds every P2P wait; ``profiler`` (a ``PassProfiler``) times the passes when active.
    ``losses_to_last_rank`` ships the loss dicts to the last pipeline rank when another rank
    computes the loss (V placements), because Megatron-LM reads and logs them only there.
    ``replan`` (a ``ReplanWindow``) times that window's training calls and then re-plans once
    with the measured costs (``replan_report`` says what it predicted).
    """

    def __init__(
        self,
        schedule: str = "zb-h1",
        *,
        memory_limit: float | None = None,
        costs: CostModel | None = None,
        chunks: int | None = None,
        refine_seconds: float = 0.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        profiler=None,
        receive_lookahead: int | None = None,
        losses_to_last_rank: bool = False,
        replan: ReplanWindow | None = None,
        post_validation: bool = False,
        breadth_first_microbatches: int | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (seconds each P2P wait may take), got {timeout_s}")
        self.name = schedule
        self.memory_limit, self.costs, self.chunks = memory_limit, costs, chunks
        self.refine_seconds = refine_seconds
        self.post_validation = post_validation
        self.breadth_first_microbatches = breadth_first_microbatches
        self.timeout_s = timeout_s
        self.profiler = profiler
        self.receive_lookahead = receive_lookahead
        self.losses_to_last_rank = losses_to_last_rank
        self.replanner = Replanner(replan) if replan is not None else None
        self._schedules: dict[tuple[int, int, int], Schedule] = {}
        self._placements: dict[int, tuple] = {}  # pp -> the first schedule's: the model chunks are built for it
        self._plans: dict[tuple, object] = {}
        self._lowerings: dict[tuple, tuple[Schedule, Schedule]] = {}  # (id, dp) -> (schedule, lowered)
        self.last_store: WeightGradStore | None = None  # the W queue of the latest call (tests, debugging)
        self.last_backend: DataParallelBackend | None = None  # the data-parallel backend of the latest call
        self._replicas: tuple | None = None  # (pipeline group, chunk -> replica pair group) for two-copy schedules
        self._speculations: dict[int, Speculation] = {}
        self.redone_prefixes = 0  # iteration prefixes redone after a rolled-back optimizer step

    # -- planning -----------------------------------------------------------------------------
    def schedule_for(self, pp: int, microbatches: int, chunks: int | None = None) -> Schedule:
        """The schedule every rank runs for this setting (cached; refinement broadcast from rank 0)."""
        chunks = chunks if chunks is not None else self.chunks
        key = (pp, microbatches, chunks or 0)
        if key not in self._schedules:
            spec = self._spec(pp, microbatches, chunks, self.costs)
            schedule = build_schedule(self.name, spec) if not self._broadcasts() or dist.get_rank() == 0 else None
            if self._broadcasts():
                schedule = _broadcast_schedule(schedule)
            self._schedules[key] = schedule
        return self._schedules[key]

    def _spec(self, pp: int, microbatches: int, chunks: int | None, costs: CostModel | None) -> ScheduleSpec:
        return ScheduleSpec(
            pp,
            microbatches,
            chunks,
            costs,
            self.memory_limit,
            self.refine_seconds,
            self.post_validation,
            self.breadth_first_microbatches,
        )

    @property
    def replan_report(self) -> ReplanReport | None:
        return self.replanner.report if self.replanner is not None else None

    def _broadcasts(self) -> bool:
        # CP-SAT refinement is not deterministic across processes: plan once, share the orders.
        return self.refine_seconds > 0 and dist.is_initialized()

    def set_costs(self, costs: CostModel) -> None:
        """Re-plan with measured costs from the next call on (every rank must call this alike)."""
        self.costs = costs
        self._schedules.clear()
        self._plans.clear()
        self._lowerings.clear()

    # -- the forward_backward contract --------------------------------------------------------
    def __call__(
        self,
        *,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn=None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: bool | None = False,
        **newer_arguments,
    ) -> list:
        models = list(model) if isinstance(model, list) else [model]
        iterators = _per_chunk_iterators(data_iterator, len(models))
        config = _model_config(models[0])
        _refuse_unsupported(config, models[0])
        groups = _groups(pg_collection)
        schedule = self._schedule_for_models(groups, num_microbatches, models)
        backend = self.last_backend = backend_for(config, models)
        if schedule.shared:
            backend.replica_groups = self._replica_groups(schedule, groups.pp)
        lowered = self._lowered(schedule, backend.lowering)
        shape = _tensor_shape(config, seq_length, micro_batch_size, groups, adjust_tensor_shapes_fn)
        device = next(models[0].parameters()).device
        timer = self.replanner.begin(device) if self.replanner is not None and not forward_only else None
        check = self._prefix_check(config, lowered, groups.pp.rank(), forward_only)
        if check is not None:
            iterators = [None if iterator is None else Replay(iterator) for iterator in iterators]
        linear_split.install()
        ctx = steps.ForwardContext(
            forward_step_func, iterators, models, num_microbatches, config, groups.cp_size, collect_non_loss_data
        )
        ctx.partial_chunks = _partial_chunks(schedule, groups.pp.rank())
        if first_val_step is not None and forward_only:
            ctx.mark_first_microbatch = bool(first_val_step)
        timers = getattr(config, "timers", None)
        if timers is not None:
            timers("forward-backward", log_level=1).start(barrier=getattr(config, "barrier_with_L1_time", False))
        with _grad_sync_disabled(config, models, forward_only):
            executor = self._executor(lowered, groups, ctx, shape, forward_only, timer, check, backend)
            executor.run()
            self.redone_prefixes += executor.redone
            backend.finish()
        ctx.finish_reading()
        if not forward_only and config.finalize_model_grads_func is not None:
            num_tokens = _loss_rank_tokens(ctx, groups.pp, device) if config.calculate_per_token_loss else None
            config.finalize_model_grads_func(
                models, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce
            )
        if timers is not None:
            timers("forward-backward").stop()
        if timer is not None and self.replanner.finish(schedule):
            self._replan(schedule, groups.pp, shape, config.pipeline_dtype or config.params_dtype, len(models))
        if self.losses_to_last_rank:
            return _ship_to_last_rank(ctx.forward_data_store, schedule, groups.pp, device)
        return ctx.forward_data_store

    def _replan(self, schedule: Schedule, pipeline: dist.ProcessGroup, shape, dtype, num_chunks: int) -> None:
        """Swap in the plan for measured costs (same placement) on every rank at once."""
        chunks = num_chunks if num_chunks > 1 else None

        def plan(costs: CostModel) -> Schedule:
            return build_schedule(self.name, self._spec(schedule.pp, schedule.microbatches, chunks, costs))

        chosen, self.costs = self.replanner.replan(
            schedule, self.costs, plan, pipeline, shape, dtype, self.memory_limit
        )
        self._schedules = {(schedule.pp, schedule.microbatches, chunks or 0): chosen}
        self._plans.clear()
        self._lowerings.clear()

    def _schedule_for_models(self, groups: Groups, microbatches: int, models: list) -> Schedule:
        schedule = self.schedule_for(groups.pp.size(), microbatches, len(models) if len(models) > 1 else None)
        if schedule.chunks != len(models):
            raise ScheduleError(
                f"schedule {schedule.name} runs {schedule.chunks} model chunk(s) per rank, got {len(models)}; "
                f"build the model with {schedule.chunks} chunk(s) for its {schedule.placement.kind} placement"
            )
        built_for = self._placements.setdefault(schedule.pp, schedule.placements)
        if schedule.placements != built_for:
            raise ScheduleError(
                f"{self.name} with {microbatches} microbatches plans {schedule.name}, whose "
                f"{schedule.placement.kind} placement differs from the one the model chunks were built for; "
                "choose one schedule family by name instead of an automatic choice"
            )
        return schedule

    def _prefix_check(self, config, schedule: Schedule, rank: int, forward_only: bool) -> PrefixCheck | None:
        """With a post-validated optimizer step pending: where this rank checks it (forward-only: at once)."""
        validation = getattr(config, CONFIG_ATTRIBUTE, None)
        if validation is None or validation.pending is None:
            return None
        if forward_only:
            validation.settle()  # nothing ran on the guessed parameters yet
            return None
        if id(schedule) not in self._speculations:
            self._speculations[id(schedule)] = speculation(schedule)
        found = self._speculations[id(schedule)]
        return PrefixCheck(found.prefix[rank], found.sent_in_prefix[rank], validation.settle)

    def _executor(
        self,
        schedule: Schedule,
        groups: Groups,
        ctx: steps.ForwardContext,
        shape,
        forward_only: bool,
        timer=None,
        check: PrefixCheck | None = None,
        backend: DataParallelBackend | None = None,
    ):
        config, models = ctx.config, ctx.models
        profiler = self.profiler if self.profiler is not None and self.profiler.active else None
        if timer is not None:
            profiler = timer if profiler is None else NestedProfilers(profiler, timer)
        self.last_store = WeightGradStore()
        return Executor(
            self._plan(schedule, groups.pp.rank(), forward_only),
            ctx,
            PipeComm(groups.pp, self.timeout_s),
            self.last_store,
            [[] if forward_only else delayed_wgrad_layers(m) for m in models],
            shape,
            config.pipeline_dtype or config.params_dtype,
            next(models[0].parameters()).device,
            forward_only=forward_only,
            data_parallel=backend,
            profiler=profiler,
            receive_lookahead=self._lookahead(groups.pp),
            prefix_check=check,
        )

    def _replica_groups(self, schedule: Schedule, pipeline: dist.ProcessGroup) -> dict:
        """The pair groups of the ranks holding two copies of a block, created once (collective)."""
        if self._replicas is None or self._replicas[0] is not pipeline:  # new groups: made for this pipeline group
            self._replicas = (pipeline, replica_groups(schedule, pipeline))
        return self._replicas[1]

    def _lowered(self, schedule: Schedule, data_parallel: DataParallel) -> Schedule:
        """``schedule`` with the data-parallel actions of this run (cached: every call of a run lowers alike)."""
        key = (id(schedule), data_parallel)
        if key not in self._lowerings:  # the schedule is kept with it, so its id is not reused
            self._lowerings[key] = (schedule, lower(schedule, data_parallel, self.costs))
        return self._lowerings[key][1]

    def _plan(self, schedule: Schedule, rank: int, forward_only: bool):
        key = (id(schedule), rank, forward_only)
        if key not in self._plans:
            self._plans[key] = plan_rank(schedule, rank, forward_only)
        return self._plans[key]

    def _lookahead(self, group: dist.ProcessGroup) -> int:
        if self.receive_lookahead is not None:
            return self.receive_lookahead
        # gloo matches each (peer, direction) in order, so receives can be posted early; NCCL
        # serialises a pair's sends and receives on one stream, so post them where they fall.
        return 2 if dist.get_backend(group) == "gloo" else 0


def _per_chunk_iterators(data_iterator, chunks: int) -> list:
    if isinstance(data_iterator, list):
        if len(data_iterator) != chunks:
            raise ValueError(f"got {len(data_iterator)} data iterators for {chunks} model chunks; give one per chunk")
        return data_iterator
    if chunks > 1:
        raise ValueError(
            f"{chunks} model chunks need a list of {chunks} data iterators (one per chunk, as Megatron builds "
            f"them for virtual pipelines); got a single iterator"
        )
    return [data_iterator]


def _model_config(model: torch.nn.Module):
    from megatron.core.utils import get_model_config

    return get_model_config(model)


def _refuse_unsupported(config, model: torch.nn.Module | None = None) -> None:
    """Settings this runtime does not run yet, refused before the first pass."""
    encoder_and_decoder = encoder_and_decoder_model_type()  # None on 0.16 (a property) and from 0.17 (gone)
    if model is not None and encoder_and_decoder is not None:
        from megatron.core.utils import get_model_type

        if get_model_type(model) == encoder_and_decoder:
            raise ValueError("megatron-zb schedules run decoder-only models (one boundary tensor per stage)")
    refused = {
        "variable_seq_lengths": "variable sequence lengths between microbatches",
        "defer_embedding_wgrad_compute": "--defer-embedding-wgrad-compute (zero bubble already defers W)",
    }
    for name, what in refused.items():
        if getattr(config, name, False):
            raise ValueError(f"megatron-zb schedules do not support {what}; turn {name} off")
    if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        raise ValueError(
            "megatron-zb schedules do not support --num-microbatches-with-partial-activation-checkpoints; "
            "use full or selective recompute instead"
        )


def _groups(pg_collection) -> Groups:
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        cp = getattr(pg_collection, "cp", None)
        return Groups(pg_collection.pp, pg_collection.tp, cp.size() if cp is not None else 1)
    from megatron.core import parallel_state

    return Groups(
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_context_parallel_world_size(),
    )


def _tensor_shape(config, seq_length: int, micro_batch_size: int, groups: Groups, adjust) -> tuple[int, ...]:
    """The boundary tensor between stages: [sequence, microbatch, hidden] after CP/SP splits."""
    seq = seq_length // groups.cp_size
    if config.sequence_parallel:
        seq //= groups.tp.size()
    shape = (seq, micro_batch_size, config.hidden_size)
    if adjust is not None:
        recv_shapes, send_shapes = adjust([shape], [shape])
        if len(recv_shapes) != 1 or len(send_shapes) != 1 or tuple(recv_shapes[0]) != tuple(send_shapes[0]):
            raise ValueError("adjust_tensor_shapes_fn must keep one boundary tensor of one shape for megatron-zb")
        shape = tuple(recv_shapes[0])
    return shape


@contextlib.contextmanager
def _grad_sync_disabled(config, models: list, forward_only: bool):
    """Every B and W runs under no_sync; each chunk's reduction starts after its last W."""
    no_sync = config.no_sync_func
    with contextlib.ExitStack() as stack:
        if no_sync is not None and not forward_only:
            for func in no_sync if isinstance(no_sync, list) else [no_sync]:
                stack.enter_context(func())
        yield


def _loss_rank_tokens(ctx: steps.ForwardContext, pp: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """Token count on every pipeline rank, whichever rank computed the loss.

    finalize_model_grads broadcasts it from the last pipeline rank; with a V placement the
    loss is on rank 0, so sum it over the pipeline first (only the loss rank has a count).
    """
    tokens = ctx.num_tokens if ctx.num_tokens is not None else torch.zeros((), dtype=torch.int)
    tokens = tokens.to(device=device, dtype=torch.int).reshape(())
    dist.all_reduce(tokens, group=pp)
    return tokens


def _partial_chunks(schedule: Schedule, rank: int) -> frozenset[int]:
    """This rank's chunks that run the forwards of only some of the microbatches (several pipes)."""
    if len(schedule.placements) == 1:
        return frozenset()
    counts: dict[int, int] = {}
    for p in schedule.orders[rank]:
        if p.kind.value == "F":
            counts[schedule.chunk_of(p)] = counts.get(schedule.chunk_of(p), 0) + 1
    return frozenset(chunk for chunk, count in counts.items() if count < schedule.microbatches)


def _ship_to_last_rank(store: list, schedule: Schedule, pp: dist.ProcessGroup, device: torch.device) -> list:
    """Move each pipe's loss-rank forward data to the last pipeline rank, in pipe order ([] stays behind).

    Pipes carry consecutive microbatches (pipe 0 the first ones), so pipe order is microbatch order.
    """
    last, rank = pp.size() - 1, pp.rank()
    sources = [placement.rank_of(placement.num_stages - 1) for placement in schedule.placements]
    if rank not in (last, *sources) or all(source == last for source in sources):
        return store
    if rank != last:
        peer = dist.get_global_rank(pp, last)
        dist.send_object_list(
            [_to_device(store, torch.device("cpu"))], dst=peer, group=pp, device=_object_device(pp, device)
        )
        return []
    gathered: dict[int, list] = {}
    for source in dict.fromkeys(sources):
        if source == last:
            gathered[source] = store
            continue
        payload = [None]
        dist.recv_object_list(
            payload, src=dist.get_global_rank(pp, source), group=pp, device=_object_device(pp, device)
        )
        gathered[source] = _to_device(payload[0], device)
    return [entry for source in dict.fromkeys(sources) for entry in gathered[source]]


def _object_device(group: dist.ProcessGroup, device: torch.device) -> torch.device | None:
    return device if dist.get_backend(group) == "nccl" else None


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    return value


def _broadcast_schedule(schedule: Schedule | None) -> Schedule:
    from ..schedule import placement as placements

    payload = [None]
    if schedule is not None:
        payload = [
            (
                schedule.name,
                [(p.kind, p.pp, p.chunks, p.blocks) for p in schedule.placements],
                schedule.microbatches,
                schedule.to_text(),
            )
        ]
    dist.broadcast_object_list(payload, src=0)
    name, placement_fields, microbatches, text = payload[0]
    found = tuple(placements.Placement(*fields) for fields in placement_fields)
    return Schedule(name, found, microbatches, parse_orders(text))
