"""megatron-core's ``forward_backward_func`` for any registered schedule, or a schedule file.

``ForwardBackward("zb-h1")`` is a drop-in for the function ``get_forward_backward_func()``
returns: same keyword arguments, a list of model chunks and data iterators for several
chunks per rank, the list of loss dicts on the rank that computes the loss (``[]``
elsewhere). Every rank builds the same schedule from (name, pp, microbatches, chunks), so
nothing is exchanged before the first pass. ``ForwardBackward("file:PATH")`` runs the orders
in a schedule file instead (``schedule_file.build_schedule``), which every rank reads.

This module sequences one call. What is derived from a schedule (lowering, this rank's plan,
the post-validation prefix, replica groups) lives in ``run_plan``, dropped as a unit on re-plan;
megatron-core's conventions (iterators, groups, shapes, loss shipping, refusals) in
``megatron_contract``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..schedule import CostModel, Schedule, ScheduleError, ScheduleSpec
from ..schedule.schedule_file import build_schedule
from . import linear_split, steps
from .dp import DataParallelBackend, backend_for
from .executor import Executor, PrefixCheck
from .megatron_contract import (
    CONFIG_ATTRIBUTE,
    Groups,
    boundary_shape,
    grad_sync_disabled,
    loss_rank_tokens,
    model_config,
    per_chunk_iterators,
    process_groups,
    refuse_unsupported,
    ship_to_last_rank,
)
from .overlap import Pairs, Twins, model_parallel_groups
from .p2p import DEFAULT_TIMEOUT_S, PipeComm
from .profiler import NestedProfilers, PassProfiler
from .replan import Replanner, ReplanReport, ReplanWindow
from .replay import Replay
from .run_plan import RunPlan, RunPlans, Setting, broadcast_schedule
from .te_wgrad import delayed_wgrad_layers
from .wgrad import WeightGradStore

__all__ = ["CONFIG_ATTRIBUTE", "ForwardBackward"]  # CONFIG_ATTRIBUTE: where megatron_zb.optimizer reads it


class ForwardBackward:
    """Runs ``schedule`` (a registered name, or ``file:PATH``) with megatron-core's forward_backward contract.

    ``memory_limit``, ``costs``, ``chunks``, ``post_validation``, ``breadth_first_microbatches``, ``layers`` and
    ``overlap_f_b`` (pair F and B passes where the costs' all-to-all time makes it pay) are passed to the generator;
    ``timeout_s`` bounds every P2P wait; ``profiler`` (a ``PassProfiler``) times the passes when active.
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
        layers: int | None = None,
        overlap_f_b: bool = False,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (seconds each P2P wait may take), got {timeout_s}")
        self.name = schedule
        self.memory_limit, self.costs, self.chunks = memory_limit, costs, chunks
        self.refine_seconds = refine_seconds
        self.post_validation = post_validation
        self.breadth_first_microbatches = breadth_first_microbatches
        self.layers = layers  # ``auto`` plans only placements whose blocks split them
        self.overlap_f_b = overlap_f_b  # plans with all-to-all time place overlapped F&B pairs
        self.timeout_s = timeout_s
        self.profiler = profiler
        self.receive_lookahead = receive_lookahead
        self.losses_to_last_rank = losses_to_last_rank
        self.replanner = Replanner(replan) if replan is not None else None
        # The schedule of each setting and all that is derived from it, dropped together on re-plan.
        self._plans = RunPlans()
        self._placements: dict[int, tuple] = {}  # pp -> the first schedule's: the model chunks are built for it
        self.last_store: WeightGradStore | None = None  # the W queue of the latest call (tests, debugging)
        self.last_backend: DataParallelBackend | None = None  # the data-parallel backend of the latest call
        self.redone_prefixes = 0  # iteration prefixes redone after a rolled-back optimizer step
        self._pair_groups: tuple[tuple, Pairs] | None = None  # the groups twinned, and the pairs' runner

    # -- planning -----------------------------------------------------------------------------
    def schedule_for(self, pp: int, microbatches: int, chunks: int | None = None) -> Schedule:
        """The schedule every rank runs for this setting (cached; refinement broadcast from rank 0)."""
        return self._plans.schedule(
            self._setting(pp, microbatches, chunks), lambda: self._plan_schedule(pp, microbatches, chunks)
        )

    def _setting(self, pp: int, microbatches: int, chunks: int | None) -> Setting:
        chunks = chunks if chunks is not None else self.chunks
        return Setting(pp, microbatches, chunks or None)  # 0 chunks asked for: the default too

    def _plan_schedule(self, pp: int, microbatches: int, chunks: int | None) -> Schedule:
        spec = self._spec(pp, microbatches, chunks if chunks is not None else self.chunks, self.costs)
        if not self._broadcasts():
            return build_schedule(self.name, spec)
        return broadcast_schedule(build_schedule(self.name, spec) if dist.get_rank() == 0 else None)

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
            self.layers,
            overlap_f_b=self.overlap_f_b,
        )

    @property
    def replan_report(self) -> ReplanReport | None:
        return self.replanner.report if self.replanner is not None else None

    def _broadcasts(self) -> bool:
        # CP-SAT refinement is not deterministic across processes: plan once, share the schedule.
        return self.refine_seconds > 0 and dist.is_initialized()

    def use_schedule(self, schedule: Schedule) -> None:
        """Run ``schedule`` (built elsewhere, the same on every rank) for its pp and microbatches from the next
        call on; everything planned before is forgotten."""
        chunks = schedule.chunks if schedule.chunks > 1 else None
        self._plans.replan(Setting(schedule.pp, schedule.microbatches, chunks), schedule)

    def set_costs(self, costs: CostModel) -> None:
        """Re-plan with measured costs from the next call on (every rank must call this alike)."""
        self.costs = costs
        self._plans.drop()

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
        """One call in phases: plan it, build the forward context, run this rank's passes, finalize the
        gradients (timed by megatron-core's timer, when it has one), re-plan when measured, return the losses."""
        call = self._begin(
            model,
            data_iterator,
            num_microbatches,
            seq_length,
            micro_batch_size,
            adjust_tensor_shapes_fn,
            forward_only,
            pg_collection,
        )
        ctx = self._forward_context(call, forward_step_func, collect_non_loss_data, first_val_step)
        with _megatron_timer(call.config):
            self._run_passes(call, ctx)
            self._finalize_grads(call, ctx, pg_collection, force_all_reduce)
        self._replan_if_measured(call)
        return self._losses(call, ctx)

    def _begin(
        self,
        model,
        data_iterator,
        microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        adjust_tensor_shapes_fn,
        forward_only: bool,
        pg_collection,
    ) -> _Call:
        """Everything decided before the first pass: the plan, the backend and the boundary shape (refusing
        what this runtime cannot run), the replanner's timer, and where a pending optimizer step is checked."""
        models = list(model) if isinstance(model, list) else [model]
        iterators = per_chunk_iterators(data_iterator, len(models))
        config = model_config(models[0])
        refuse_unsupported(config, models[0])
        groups = process_groups(pg_collection)
        schedule = self._schedule_for_models(groups, microbatches, models)
        backend = self.last_backend = backend_for(config, models, forward_only)
        setting = self._setting(groups.pp.size(), microbatches, len(models) if len(models) > 1 else None)
        run = self._plans.run_plan(setting, backend.lowering, groups.pp, self.costs)
        if schedule.shared:
            backend.replica_groups = run.replica_groups
        shape = boundary_shape(config, seq_length, micro_batch_size, groups, adjust_tensor_shapes_fn)
        device = next(models[0].parameters()).device
        timer = self.replanner.begin(device) if self.replanner is not None and not forward_only else None
        return _Call(
            models=models,
            iterators=iterators,
            microbatches=microbatches,
            forward_only=forward_only,
            config=config,
            groups=groups,
            schedule=schedule,
            setting=setting,
            run=run,
            backend=backend,
            shape=shape,
            device=device,
            timer=timer,
            check=_prefix_check(config, run, forward_only),
        )

    def _forward_context(
        self, call: _Call, forward_step_func, collect_non_loss_data: bool, first_val_step: bool | None
    ) -> steps.ForwardContext:
        """What every forward reads; its iterators replayable when a checked prefix may be redone."""
        iterators = call.iterators
        if call.check is not None:
            iterators = [None if iterator is None else Replay(iterator) for iterator in iterators]
        linear_split.install()
        ctx = steps.ForwardContext(
            forward_step_func,
            iterators,
            call.models,
            call.microbatches,
            call.config,
            call.groups.cp_size,
            collect_non_loss_data,
        )
        ctx.partial_chunks = call.run.partial_chunks
        if first_val_step is not None and call.forward_only:
            ctx.mark_first_microbatch = bool(first_val_step)
        return ctx

    def _run_passes(self, call: _Call, ctx: steps.ForwardContext) -> None:
        """This rank's passes in plan order, megatron-core's own gradient sync held off while they run (and,
        when the schedule overlaps pairs of passes, the collectives wrapped for them)."""
        pairs = self._pairs(call)
        running = pairs.running() if pairs is not None else contextlib.nullcontext()
        with grad_sync_disabled(call.config, call.models, call.forward_only), running:
            executor = self._executor(
                call.run, call.groups, ctx, call.shape, call.forward_only, call.timer, call.check, call.backend, pairs
            )
            executor.run()
            self.redone_prefixes += executor.redone
            call.backend.finish()
        ctx.finish_reading()

    def _pairs(self, call: _Call) -> Pairs | None:
        """The twin groups of an overlapped schedule's pairs, made once (collectively: every rank runs the same
        schedule); None for a schedule without pairs, which makes no groups and wraps nothing."""
        if call.forward_only or not call.run.lowered.overlapped:
            return None
        groups = tuple(model_parallel_groups())
        cached = self._pair_groups
        if cached is None or list(map(id, cached[0])) != list(map(id, groups)):  # held: ids stay theirs
            self._pair_groups = cached = (groups, Pairs(Twins.create(groups)))
        return cached[1]

    def _finalize_grads(self, call: _Call, ctx: steps.ForwardContext, pg_collection, force_all_reduce) -> None:
        """megatron-core's ``finalize_model_grads_func`` after a training call, with the loss rank's token count."""
        config = call.config
        if call.forward_only or config.finalize_model_grads_func is None:
            return
        num_tokens = (
            loss_rank_tokens(ctx.num_tokens, call.groups.pp, call.device) if config.calculate_per_token_loss else None
        )
        config.finalize_model_grads_func(
            call.models, num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce
        )

    def _replan_if_measured(self, call: _Call) -> None:
        """Once the replanner's window has timed enough calls: re-plan with what it measured."""
        if call.timer is not None and self.replanner.finish(call.schedule):
            dtype = call.config.pipeline_dtype or call.config.params_dtype
            self._replan(call.setting, call.schedule, call.groups.pp, call.shape, dtype)

    def _losses(self, call: _Call, ctx: steps.ForwardContext) -> list:
        """The loss dicts, on the last pipeline rank when asked (Megatron-LM logs them only there)."""
        if self.losses_to_last_rank:
            return ship_to_last_rank(ctx.forward_data_store, call.schedule, call.groups.pp, call.device)
        return ctx.forward_data_store

    def _replan(self, setting: Setting, schedule: Schedule, pipeline: dist.ProcessGroup, shape, dtype) -> None:
        """Swap in the plan for measured costs (same placement) on every rank at once."""
        chunks = setting.chunks if setting.chunks is not None and setting.chunks > 1 else None

        def plan(costs: CostModel) -> Schedule:
            return build_schedule(self.name, self._spec(schedule.pp, schedule.microbatches, chunks, costs))

        chosen, self.costs = self.replanner.replan(
            schedule, self.costs, plan, pipeline, shape, dtype, self.memory_limit
        )
        self._plans.replan(setting, chosen)

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

    def _executor(
        self,
        run: RunPlan,
        groups: Groups,
        ctx: steps.ForwardContext,
        shape,
        forward_only: bool,
        timer=None,
        check: PrefixCheck | None = None,
        backend: DataParallelBackend | None = None,
        pairs: Pairs | None = None,
    ):
        config, models = ctx.config, ctx.models
        profiler = self.profiler if self.profiler is not None and self.profiler.active else None
        if timer is not None:
            profiler = timer if profiler is None else NestedProfilers(profiler, timer)
        self.last_store = WeightGradStore()
        return Executor(
            run.rank_plan(forward_only),
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
            pairs=pairs,
        )

    def _lookahead(self, group: dist.ProcessGroup) -> int:
        if self.receive_lookahead is not None:
            return self.receive_lookahead
        # gloo matches each (peer, direction) in order, so receives can be posted early; NCCL
        # serialises a pair's sends and receives on one stream, so post them where they fall.
        return 2 if dist.get_backend(group) == "gloo" else 0


