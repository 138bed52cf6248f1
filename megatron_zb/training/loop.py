"""The training loop: Megatron-LM's train_step reduced to what a pipeline schedule needs.

Every iteration calls ``get_forward_backward_func()`` (megatron-zb's runner once
``install()`` ran and a schedule is enabled, megatron-core's otherwise), steps the optimizer
and logs in Megatron-LM's style on the last pipeline rank, where the losses arrive.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time

import torch
import torch.distributed as dist

from ..compat import clear_moe_metrics
from .build import Trainee
from .collectives import CollectiveRecorder
from .data import Batches, sources
from .gpt_step import forward_step, mtp_losses, reduce_losses

log = logging.getLogger("megatron_zb.train")


def train(args: argparse.Namespace, trainee: Trainee) -> list[dict]:
    """Run iterations after the loaded checkpoint up to ``--train-iters``; returns the logged rows."""
    from megatron.core import parallel_state

    from ..megatron.install import runner_for
    from ..runtime.profiler import PassProfiler
    from . import idle, measured
    from .checkpoint import load_checkpoint, save_checkpoint

    start = _resume(args, trainee, load_checkpoint)
    if getattr(args, "num_experts", None):
        clear_moe_metrics(fresh=True)
    batches = sources(args, parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank())
    data = batches.train
    profiler = PassProfiler(trainee.device)
    runner = runner_for(args.zero_bubble) if args.zero_bubble is not None else None
    if runner is not None:
        runner.profiler = profiler
    traced = _traced_iterations(args, start)
    recorder = CollectiveRecorder() if traced else None
    logger = _IterationLog(args, runner, start)
    rows, replanned = [], False
    for iteration in range(start + 1, args.train_iters + 1):
        measure = runner is not None and _measured(args, iteration, trainee.device, start)
        if measure:
            profiler.iteration = iteration
            profiler.start()
        if recorder is not None and iteration in traced:
            recorder.iteration = iteration  # records between the two iterations count for the second
            if not recorder.active:
                recorder.start()
        row = _train_step(args, trainee, data, iteration, recorder)
        profiler.stop()
        if recorder is not None and recorder.active and iteration == max(traced):
            recorder.stop()
        fb_start, fb_end = row.pop("fb_start"), row.pop("fb_end")
        row["bubble_rate"] = (
            measured.measured_bubble(profiler.records, iteration, fb_start, fb_end) if measure else None
        )
        row["idle"] = (  # this rank's idle breakdown (training.idle), for training.summary
            idle.for_runner(runner, profiler, iteration, data.microbatches, len(trainee.chunks)) if measure else None
        )
        if traced and iteration == max(traced):
            _write_trace(args, profiler, recorder, sorted(traced), measured)
        if iteration not in traced or iteration == max(traced):
            profiler.records.clear()
        if runner is not None and runner.replan_report is not None and not replanned:
            row["replan"], replanned = runner.replan_report.to_dict(), True
        evaluate = batches.valid is not None and iteration % args.eval_interval == 0
        if evaluate:
            row["valid_loss"] = _evaluate(args, trainee, batches.valid, iteration // args.eval_interval - 1)
        rows.append(row)
        last = iteration == args.train_iters or (bool(args.exit_interval) and iteration % args.exit_interval == 0)
        logger.record(row, flush=last or iteration % args.log_interval == 0)
        if evaluate:
            logger.validation(iteration, row["valid_loss"])
        stop = bool(args.exit_interval) and iteration % args.exit_interval == 0
        if args.save and (
            stop or iteration == args.train_iters or (args.save_interval and iteration % args.save_interval == 0)
        ):
            if trainee.validation is not None:
                trainee.validation.settle()  # a checkpoint holds validated parameters only
            save_checkpoint(args.save, iteration, trainee.chunks, trainee.optimizer, trainee.scheduler, _extra(args))
        if stop:
            break
    if trainee.validation is not None:
        trainee.validation.close()  # the last step, validated before training ends
    logger.close()
    return rows


def _evaluate(args: argparse.Namespace, trainee: Trainee, valid: Batches, index: int) -> float | None:
    """Megatron-LM's ``evaluate``: --eval-iters forward-only iterations; the loss on the last stage.

    Evaluation ``index`` (0-based) reads the validation samples after those of the ones before,
    as Megatron-LM's validation iterator does, so a resumed run evaluates on the same samples.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if trainee.validation is not None:
        trainee.validation.settle()  # evaluate the validated parameters
    for chunk in trainee.chunks:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for step in range(args.eval_iters):
            iteration = index * args.eval_iters + step + 1
            losses += _run_schedule(get_forward_backward_func(), args, trainee, valid, iteration, forward_only=True)
    for chunk in trainee.chunks:
        chunk.train()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return reduce_losses(losses, parallel_state.get_data_parallel_group()).get("lm loss")


