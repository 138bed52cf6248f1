"""What ``megatron-zb train --megatron-lm --cpu`` checks in the launching process, before any rank starts.

Megatron-LM's ``pretrain()`` parses and validates its flags inside every rank, after the processes
started: a bad flag fails on every rank with a traceback, a minute in. Here the launching process
reads the line with Megatron-LM's own parser (every pretrain_gpt flag of that version is known),
refuses in one message every flag it does not know, refuses the GPU-only features a CPU run cannot
have (naming each and what would work), prints a line for each setting it changes for the CPU
(``CPU_SETTINGS``, added only where the line does not say otherwise), and then runs Megatron-LM's own
``validate_args`` and megatron-zb's schedule checks on the result.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

from ..checks import row
from ..flags.megatron_lm_parser import Given, given_flags, megatron_lm_parser, megatron_lm_version, refuse_unknown


@dataclass(frozen=True)
class CpuSetting:
    flag: str
    value: str | None  # None: a switch
    why: str


def _ours(name: str) -> CpuSetting:
    """A flag of megatron-zb's table (``flags/``): what a CPU run sets it to, and why, is its row's ``on_cpu``."""
    flag = row(name)
    return CpuSetting(flag.option, flag.on_cpu.value, flag.on_cpu.why)


# What a CPU run of megatron-core's local layer spec needs (added where the line does not give the flag).
CPU_SETTINGS = (
    CpuSetting("--transformer-impl", "local", "Transformer Engine needs a GPU; megatron-core's local spec runs on CPU"),
    _ours("distributed_backend"),
    CpuSetting("--no-gradient-accumulation-fusion", None, "the fused weight-gradient kernel is CUDA's"),
    CpuSetting("--no-masked-softmax-fusion", None, "the fused softmax kernels are CUDA's"),
    CpuSetting("--no-bias-gelu-fusion", None, "the fused bias-GeLU is compiled for CUDA"),
    CpuSetting("--no-bias-swiglu-fusion", None, "the fused bias-SwiGLU is compiled for CUDA"),
    CpuSetting("--no-bias-dropout-fusion", None, "the fused bias-dropout-add is compiled for CUDA"),
    CpuSetting("--no-rope-fusion", None, "the fused RoPE kernel is Transformer Engine's"),
    CpuSetting("--no-persist-layer-norm", None, "the persistent layer-norm kernel is apex's"),
)  # fmt: skip
# dest -> why a CPU run leaves the switch out (CUDA kernels of MoE layers: the unfused path computes the same)
CPU_DROPPED = {
    "moe_grouped_gemm": "grouped GEMM is a CUDA kernel (grouped_gemm or Transformer Engine); on CPU each expert runs "
    "its own GEMMs one after another (megatron-core's SequentialMLP), the same experts",
    "moe_permute_fusion": "the fused token permutation is Transformer Engine's; megatron-core's unfused permutation "
    "moves the same tokens",
    "moe_router_fusion": "the fused router top-k is Transformer Engine's; megatron-core's unfused router computes the "
    "same",
}
# dest -> (is it on, why a CPU run cannot have it, what works instead)
GPU_ONLY = {
    "transformer_impl": (lambda v: v == "transformer_engine", "Transformer Engine needs a GPU",
                         "--transformer-impl local"),
    "fp8": (bool, "fp8 needs Transformer Engine on a Hopper or newer GPU", "leave the --fp8-* flags out on CPU"),
    "fp4": (bool, "fp4 needs Transformer Engine on a Blackwell GPU", "leave the --fp4-* flags out on CPU"),
    "use_flash_attn": (bool, "flash attention is a CUDA kernel", "leave it out: megatron-core's own attention runs"),
    "tp_comm_overlap": (bool, "Transformer Engine's userbuffers need GPUs", "leave it out on CPU"),
    "enable_cuda_graph": (bool, "CUDA graphs need a GPU", "leave it out on CPU"),
    "cuda_graph_impl": (lambda v: v not in (None, "none"), "CUDA graphs need a GPU", "leave it out on CPU"),
    "use_te_activation_func": (bool, "Transformer Engine needs a GPU", "leave it out on CPU"),
    "cross_entropy_fusion_impl": (lambda v: v == "te", "Transformer Engine's fused cross entropy needs a GPU",
                                  "--cross-entropy-fusion-impl native"),
    "multi_latent_attention": (bool, "megatron-core's local layer spec, the one a CPU runs, cannot build "
                               "multi-latent attention (it needs Transformer Engine)", "run it on a GPU"),
    "attention_backend": (lambda v: getattr(v, "name", v) in ("flash", "fused"),
                          "it selects Transformer Engine's attention kernels, which need a GPU",
                          "leave it out (auto: megatron-core's local layer spec computes attention itself)"),
    "moe_token_dispatcher_type": (lambda v: v == "flex", "the flex dispatcher is DeepEP's or HybridEP's, CUDA kernels "
                                  "across GPUs", "--moe-token-dispatcher-type alltoall (or allgather)"),
    "moe_enable_deepep": (bool, "DeepEP's dispatcher is CUDA kernels across GPUs",
                          "--moe-token-dispatcher-type alltoall (or allgather)"),
    "overlap_moe_expert_parallel_comm": (bool, "megatron-core's expert-parallel all-to-all overlap runs on CUDA "
                                         "streams and needs Transformer Engine", "leave it out on CPU"),
    "experimental_attention_variant": (lambda v: v is not None, "megatron-core's experimental attention variants "
                                       "(gated delta net, ...) build with Transformer Engine only",
                                       "run it on a GPU"),
    "context_parallel_size": (lambda v: (v or 1) > 1, "megatron-core's local layer spec, the one a CPU runs, has no "
                              "context-parallel attention (Transformer Engine's, on GPUs)",
                              "tensor or data parallelism in its place"),
    "use_megatron_fsdp": (bool, "Megatron-FSDP keeps its buffers on CUDA devices and communicates on CUDA streams",
                          "--use-distributed-optimizer in its place"),
}  # fmt: skip


def cpu_additions(flags: Sequence[Given], parser: argparse.ArgumentParser) -> list[CpuSetting]:
    """The CPU settings the line does not give (by destination), for flags this Megatron-LM has."""
    given = {flag.dest for flag in flags}
    out = []
    for setting in (*CPU_SETTINGS, _checkpoint_format()):
        action = parser._option_string_actions.get(setting.flag) if setting is not None else None
        if action is not None and action.dest not in given:
            out.append(setting)
    return out


def _checkpoint_format() -> CpuSetting | None:
    """torch_dist (Megatron-LM's default) writes from helper processes that need psutil; without it, torch."""
    if importlib.util.find_spec("psutil") is not None:
        return None
    return CpuSetting(
        "--ckpt-format",
        "torch",
        "Megatron-LM's default torch_dist saves from helper processes that need the psutil package (not installed): "
        "without it a save hangs; install psutil to keep torch_dist",
    )


def setting_argv(settings: Sequence[CpuSetting]) -> list[str]:
    return [token for s in settings for token in ([s.flag] if s.value is None else [s.flag, s.value])]


def cpu_drops(flags: Sequence[Given]) -> list[CpuSetting]:
    """The switches of ``CPU_DROPPED`` the line gives, each with why a CPU run leaves it out."""
    return [CpuSetting(str(flag), None, CPU_DROPPED[flag.dest]) for flag in flags if flag.dest in CPU_DROPPED]


def without(argv: Sequence[str], parser: argparse.ArgumentParser, dests: Sequence[str]) -> list[str]:
    """``argv`` without the switches (flags that take no value) whose destination is in ``dests``."""
    dropped = {
        option for option, action in parser._option_string_actions.items() if action.dest in dests and action.nargs == 0
    }
    return [token for token in argv if token not in dropped]


@dataclass(frozen=True)
class Checked:
    additions: list[CpuSetting]  # the CPU settings to add, each with its reason
    timeout_s: float  # the line's --distributed-timeout-minutes: every wait's bound
    dropped: tuple[CpuSetting, ...] = ()  # the line's switches a CPU run leaves out (CPU_DROPPED), each with its reason
    argv: tuple[str, ...] = ()  # the line to run: without the dropped switches, the additions not yet added

    def line(self) -> list[str]:
        """The argv the ranks run: the line, less what a CPU leaves out, plus the CPU settings."""
        return [*self.argv, *setting_argv(self.additions)]


def check(argv: Sequence[str], processes: int, own_providers: bool) -> Checked:
    """Refuse (ValueError) what a CPU launch of ``argv`` cannot run; what to add, and the line's timeout."""
    from ..megatron.args import add_args

    parser = megatron_lm_parser(add_args)
    if parser is None:
        raise ValueError("Megatron-LM's megatron.training cannot be imported")
    flags, stray = given_flags(parser, argv)
    where = f"Megatron-LM {megatron_lm_version()}'s pretrain_gpt"
    problem = modelopt_flags(flags) or refuse_unknown(flags, stray, where)
    if problem:
        raise ValueError(problem)
    args = parse_line(parser, argv)
    mapped = mapped_flags(args)
    refusals = [
        _gpu_only(dest, flags)
        for dest in GPU_ONLY
        if dest not in mapped and GPU_ONLY[dest][0](getattr(args, dest, None))
    ]
    refusals = [refusal for refusal in refusals if refusal]
    if own_providers:
        from .script import refused_features

        refusals += [
            f"{feature}: megatron-zb's GPT providers (no Megatron-LM checkout) do not implement it; give your "
            "checkout with --megatron-lm PATH"
            for feature in refused_features(args)
        ]
    refusals += _missing_async_saver(args)
    if refusals:
        raise ValueError("; ".join(refusals))
    additions = cpu_additions(flags, parser)
    dropped = cpu_drops(flags)
    argv = without(argv, parser, [flag.dest for flag in flags if flag.dest in CPU_DROPPED])
    validated = validate(parser, [*argv, *setting_argv(additions)], processes)
    return Checked(additions, 60.0 * validated.distributed_timeout_minutes, tuple(dropped), tuple(argv))


def mapped_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """GPU-only destinations a megatron-zb schedule gives a CPU meaning (``megatron_mapping.moe_overlap_as_pairs``)."""
    from ..megatron.args import enabled

    return ("overlap_moe_expert_parallel_comm",) if enabled(args) else ()


def unset_te_attention() -> str | None:
    """Unset Transformer Engine's attention variables for the ranks; the line saying so, or None when none was set."""
    from . import cpu

    found = cpu.te_attention_settings()
    if not found:
        return None
    for name in cpu.TE_ATTENTION_VARIABLES:
        os.environ.pop(name, None)
    return (
        f"unset {', '.join(found)} (Transformer Engine's choice of attention kernel: a CPU runs megatron-core's own "
        "attention, whose check of these against --attention-backend would stop every rank)"
    )


def _missing_async_saver(args: argparse.Namespace) -> list[str]:
    """``--async-save`` through nvidia-resiliency-ext (Megatron-LM 0.19's default strategy) where it is not installed:
    every rank would fail at its first save."""
    if not getattr(args, "async_save", False) or getattr(args, "async_strategy", None) != "nvrx":
        return []
    if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
        return []
    return [
        "--async-save: Megatron-LM saves asynchronously through nvidia-resiliency-ext (--async-strategy nvrx, the "
        "default), which is not installed here; install it, give --async-strategy mcore, or leave --async-save out"
    ]


def _gpu_only(dest: str, flags: Sequence[Given]) -> str | None:
    """The refusal of a GPU-only setting: for a flag the line gives (defaults are replaced by CPU_SETTINGS)."""
    given = [flag for flag in flags if flag.dest == dest]
    if not given:
        return None
    _, why, instead = GPU_ONLY[dest]
    return f"{given[0]} cannot run on CPU: {why}; {instead}"


def modelopt_flags(flags: Sequence[Given]) -> str | None:
    """The refusal of a line that gives ModelOpt's flags (distillation, quantization, ...), which Megatron-LM's
    pretrain_gpt.py adds to its parser only where the nvidia-modelopt package imports; None when it gives none.

    The flags are read from the checkout's ``megatron/post_training/arguments.py`` (not in every megatron-core).
    """
    try:
        from megatron.post_training.arguments import add_modelopt_args
    except ImportError:
        return None
    modelopt = argparse.ArgumentParser(add_help=False)
    add_modelopt_args(modelopt)
    known = {option for action in modelopt._actions for option in action.option_strings}
    found = [given.flag for given in flags if given.action is None and given.flag in known]
    if not found:
        return None
    distills = any(flag.startswith("--export-kd-") for flag in found)
    what = "ModelOpt's knowledge distillation (a student trained against a teacher checkpoint with ModelOpt's loss)"
    return (
        f"{', '.join(found)}: {what if distills else 'NVIDIA ModelOpt features'}, not plain pretraining: "
        "Megatron-LM's pretrain_gpt.py takes these flags only where the nvidia-modelopt package is installed, and "
        "megatron-zb reads a line without ModelOpt's (its schedules are checked on plain pretraining); run the line "
        "without them"
    )


def parse_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Megatron-LM's parse of the line; a bad value is a ValueError naming it (not argparse's usage dump)."""

    def error(message: str):
        raise ValueError(message)

    parser = copy.copy(parser)
    parser.error = error
    return parser.parse_args(list(argv))


def validate(parser: argparse.ArgumentParser, argv: Sequence[str], processes: int) -> argparse.Namespace:
    """Megatron-LM's ``validate_args``, then megatron-zb's schedule checks, as the ranks will run them."""
    from megatron.training.arguments import validate_args

    from ..megatron.args import enabled
    from ..megatron.megatron_mapping import moe_overlap_as_pairs
    from . import cpu
    from .validation import check_zero_bubble, pad_layers

    args = parse_line(parser, argv)
    args.rank, args.world_size = 0, processes
    pad_layers(args)
    moe_overlap_as_pairs(args, enabled(args))  # as every rank's validate_args wrapper maps it
    cpu.no_gpu_architecture()
    cpu.set_environment()
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        except AssertionError as error:
            raise ValueError(
                f"Megatron-LM {megatron_lm_version()}'s validate_args refuses it: {failed_assertion(error)}"
            ) from None
    _refuse_unset_eval_interval(args)
    _refuse_missing_optimizer(args)
    refuse_expert_layout(args, processes)
    check_zero_bubble(args)
    _build_config(args)
    return args


def refuse_expert_layout(args: argparse.Namespace, processes: int) -> None:
    """megatron-core lays out the experts over pipeline x expert-parallel x expert-tensor-parallel ranks, which must
    divide the processes: ``initialize_model_parallel`` fails in every rank after spawn otherwise."""
    if not getattr(args, "num_experts", None):
        return
    pp, ep = args.pipeline_model_parallel_size, args.expert_model_parallel_size or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or args.tensor_model_parallel_size
    if processes % (pp * ep * etp):
        raise ValueError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} (by default the tensor-parallel "
            f"size) x --pipeline-model-parallel-size {pp} = {pp * ep * etp} does not divide the {processes} "
            "processes, over which megatron-core lays out the experts; give --expert-tensor-parallel-size 1, a "
            "smaller expert-parallel size or more processes"
        )


def _build_config(args: argparse.Namespace) -> None:
    """megatron-core's TransformerConfig from the validated line, as every rank's model provider builds it first.

    Its own checks (``__post_init__``) refuse what ``validate_args`` lets through, e.g.
    ``--defer-embedding-wgrad-compute`` without the gradient-accumulation fusion that a CPU run turns off:
    here they fail once, before any process starts, instead of in every rank after spawn.
    """
    from megatron.training.arguments import core_transformer_config_from_args

    from ..megatron.placement_hooks import placement_layout_in

    built = copy.copy(args)
    try:
        with contextlib.redirect_stdout(io.StringIO()), placement_layout_in(built):  # as every rank's hook sets it
            core_transformer_config_from_args(built)
    except (AssertionError, ValueError, NotImplementedError) as error:
        raise ValueError(
            f"megatron-core's TransformerConfig refuses the line as Megatron-LM {megatron_lm_version()} builds it: "
            f"{failed_assertion(error)}"
        ) from None


def failed_assertion(error: BaseException) -> str:
    """The error's message; for a bare ``assert`` (no message) the source line that failed, and where."""
    text = str(error).strip()
    if text:
        return text
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return type(error).__name__
    last = frames[-1]
    return f"{(last.line or '').strip() or type(error).__name__} ({os.path.basename(last.filename)}:{last.lineno})"


def _refuse_missing_optimizer(args: argparse.Namespace) -> None:
    """Muon (and megatron-core's other emerging optimizers) come from the package emerging-optimizers: without it every
    rank would fail building the optimizer, after spawn."""
    optimizer = str(getattr(args, "optimizer", "adam") or "adam")
    if "muon" not in optimizer and optimizer != "lion":
        return
    if importlib.util.find_spec("emerging_optimizers") is not None:
        return
    raise ValueError(
        f"--optimizer {optimizer}: megatron-core builds it from the package emerging-optimizers, which is not "
        "installed here (pip install emerging-optimizers); or give --optimizer adam"
    )


def _refuse_unset_eval_interval(args: argparse.Namespace) -> None:
    """Megatron-LM 0.19 defaults ``--eval-interval`` to None and then divides by it building the datasets."""
    if args.eval_interval is None and not getattr(args, "skip_train", False) and not args.full_validation:
        raise ValueError(
            f"--eval-interval: Megatron-LM {megatron_lm_version()} leaves it unset by default and then fails building "
            "the datasets (train_iters // eval_interval); give --eval-interval N (with --eval-iters 0 to skip "
            "evaluation)"
        )