@dataclass(frozen=True)
class _Call:
    """One call's choices, made before its first pass (``_begin``) and read by every phase after it."""

    models: list[torch.nn.Module]  # the model chunks of this rank
    iterators: list  # one data iterator per chunk (None where a chunk reads none)
    microbatches: int
    forward_only: bool
    config: Any  # megatron-core's ModelParallelConfig of the chunks
    groups: Groups
    schedule: Schedule
    setting: Setting
    run: RunPlan
    backend: DataParallelBackend
    shape: tuple[int, ...]  # of the tensors crossing stage boundaries
    device: torch.device
    timer: PassProfiler | None  # the replanner's pass timer while its window measures this call
    check: PrefixCheck | None  # where a pending optimizer step is checked (None: none pending)


@contextmanager
def _megatron_timer(config) -> Iterator[None]:
    """megatron-core's "forward-backward" timer around the passes and gradient finalization, when it has one."""
    timers = getattr(config, "timers", None)
    if timers is None:
        yield
        return
    timers("forward-backward", log_level=1).start(barrier=getattr(config, "barrier_with_L1_time", False))
    yield
    timers("forward-backward").stop()


def _prefix_check(config, run: RunPlan, forward_only: bool) -> PrefixCheck | None:
    """With a post-validated optimizer step pending: where this rank checks it (forward-only: at once)."""
    validation = getattr(config, CONFIG_ATTRIBUTE, None)
    if validation is None or validation.pending is None:
        return None
    if forward_only:
        validation.settle()  # nothing ran on the guessed parameters yet
        return None
    return run.prefix_check(validation.settle)