def _train_step(args: argparse.Namespace, trainee: Trainee, data: Batches, iteration: int, recorder=None) -> dict:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    started = time.perf_counter()
    for chunk in trainee.chunks:
        chunk.zero_grad_buffer()
    trainee.optimizer.zero_grad()
    forward_backward = get_forward_backward_func()  # looked up outside the timed window
    fb_start = time.perf_counter()
    losses = _run_schedule(forward_backward, args, trainee, data, iteration, forward_only=False)
    fb_end = time.perf_counter()
    with recorder.span("optimizer step") if recorder is not None else contextlib.nullcontext():
        succeeded, grad_norm, _ = trainee.optimizer.step()
    if getattr(args, "num_experts", None):
        clear_moe_metrics()  # megatron-core's MoE loss tracker, emptied after each step as Megatron-LM does
    if succeeded:
        trainee.scheduler.step(increment=args.global_batch_size)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    reduced = reduce_losses(losses, parallel_state.get_data_parallel_group()) if last else {}
    mtp = mtp_losses(trainee.config, data.microbatches)
    return {
        "iteration": iteration,
        "loss": reduced.get("lm loss"),
        "mtp_loss": mtp if last else None,
        "iteration_time_s": time.perf_counter() - started,
        "fb_start": fb_start,
        "fb_end": fb_end,
        "lr": trainee.optimizer.param_groups[0]["lr"],
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "skipped": not succeeded,
        "loss_scale": float(trainee.optimizer.get_loss_scale()),
    }


def _run_schedule(
    forward_backward, args: argparse.Namespace, trainee: Trainee, data: Batches, iteration: int, forward_only: bool
) -> list:
    """One iteration's micro-batches through the schedule (one data iterator per model chunk); the losses."""
    iterators = [data.iterator(iteration, trainee.device) for _ in trainee.chunks]
    return forward_backward(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=trainee.chunks,
        num_microbatches=data.microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )


def _measured(args: argparse.Namespace, iteration: int, device: torch.device, start: int) -> bool:
    """On CPU every iteration; on GPUs (timing synchronises the device) only logged or traced ones."""
    if device.type == "cpu":
        return True
    return iteration % args.log_interval == 0 or iteration in _traced_iterations(args, start)


