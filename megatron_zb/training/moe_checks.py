"""The launcher's mixture-of-experts flags: derived as Megatron-LM's ``validate_args`` derives them, and checked
before any process starts (``check_moe``, ``check_moe_schedule``)."""

from __future__ import annotations

import argparse

from ..flags.launcher import MOE

# The MoE flags that only matter with --num-experts (their fields): the table's MoE group but --num-experts itself.
# Megatron-LM accepts them alone and ignores them; the launcher copies them into megatron-core's config by name.
MOE_ONLY = tuple(row.name for row in MOE if row.name != "num_experts")
_PATTERN_CHARS = frozenset("0123456789[](),+* ")


def check_moe(args: argparse.Namespace) -> list[str]:
    """MoE's flags, derived as Megatron-LM's validate_args derives them, and checked; returns notes to print.

    Needs ``data_parallel_size`` and ``ffn_hidden_size``. Without experts the expert-parallel sizes must be 1
    (the tensor-parallel size), and the MoE-only flags are noted as having no effect (``unused``).
    """
    if args.num_experts == 0:
        args.num_experts = None  # Megatron-LM's reading of 0
    tp, dp = args.tensor_model_parallel_size, args.data_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp  # as Megatron-LM's validate_args
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if args.num_experts is None:
        if ep > 1:
            raise ValueError(f"--expert-model-parallel-size {ep} needs --num-experts (experts to spread out)")
        if etp != tp:
            raise ValueError(f"--expert-tensor-parallel-size {etp} needs --num-experts (it splits each expert)")
        args.moe_layer_freq = 1
        return []
    experts = args.num_experts
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    args.moe_layer_freq = moe_layer_pattern(args.moe_layer_freq, args.num_layers)
    args.moe_router_load_balancing_type = _single(args.moe_router_load_balancing_type)
    args.moe_aux_loss_coeff = _single(args.moe_aux_loss_coeff)
    _check_balancing(args)
    if args.moe_router_topk > experts:
        raise ValueError(
            f"--moe-router-topk {args.moe_router_topk} is above --num-experts {experts}: each token goes to that many "
            f"different experts; use at most {experts}"
        )
    if experts % ep:
        raise ValueError(
            f"--num-experts {experts} does not divide by --expert-model-parallel-size {ep} (each expert-parallel rank "
            f"holds the same number of experts); use a size that divides {experts}"
        )
    if (tp * dp) % (ep * etp):
        raise ValueError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} does not divide "
            f"tensor ({tp}) x data ({dp}) parallel = {tp * dp} ranks per pipeline stage, among which megatron-core "
            "lays out the experts; use sizes whose product divides it (more processes give more data parallelism)"
        )
    if tp > 1 and not args.sequence_parallel:
        raise ValueError(
            f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel (megatron-core's MoE "
            "layer refuses tensor parallelism without it in training)"
        )
    if args.moe_token_dispatcher_type == "flex":
        raise ValueError(
            "--moe-token-dispatcher-type flex needs DeepEP or HybridEP on GPUs, which this launcher does not run; use "
            "alltoall or allgather"
        )
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (megatron-core's)")
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together (group-limited routing)")
    if groups is not None and (experts % groups or group_topk > groups):
        raise ValueError(
            f"group-limited routing: --num-experts {experts} must divide by --moe-router-num-groups {groups}, and "
            f"--moe-router-group-topk {group_topk} be at most {groups}"
        )
    if ep > 1 and (args.save or args.load) and etp != tp:
        option = "--save" if args.save else "--load"
        raise ValueError(
            f"{option} with --expert-model-parallel-size {ep} needs --expert-tensor-parallel-size equal to "
            f"--tensor-model-parallel-size ({etp} and {tp} here): a checkpoint file holds one (tp, ep) rank's "
            "experts; drop --expert-tensor-parallel-size"
        )
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    notes = []
    if args.moe_grouped_gemm:
        args.moe_grouped_gemm = False
        notes.append(
            "--moe-grouped-gemm: this launcher builds megatron-core's local layers, whose experts run one after the "
            "other (SequentialMLP: the same math, and the W pass defers their weight gradients); grouped GEMM needs "
            "Transformer Engine's layers (--megatron-lm)"
        )
    return notes


def check_moe_schedule(args: argparse.Namespace) -> None:
    """What a schedule that keeps two copies of each block (BitPipe) cannot train alike: router state per copy.

    Each copy's router sees only its own direction's microbatches. The gradients of the copies are summed, but
    the running token counts of global_aux_loss are buffers of each copy: they would differ from the single
    copy's of megatron-core's schedule. (The expert bias's counts are summed between the copies with the gradients:
    ``runtime/dp/replicas.py``.)
    """
    if not args.num_experts or args.zero_bubble is None or not args.zero_bubble.shared:
        return
    check_replicated_routers(args, args.zero_bubble.schedule)


def check_replicated_routers(args: argparse.Namespace, schedule: str) -> None:
    """``check_moe_schedule``'s refusal for a schedule named ``schedule`` that keeps two copies (Megatron-LM's
    arguments too: ``num_experts`` and ``moe_router_load_balancing_type`` under the same names)."""
    if not getattr(args, "num_experts", None):
        return
    kinds = args.moe_router_load_balancing_type
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "global_aux_loss" in kinds:
        state = "--moe-router-load-balancing-type global_aux_loss"
        raise ValueError(
            f"--pipeline-schedule {schedule} with {state}: the schedule keeps two copies of each "
            "layer, each routing half of the microbatches, and global_aux_loss's running token counts are per copy "
            "(the gradients and the expert bias's counts are summed between copies, these are not); use a schedule "
            "with one copy (zb-1p, zb-v, breadth-first-zb) or another balancing"
        )


def _single(value):
    """Megatron-LM's validate_args: a one-element list of --moe-router-load-balancing-type / -aux-loss-coeff is it."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _check_balancing(args: argparse.Namespace) -> None:
    kinds, coefficients = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    values = coefficients if isinstance(coefficients, list) else [coefficients]
    bad = [value for value in values if not (value >= 0 and value < float("inf"))]
    if bad:
        raise ValueError(f"--moe-aux-loss-coeff must be finite numbers >= 0, got {bad[0]}")
    if isinstance(kinds, list) and (not isinstance(coefficients, list) or len(coefficients) != len(kinds)):
        raise ValueError(
            f"--moe-router-load-balancing-type {' '.join(kinds)} needs one --moe-aux-loss-coeff per type "
            f"({len(kinds)} values)"
        )
    if args.moe_expert_capacity_factor is not None:
        refused = [kind for kind in (kinds if isinstance(kinds, list) else [kinds]) if kind == "sinkhorn"]
        if refused:
            raise ValueError(
                "--moe-expert-capacity-factor drops tokens by their routing scores: it works with aux_loss, "
                "seq_aux_loss, global_aux_loss or none, not sinkhorn"
            )


def moe_layer_pattern(value, num_layers: int) -> int | list[int]:
    """--moe-layer-freq as Megatron-LM's ``moe_freq_type`` reads it: N, or a list pattern of 0s and 1s.

    A pattern is a Python list expression of digits, brackets, commas, + and * ("[0]+[1]*3"), evaluated here
    without ``eval``; it must give one 0 (dense) or 1 (MoE) per layer.
    """
    if isinstance(value, (int, list)):
        pattern = value
    elif "[" not in value:
        try:
            pattern = int(value)
        except ValueError:
            raise ValueError(
                f"--moe-layer-freq {value!r}: give a whole number or a list pattern like [0]+[1]*3"
            ) from None
    else:
        if not set(value) <= _PATTERN_CHARS:
            raise ValueError(f"--moe-layer-freq {value!r}: a pattern may hold only digits, [ ] ( ) , + and *")
        pattern = _evaluate(value)
    if isinstance(pattern, int):
        if pattern < 1:
            raise ValueError(f"--moe-layer-freq must be at least 1 (every N-th layer an MoE layer), got {pattern}")
        return pattern
    if not isinstance(pattern, list) or len(pattern) != num_layers or not set(pattern) <= {0, 1}:
        raise ValueError(
            f"--moe-layer-freq {value}: the pattern must give one 0 (dense) or 1 (MoE) per layer, {num_layers} in "
            f"all (--num-layers); got {pattern}"
        )
    if not any(pattern):
        raise ValueError(
            f"--moe-layer-freq {value}: the pattern has no MoE layer; drop --num-experts for a dense model"
        )
    return pattern


def _evaluate(text: str):
    """A list expression of whole numbers, lists, + and * (what ``_PATTERN_CHARS`` lets through), without eval."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and type(left) is type(right):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(right, int) and left != [] and right <= 10**6:
                return left * right
            if isinstance(node.op, ast.Mult) and isinstance(left, int) and left <= 10**6:
                return right * left
        raise ValueError

    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        raise ValueError(f"--moe-layer-freq {text!r}: not a list pattern like [0]+[1]*3 or ([1]*3+[0])*2") from None
