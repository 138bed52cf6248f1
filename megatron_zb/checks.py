"""The number rules that both routes apply: megatron-zb's own launcher and Megatron-LM's parsed arguments.

``training.checks`` (every flag of ``megatron-zb train``) and ``megatron.args`` (the zero-bubble
flags in Megatron-LM's namespace) both check megatron-zb's numbers and name flags the same way;
the rules live here, below both. Each is a ValueError that names the flag, the value and what
would work. Pure Python: no torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """A closed or half-open interval of finite numbers; ``str`` says it the way a message does."""

    low: float
    high: float = math.inf
    high_open: bool = False  # [low, high) instead of [low, high]
    low_open: bool = False  # (low, ...] instead of [low, ...]

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low:g}, {self.high:g}{right}"


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
PROBABILITY = Range(0, 1, high_open=True)  # dropout and Adam's betas: 1 would zero every value / never forget
# Every wait is bounded by one timeout: at least a second (a shorter one fails healthy waits), at most a day
# (longer ones overflow gloo's and the store's millisecond counters, and a stall would go unnamed for days).
TIMEOUT_SECONDS = Range(1, 86400)
TIMEOUT_MINUTES = Range(1 / 60, 1440)

WHY = {
    "micro_batch_size": "samples per microbatch",
    "train_iters": "iterations to train",
    "log_interval": "iterations between log lines",
    "save_interval": "iterations between checkpoints; leave it out to save only at the end",
    "exit_interval": "leave it out to train all --train-iters",
    "global_batch_size": "or leave it out for micro batch x data parallel",
    "cpu_threads": "torch threads per --cpu process",
    "cpu_procs": "--cpu processes",
    "lr": "0 keeps the weights fixed",
    "hidden_dropout": "0 turns dropout off",
    "attention_dropout": "0 turns dropout off",
    "clip_grad": "0 turns clipping off",
    "loss_scale": "leave it out for the dynamic scale",
    "kv_channels": "channels per attention head",
    "num_query_groups": "key/value heads",
    "rotary_base": "RoPE's wavelength base; Llama 3 uses 500000",
    "rotary_percent": "the fraction of each head's channels RoPE rotates",
}
# Megatron-LM's options whose destination is not their own name.
OPTIONS = {
    "layernorm_epsilon": "--norm-epsilon",
    "layernorm_zero_centered_gamma": "--apply-layernorm-1p",
    "add_bias_linear": "--disable-bias-linear",
}


def flag(name: str) -> str:
    return OPTIONS.get(name, "--" + name.replace("_", "-"))


def _why(name: str) -> str:
    return f" ({WHY[name]})" if name in WHY else ""


def check_count(name: str, value: int | None, low: int = 1) -> None:
    if value is not None and value < low:
        raise ValueError(f"{flag(name)} must be at least {low}{_why(name)}, got {value}")


def check_number(name: str, value: float | None, allowed: Range) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"{flag(name)} must be a finite number {allowed}{_why(name)}, got {value}")


def check_zero_bubble_numbers(args: argparse.Namespace) -> None:
    """megatron-zb's own numbers; every route calls this (launcher, --megatron-lm, the patched pretrain_gpt)."""
    check_timeouts(args)
    check_number("zero_bubble_memory_limit", getattr(args, "zero_bubble_memory_limit", None), POSITIVE)


def check_timeouts(args: argparse.Namespace) -> None:
    """One timeout bounds every wait: --distributed-timeout-minutes; --zero-bubble-p2p-timeout may only shorten it."""
    minutes = getattr(args, "distributed_timeout_minutes", None)
    if minutes is not None and minutes not in TIMEOUT_MINUTES:
        raise ValueError(
            f"--distributed-timeout-minutes must be a finite number of minutes from 1 second to a day "
            f"({TIMEOUT_MINUTES.low:.4g} to {TIMEOUT_MINUTES.high:g}), got {minutes}: it bounds every wait, and "
            "names the stalled rank once a wait reaches it"
        )
    p2p = getattr(args, "zero_bubble_p2p_timeout", None)
    if p2p is None:
        return
    if p2p not in TIMEOUT_SECONDS:
        raise ValueError(
            f"--zero-bubble-p2p-timeout must be a finite number of seconds {TIMEOUT_SECONDS}, got {p2p} (leave it "
            "out: pipeline waits then use --distributed-timeout-minutes)"
        )
    if minutes is not None and p2p > minutes * 60:
        raise ValueError(
            f"--zero-bubble-p2p-timeout {p2p:g} s is longer than --distributed-timeout-minutes {minutes:g} "
            f"({minutes * 60:g} s), which bounds every wait: it may only shorten it; give at most {minutes * 60:g} "
            "or raise --distributed-timeout-minutes"
        )


def wait_timeout_s(args: argparse.Namespace) -> float:
    """The timeout of a pipeline wait: --zero-bubble-p2p-timeout if given, else --distributed-timeout-minutes."""
    p2p = getattr(args, "zero_bubble_p2p_timeout", None)
    minutes = getattr(args, "distributed_timeout_minutes", None)
    default = 60.0 * minutes if minutes is not None else DEFAULT_TIMEOUT_S
    return min(p2p, default) if p2p is not None else default


DEFAULT_TIMEOUT_S = 600.0  # Megatron-LM's --distributed-timeout-minutes default, 10


# megatron-zb's settings that only a megatron-zb schedule reads, with their defaults.
ZERO_BUBBLE_SETTINGS = {
    "zero_bubble_p2p_timeout": None,
    "zero_bubble_pipeline_timers_start_iter": 100,
    "zero_bubble_pipeline_timers_end_iter": 110,
    "optimizer_post_validation_rollback": "exact",
}


def refuse_zero_bubble_settings(args: argparse.Namespace) -> None:
    """Without a megatron-zb schedule these change nothing: refused rather than silently ignored."""
    given = [name for name, default in ZERO_BUBBLE_SETTINGS.items() if getattr(args, name, default) != default]
    if given:
        raise ValueError(
            f"{flag(given[0])} applies to megatron-zb schedules only and would have no effect here; choose one "
            "(--enable-zero-bubble, --zero-bubble-v-schedule or --pipeline-schedule NAME) or drop the flag"
        )