def _trace_iteration(args: argparse.Namespace, start: int = 0) -> int | None:
    """--trace-iteration, or the last iteration this run reaches (--exit-interval included)."""
    if not args.trace_file:
        return None
    if args.trace_iteration:
        return args.trace_iteration
    if args.exit_interval:
        return min(args.train_iters, (start // args.exit_interval + 1) * args.exit_interval)
    return args.train_iters


def _traced_iterations(args: argparse.Namespace, start: int) -> set[int]:
    """The trace shows the traced iteration and the one before (what happens between two iterations)."""
    last = _trace_iteration(args, start)
    if last is None or args.zero_bubble is None:
        return set()
    return {i for i in (last - 1, last) if i > start}


def _write_trace(args: argparse.Namespace, profiler, recorder, iterations: list[int], measured) -> None:
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    gathered = measured.gather_trace(profiler.records, iterations, recorder, group)
    if gathered is not None and parallel_state.get_data_parallel_rank() == 0:
        measured.write_measured_trace(
            args.trace_file,
            gathered.passes,
            args.zero_bubble.schedule,
            iterations,
            collectives_per_rank=gathered.collectives,
            spans_per_rank=gathered.spans,
            stage_of_rank=gathered.stage_of_rank,
        )
        log.info("wrote the measured passes and collectives of iterations %s to %s", iterations, args.trace_file)


def _resume(args: argparse.Namespace, trainee: Trainee, load_checkpoint) -> int:
    """The iteration to continue after, decided once for all ranks (load_checkpoint is collective).

    No checkpoint at all in --load (no folder, or an empty one) starts from scratch with a
    warning, or stops with --exit-on-missing-checkpoint; anything else that keeps any rank from
    loading raises the same CheckpointError on every rank.
    """
    from .manifest import CheckpointError, CheckpointMissing

    if not args.load:
        return 0
    try:
        iteration, extra = load_checkpoint(args.load, trainee.chunks, trainee.optimizer, trainee.scheduler)
    except CheckpointMissing as missing:
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {args.load}: {missing} (--exit-on-missing-checkpoint)") from None
        if dist.get_rank() == 0:
            log.warning("--load %s: %s; training starts from iteration 0", args.load, missing)
        return 0
    saved = extra.get("placement")
    if saved is not None and saved != _extra(args)["placement"]:
        raise CheckpointError(
            f"--load {args.load}: the checkpoint holds the {saved} placement's layer blocks, this run uses "
            f"{_extra(args)['placement']} ({_extra(args)['schedule']}); resume with a schedule of the same placement"
        )
    if dist.get_rank() == 0:
        log.info("resumed from %s at iteration %d", args.load, iteration)
    return iteration


def _extra(args: argparse.Namespace) -> dict:
    from .manifest import model_shape, placement_text

    schedule = args.zero_bubble.schedule if args.zero_bubble else "megatron-core"
    return {
        "schedule": schedule,
        "seed": args.seed,
        "placement": placement_text(args.placements if len(args.placements) > 1 else args.placement),
        "model": model_shape(args),
        "optimizer": args.optimizer,
    }


class _IterationLog:
    """Megatron-LM-style lines every --log-interval, a JSON line per iteration with --metrics-file."""

    def __init__(self, args: argparse.Namespace, runner, start: int = 0):
        from megatron.core import parallel_state

        from .measured import MetricsWriter

        self.args = args
        self.schedule = args.zero_bubble.schedule if args.zero_bubble else "megatron-core default"
        self.logs = (
            parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0
        )
        self.metrics = MetricsWriter(args.metrics_file, enabled=True) if self.logs and args.metrics_file else None
        if self.metrics is not None and start:
            self.metrics.drop_after(start)  # the resumed run logs the iterations after the checkpoint again
        self.window: list[dict] = []

    def record(self, row: dict, flush: bool) -> None:
        """Keep ``row``; at ``flush`` (every rank at the same iteration) fill in the measured bubbles and log.

        The per-rank bubbles are gathered once per log interval, not every iteration: a gather
        across pipeline stages would end every iteration with a synchronisation.
        """
        self.window.append(row)
        if not flush:
            return
        self._fill_bubbles()
        if self.logs:
            if self.metrics is not None:
                for kept in self.window:
                    self.metrics.write(**kept, schedule=self.schedule)
            log.info(self._line(row))
        self.window.clear()

    def _fill_bubbles(self) -> None:
        from megatron.core import parallel_state

        from .measured import pipeline_bubbles

        local = [row["bubble_rate"] for row in self.window]
        if all(value is None for value in local):
            return
        means = pipeline_bubbles(local, parallel_state.get_pipeline_model_parallel_group())
        for row, mean in zip(self.window, means, strict=True):
            row["bubble_rate"] = mean

    def _line(self, row: dict) -> str:
        window = self.window
        step_ms = 1000 * sum(r["iteration_time_s"] for r in window) / len(window)
        bubbles = [r["bubble_rate"] for r in window if r.get("bubble_rate") is not None]
        parts = [
            f"iteration {row['iteration']:8d}/{self.args.train_iters:8d}",
            f"consumed samples: {row['iteration'] * self.args.global_batch_size:12d}",
            f"elapsed time per iteration (ms): {step_ms:.1f}",
            f"learning rate: {row['lr']:.6E}",
            f"global batch size: {self.args.global_batch_size:5d}",
            f"lm loss: {row['loss']:.6E}",
            *(f"mtp_{layer} loss: {loss:.6E}" for layer, loss in enumerate(row.get("mtp_loss") or (), 1)),
            f"loss scale: {row['loss_scale']:.1f}",
        ]
        if row["grad_norm"] is not None:
            parts.append(f"grad norm: {row['grad_norm']:.3f}")
        parts.append(f"number of skipped iterations: {sum(r['skipped'] for r in window):3d}")
        if bubbles:
            parts.append(f"measured bubble: {100 * sum(bubbles) / len(bubbles):.1f}%")
        parts.append(f"schedule: {self.schedule}")
        return " " + " | ".join(parts) + " |"

    def validation(self, iteration: int, loss: float | None) -> None:
        """Megatron-LM's ``evaluate_and_print_results`` block, framed by dashes."""
        if not self.logs or loss is None:
            return
        text = (
            f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {math.exp(min(20.0, loss)):.6E} | "
        )
        rule = "-" * (len(text) + 1)
        log.info("\n".join((rule, text, rule)))

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
