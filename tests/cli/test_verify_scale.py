"""``megatron-zb verify`` reads a real pretrain_gpt line with Megatron-LM's parser and scales it, every flag accounted.

The lines are Megatron-LM's own example scripts (GPT-3 175B, Llama-3 8B; core_v0.16.1 and core_v0.19.0), kept as
test data in tests/data/megatron_lm_examples (the argv their torchrun line passes, as bash expands it). Nothing
trains here: the scaled copy is checked flag by flag, then Megatron-LM's own ``validate_args`` and megatron-zb's
schedule checks accept it (``preflight.validate``), as the ranks will. Needs ``megatron.training`` (megatron-core
0.17+, or a checkout on the path).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
from pathlib import Path

import pytest

from megatron_zb import verify
from megatron_zb.flags.megatron_lm_parser import given_flags, megatron_lm_parser, megatron_lm_version
from megatron_zb.megatron.args import add_args, schedule_settings
from megatron_zb.megatron_lm import preflight
from megatron_zb.verify import scale

EXAMPLES = Path(__file__).parents[1] / "data" / "megatron_lm_examples"
PARSER = megatron_lm_parser(add_args)
pytestmark = pytest.mark.skipif(PARSER is None, reason="needs Megatron-LM's megatron.training (megatron-core >= 0.17)")
# Megatron-LM's own answers differ by version: core_v0.16.1 refuses its own GPT-3 example (a batch-size ramp with
# --train-iters) and has no --step-batch-size-schedule; 0.19 takes the first and refuses core_v0.19.0's example.
OLD = PARSER is not None and megatron_lm_version().startswith("0.16")
since_0_17 = pytest.mark.skipif(OLD, reason="Megatron-LM 0.16 answers otherwise (test_megatron_lm_0_16_refuses_...)")
# Flags that carry the model's math: the scaled copy keeps each exactly as the line gives it.
SEMANTIC = {
    "llama3_8b": (
        "--swiglu", "--normalization RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--position-embedding-type rope", "--rotary-base 1000000", "--apply-layernorm-1p", "--bf16",
        "--clip-grad 1.0", "--calculate-per-token-loss", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather", "--group-query-attention", "--init-method-std 0.0134", "--decoupled-lr 5.0e-4",
        "--weight-decay 0.1", "--adam-beta2 0.95", "--lr 0.00015", "--lr-decay-style cosine",
    ),
    "gpt3_175b": ("--fp16", "--clip-grad 1.0", "--weight-decay 0.1", "--init-method-std 0.006", "--lr 6.0e-5"),
}  # fmt: skip


def example(name: str) -> list[str]:
    return json.loads((EXAMPLES / f"{name}.json").read_text())["argv"]


def scaled(argv: list[str], tmp_path: Path, iterations: int = 4) -> scale.ScaledLine:
    flags, stray = given_flags(PARSER, argv)
    assert not stray
    args = PARSER.parse_args(argv)
    return scale.scale(PARSER, flags, args, scale.Limits(iterations, 1, tmp_path), schedule_settings)


def values(argv: list[str], flag: str) -> list[str] | None:
    flags, _ = given_flags(PARSER, argv)
    found = [given for given in flags if given.flag == flag]
    return list(found[-1].values) if found else None


@pytest.mark.parametrize("version", ["core_v0.16.1", "core_v0.19.0"])
@pytest.mark.parametrize("zero_bubble", ["--enable-zero-bubble", "--zero-bubble-v-schedule"])
def test_llama_example_scales_with_every_flag_accounted_for(tmp_path: Path, version: str, zero_bubble: str) -> None:
    argv = [*example(f"llama3_8b_{version}"), zero_bubble]
    line = scaled(argv, tmp_path)
    flags, _ = given_flags(PARSER, argv)
    changed = {change.flag for change in line.changes}
    kept = set(line.kept)
    for given in flags:
        assert given.flag in changed or str(given) in kept, f"{given} is neither kept nor changed"
    written = " ".join(argv)
    for flag in SEMANTIC["llama3_8b"]:  # core_v0.16.1's example has no --normalization RMSNorm (LayerNorm)
        assert flag in kept or flag not in written, f"{flag} must reach the scaled copy unchanged"
    assert ("--normalization RMSNorm" in written) == (version == "core_v0.19.0")
    argv = line.argv
    # GQA 32:8 keeps its 4:1 ratio; the head size shrinks with --kv-channels; FFN keeps 14336/4096
    assert values(argv, "--num-attention-heads") == ["8"] and values(argv, "--num-query-groups") == ["2"]
    assert values(argv, "--kv-channels") == ["8"] and values(argv, "--hidden-size") == ["64"]
    assert values(argv, "--ffn-hidden-size") == ["224"]
    assert values(argv, "--pipeline-model-parallel-size") == ["2"]  # pp 1 on the line: a schedule needs two
    assert values(argv, "--num-layers") == (["4"] if "v-schedule" in zero_bubble else ["2"])
    assert values(argv, "--train-iters") == ["4"] and values(argv, "--train-samples") is None
    for gone in ("--fp8-format", "--load", "--tensorboard-dir", "--profile", "--exit-duration-in-mins"):
        assert values(argv, gone) is None, f"{gone} must not reach the scaled copy"
    assert values(argv, "--save")[0].startswith(str(tmp_path))
    assert values(line.reference_argv, "--save") is None and values(line.reference_argv, "--save-interval") is None
    assert values(argv, "--transformer-impl") == ["local"]
    assert zero_bubble in argv and zero_bubble not in line.reference_argv
    assert scale.SAME_INIT in argv and scale.SAME_INIT in line.reference_argv
    assert line.precision == "bf16" and line.processes == 2
    from megatron_zb.megatron_lm.preflight import validate

    for run in (line.argv, line.reference_argv):
        validated = validate(PARSER, run, line.processes)
        assert validated.num_query_groups == 2 and validated.swiglu and validated.add_bias_linear is False
    table = line.table()
    assert "keeps the heads-to-groups ratio of 32:8" in table and "fp8 needs Transformer Engine" in table


@since_0_17
def test_gpt3_example_maps_its_parallel_sizes_onto_four_processes(tmp_path: Path) -> None:
    argv = [*example("gpt3_175b_core_v0.16.1"), "--enable-zero-bubble"]
    line = scaled(argv, tmp_path)
    assert values(line.argv, "--tensor-model-parallel-size") == ["2"]
    assert values(line.argv, "--pipeline-model-parallel-size") == ["2"]
    assert line.processes == 4 and line.schedule == "zb-1p" and line.precision == "fp16"
    for flag in SEMANTIC["gpt3_175b"]:
        assert flag in line.kept
    # the batch-size ramp is kept, scaled: pp then 2·pp microbatches, switching halfway
    assert values(line.argv, "--rampup-batch-size") == ["2", "2", "4"]
    # missing data files: mock data, and the reason names the file
    why = next(change.why for change in line.changes if change.flag == "--data-path")
    assert "/data/my-gpt3_00_text_document.bin" in why and "--mock-data" in line.argv
    vocab = next(change for change in line.changes if change.flag == "--vocab-file")
    assert vocab.why.startswith(f"{vocab.given}: not found here; the mock data") and ".bin" not in vocab.why
    assert values(line.argv, "--initial-loss-scale") == [str(scale.FP16_START_SCALE)]
    from megatron_zb.megatron_lm.preflight import validate

    validate(PARSER, line.argv, line.processes)


@since_0_17
def test_zb_2p_limit_follows_the_pipeline_size(tmp_path: Path) -> None:
    argv = [*example("gpt3_175b_core_v0.16.1"), "--enable-zero-bubble", "--zero-bubble-max-pending-backward", "32"]
    line = scaled(argv, tmp_path)
    assert line.schedule == "zb-2p" and values(line.argv, "--zero-bubble-max-pending-backward") == ["4"]


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = verify.main(argv)
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


@since_0_17
def test_a_split_quoted_value_is_refused_with_its_cause() -> None:
    code, _, err = run_main(["--", *example("gpt3_175b_core_v0.19.0"), "--enable-zero-bubble"])
    assert code == 2 and "Traceback" not in err
    assert "values that follow no flag" in err and "2.4B:320 4.8B:624" in err
    assert "--step-batch-size-schedule takes one value: was a quoted value split by the shell?" in err


@since_0_17
def test_megatron_lm_refusal_of_the_line_comes_before_any_process() -> None:
    argv = example("gpt3_175b_core_v0.19.0")
    at = argv.index("--step-batch-size-schedule")
    joined = [*argv[: at + 1], " ".join(argv[at + 1 : at + 7]), *argv[at + 7 :], "--enable-zero-bubble"]
    code, _, err = run_main(["--", *joined])
    assert code == 2
    assert "Cannot specify both --step-batch-size-schedule and --global-batch-size" in err


@pytest.mark.skipif(not OLD, reason="Megatron-LM 0.16's own refusals")
def test_megatron_lm_0_16_refuses_its_own_gpt3_examples() -> None:
    code, _, err = run_main(["--", *example("gpt3_175b_core_v0.16.1"), "--enable-zero-bubble"])
    assert code == 2 and "your line, before any scaling: Megatron-LM 0.16.1's validate_args refuses it" in err
    assert "expected no batch-size rampup for iteration-based training" in err
    code, _, err = run_main(["--", *example("gpt3_175b_core_v0.19.0"), "--enable-zero-bubble"])
    assert code == 2
    assert "1 flag that Megatron-LM 0.16.1's pretrain_gpt does not know: --step-batch-size-schedule" in err


def test_unknown_flags_are_all_named_in_one_message() -> None:
    code, _, err = run_main(["--", *example("llama3_8b_core_v0.19.0"), "--enable-zero-bubble", "--fooo", "1", "--baar"])
    assert code == 2 and "2 flags that Megatron-LM" in err and "--fooo 1, --baar" in err


# A DeepSeek-style MoE on the Llama line: 64 experts on EP 8, group-limited top-6, a shared expert, 2 dense layers
MOE = (
    "--num-experts 64 --expert-model-parallel-size 8 --moe-router-topk 6 --moe-router-num-groups 8 "
    "--moe-router-group-topk 4 --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 2816 "
    "--moe-layer-freq ([0]*2+[1]*30) --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 --moe-router-dtype fp32"
).split()


@pytest.mark.parametrize("zero_bubble, layers, pattern", [("--enable-zero-bubble", "2", "[0,1]"),
                                                          ("--zero-bubble-v-schedule", "4", "[0,1,1,1]")])  # fmt: skip
def test_moe_line_scales_its_experts_to_the_processes(tmp_path: Path, zero_bubble: str, layers: str, pattern: str):
    from megatron_zb.megatron_lm import preflight

    line = scaled([*example("llama3_8b_core_v0.19.0"), *MOE, zero_bubble], tmp_path)
    argv, why = line.argv, {change.flag: change.why for change in line.changes}
    # tp 1: verify runs two data-parallel copies (pp 2 x dp 2) to carve expert parallelism 2 from
    assert line.processes == 4 and values(argv, "--expert-model-parallel-size") == ["2"]
    assert "two data-parallel copies" in why["--expert-model-parallel-size"]
    # the fewest experts from 8 up that EP 2 and 8 groups with group top-4 take for top-6: 16 (2 per group)
    assert values(argv, "--num-experts") == ["16"] and "router groups" in why["--num-experts"]
    assert values(argv, "--moe-router-topk") == ["6"] and values(argv, "--moe-router-num-groups") == ["8"]
    # expert and shared-expert FFNs keep their ratio to the hidden size (64)
    assert values(argv, "--moe-ffn-hidden-size") == ["22"] and values(
        argv, "--moe-shared-expert-intermediate-size"
    ) == ["44"]
    assert values(argv, "--num-layers") == [layers] and values(argv, "--moe-layer-freq") == [pattern]
    assert "--moe-grouped-gemm" not in argv and "SequentialMLP" in why["--moe-grouped-gemm"]
    for kept in (
        "--moe-router-load-balancing-type seq_aux_loss",
        "--moe-aux-loss-coeff 1e-3",
        "--moe-router-dtype fp32",
    ):
        assert kept in line.kept
    for run in (line.argv, line.reference_argv):
        preflight.validate(PARSER, run, line.processes)  # Megatron-LM and megatron-zb take the scaled copy


def test_moe_expert_tensor_parallelism_gives_way_to_expert_parallelism(tmp_path: Path) -> None:
    """tp 4, etp 2, ep 2 (a functional-test line) on pp 2 x tp 2: ep x etp must divide tp x dp = 2; ep goes first."""
    extra = "--num-experts 8 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --moe-router-topk 2"
    line = scaled([*example("llama3_8b_core_v0.19.0"), "--tensor-model-parallel-size", "4", *extra.split(),
                   "--enable-zero-bubble"], tmp_path)  # fmt: skip
    argv = line.argv
    assert values(argv, "--tensor-model-parallel-size") == ["2"] and values(argv, "--num-experts") == ["8"]
    assert values(argv, "--expert-model-parallel-size") == ["2"]
    assert values(argv, "--expert-tensor-parallel-size") == ["1"]
    assert line.processes == 4


@pytest.mark.parametrize("extra, words", [
    ("--enable-zero-bubble --moe-token-dispatcher-type flex",
     ["--moe-token-dispatcher-type flex", "CUDA kernels", "alltoall"]),
    ("--overlap-moe-expert-parallel-comm", ["--overlap-moe-expert-parallel-comm", "CUDA streams"]),
])  # fmt: skip
def test_moe_features_a_cpu_cannot_run_are_refused_before_any_process(extra: str, words: list[str]) -> None:
    argv = [*example("llama3_8b_core_v0.19.0"), "--num-experts", "8", *extra.split()]
    code, out, err = run_main(["--", *argv])
    assert code == 2 and "gloo processes" not in out
    for word in words:
        assert word in err, err


def test_megatron_lms_all_to_all_overlap_is_our_pairs_in_the_zero_bubble_run(tmp_path: Path) -> None:
    """With a megatron-zb schedule the flag stays in the zb run (its ranks map it to overlapped F&B pairs, re-planned
    after iterations 1-2) and megatron-core's run leaves it out; too few iterations to re-plan are refused."""
    moe = "--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
    argv = [
        *example("llama3_8b_core_v0.19.0"),
        "--enable-zero-bubble",
        *moe.split(),
        "--overlap-moe-expert-parallel-comm",
    ]
    line = scaled(argv, tmp_path)
    assert "--overlap-moe-expert-parallel-comm" in line.argv
    assert "--overlap-moe-expert-parallel-comm" not in line.reference_argv
    assert values(line.argv, "--zero-bubble-pipeline-timers-start-iter") == ["1"]
    assert values(line.argv, "--zero-bubble-pipeline-timers-end-iter") == ["2"]
    assert values(line.reference_argv, "--zero-bubble-pipeline-timers-end-iter") is None
    why = {change.flag: change.why for change in line.changes}
    assert "--zero-bubble-overlap-f-b" in why["--overlap-moe-expert-parallel-comm"]
    validated = preflight.validate(PARSER, line.argv, line.processes)
    assert validated.zero_bubble_overlap_f_b and not validated.overlap_moe_expert_parallel_comm
    assert not preflight.validate(PARSER, line.reference_argv, line.processes).zero_bubble_overlap_f_b
    with pytest.raises(scale.Refused, match="--verify-iters 3 or more"):
        scaled(argv, tmp_path, iterations=2)


def test_a_line_without_a_zero_bubble_schedule_is_refused() -> None:
    code, _, err = run_main(["--", *example("llama3_8b_core_v0.19.0")])
    assert code == 2 and "no megatron-zb schedule on this line" in err


@pytest.mark.parametrize("tolerance", ["nan", "inf", "-1e-3"])
def test_tolerance_must_be_finite_and_non_negative(tolerance: str) -> None:
    code, out, err = run_main(["--verify-tolerance", tolerance, "--", *example("llama3_8b_core_v0.19.0")])
    assert code == 2 and "--verify-tolerance" in err and "OK" not in out


def test_scaler_records_what_it_replaces() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--swiglu", action="store_true")
    flags, _ = given_flags(parser, ["--hidden-size", "4096", "--swiglu"])
    scaler = scale.Scaler(parser, flags, parser.parse_args(["--hidden-size", "4096", "--swiglu"]))
    scaler.set("--hidden-size", ["64"], "small")
    line, kept = scaler.result()
    assert [str(given) for given in line] == ["--hidden-size 64", "--swiglu"] and kept == ["--swiglu"]
    assert scaler.changes == [scale.Change("--hidden-size", "4096", "64", "small")]


def test_a_change_carries_the_flags_that_depend_on_it(tmp_path: Path) -> None:
    """Flags found on Megatron-LM's functional-test lines that failed after spawn once the scaled copy changed what
    they need: each goes with its reason, and both runs pass validate_args and megatron-core's TransformerConfig."""
    argv = [
        *example("llama3_8b_core_v0.19.0"),
        *("--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "4"),
        *("--overlap-p2p-communication-warmup-flush", "--defer-embedding-wgrad-compute"),
        *("--num-distributed-optimizer-instances", "2", "--error-injection-rate", "10"),
        *("--microbatch-group-size-per-virtual-pipeline-stage", "5", "--enable-zero-bubble"),
    ]
    line = scaled(argv, tmp_path)
    # 8 microbatches leave 3 in groups of 5 at pp 4, which megatron-core's interleaved schedule refuses: 9
    assert values(line.argv, "--global-batch-size") == [str(9 * int(values(line.argv, "--micro-batch-size")[0]))]
    why = {change.flag: change.why for change in line.changes if change.scaled == "not used"}
    assert (
        "--no-gradient-accumulation-fusion: the fused weight-gradient kernel" in why["--defer-embedding-wgrad-compute"]
    )
    assert "(--no-overlap-p2p-communication: " in why["--overlap-p2p-communication-warmup-flush"]
    assert "injects faults on purpose" in why["--error-injection-rate"]
    assert values(line.argv, "--num-distributed-optimizer-instances") == ["1"]
    for gone in (
        "--defer-embedding-wgrad-compute",
        "--overlap-p2p-communication-warmup-flush",
        "--error-injection-rate",
    ):
        assert gone not in line.argv and gone not in line.reference_argv
    from megatron_zb.megatron_lm.preflight import validate

    for run in (line.argv, line.reference_argv):
        validate(PARSER, run, line.processes)


def test_what_megatron_cores_config_refuses_is_refused_before_any_process() -> None:
    """Megatron-LM's validate_args takes it; megatron-core's TransformerConfig (built in every rank) would not."""
    from megatron_zb.megatron_lm.preflight import validate

    argv = (
        "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 128 --pipeline-model-parallel-size 2 --eval-iters 0 --eval-interval 10 --train-iters 3 "
        "--transformer-impl local --no-gradient-accumulation-fusion --defer-embedding-wgrad-compute "
        "--enable-zero-bubble"
    ).split()
    with pytest.raises(ValueError, match="TransformerConfig refuses the line .*Cannot defer embedding wgrad compute"):
        validate(PARSER, argv, 2)


def test_multi_latent_attention_is_refused_by_name() -> None:
    code, _, err = run_main(
        ["--", *example("llama3_8b_core_v0.19.0"), "--enable-zero-bubble", "--multi-latent-attention"]
    )
    assert code == 2 and "--multi-latent-attention: megatron-core's local layer spec" in err


def test_a_bare_assert_in_validate_args_names_its_source_line(tmp_path: Path) -> None:
    import importlib.util

    from megatron_zb.megatron_lm.preflight import failed_assertion

    source = tmp_path / "arguments.py"  # as Megatron-LM's: a plain module, not rewritten by pytest
    source.write_text("def validate_args(args):\n    assert args > 1\n")
    spec = importlib.util.spec_from_file_location("mzb_bare_assert", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(AssertionError) as raised:
        module.validate_args(0)
    assert failed_assertion(raised.value) == "assert args > 1 (arguments.py:2)"
    assert failed_assertion(AssertionError("said why")) == "said why"


def test_swiglu_without_an_ffn_size_keeps_its_ratio(tmp_path: Path) -> None:
    """Megatron-LM's SwiGLU default (8/3 of the hidden size, rounded down to a multiple of 64) is 0 at the scaled
    size: a degenerate MLP that megatron-core trains and the W split cannot (found on ..._resume_torch_dist_swiglu)."""
    argv = [token for token in example("gpt3_175b_core_v0.19.0") if token != "--step-batch-size-schedule"]
    argv = [token for token in argv if ":" not in token or token.startswith("/")]  # its batch schedule's values
    line = scaled([*argv, "--swiglu", "--tensor-model-parallel-size", "1", "--enable-zero-bubble"], tmp_path)
    assert values(line.argv, "--hidden-size") == ["16"] and values(line.argv, "--ffn-hidden-size") == ["42"]
    why = next(change.why for change in line.changes if change.flag == "--ffn-hidden-size")
    assert "8/3" in why and "0 at the scaled hidden size 16" in why
    llama = [token for token in example("llama3_8b_core_v0.19.0") if token not in ("--ffn-hidden-size", "14336")]
    line = scaled([*llama, "--enable-zero-bubble"], tmp_path)  # hidden 64: Megatron-LM's own 128 stands
    assert values(line.argv, "--ffn-hidden-size") is None


@since_0_17
def test_mock_data_carries_the_fill_in_the_middle_flags_with_it(tmp_path: Path) -> None:
    argv = [*example("gpt3_175b_core_v0.16.1"), "--fim-data", "--fim-rate", "0.5", "--enable-zero-bubble"]
    line = scaled(argv, tmp_path)
    why = {change.flag: change.why for change in line.changes if change.scaled == "not used"}
    assert "--mock-data" in line.argv and "--fim-data" not in line.argv and "--fim-rate" not in line.argv
    assert why["--fim-data"].startswith("fill-in-the-middle samples are cut from real documents")


def test_torch_fsdp2_is_refused_with_its_reason() -> None:
    code, _, err = run_main(["--", *example("llama3_8b_core_v0.19.0"), "--enable-zero-bubble", "--use-torch-fsdp2"])
    assert code == 2 and "--use-torch-fsdp2: Megatron-LM runs torch FSDP2 without pipeline parallelism only" in err


def test_an_uneven_megatron_split_is_kept_at_the_scaled_size(tmp_path: Path) -> None:
    """--account-for-embedding/loss-in-pipeline-split (the embedding and the loss count as layers) with Megatron-LM's
    newer --num-virtual-stages-per-pipeline-rank: 8 blocks of two, the first and last holding one layer."""
    argv = [*example("llama3_8b_core_v0.19.0"), "--pipeline-model-parallel-size", "4"]
    argv += ["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers", "30"]
    argv += [
        "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split",
        "--enable-zero-bubble",
    ]
    line = scaled(argv, tmp_path)
    assert values(line.argv, "--num-layers") == ["14"]
    assert (
        "--account-for-embedding-in-pipeline-split" in line.kept and "--account-for-loss-in-pipeline-split" in line.kept
    )
    from megatron_zb.megatron_lm.preflight import validate

    for run in (line.argv, line.reference_argv):
        assert validate(PARSER, run, line.processes).virtual_pipeline_model_parallel_size == 2


PINNED = EXAMPLES / "pinned_scaled_lines.json"


def pinned_outcome(name: str, zero_bubble: str) -> dict:
    """What verify makes of an example line: the table it prints and both scaled command lines.

    The folder is a fixed name (never written here): the table's column widths follow its length.
    """
    _, stray = given_flags(PARSER, example(name))
    if stray:
        return {"stray": [str(token) for token in stray]}
    try:
        line = scaled([*example(name), zero_bubble], Path("/verify-folder"))
    except ValueError as refused:
        return {"refused": str(refused)}
    return {"table": line.table(), "argv": line.argv, "reference_argv": line.reference_argv}


@pytest.mark.parametrize("name", sorted(path.stem for path in EXAMPLES.glob("*_core_v*.json")))
@pytest.mark.parametrize("zero_bubble", ["--enable-zero-bubble", "--zero-bubble-v-schedule"])
def test_the_example_lines_scale_as_pinned(name: str, zero_bubble: str) -> None:
    """Pinned before the flag surface moved into one table: the same tables and lines after it."""
    key = f"{megatron_lm_version()[:4]} {name} {zero_bubble}"
    pinned = json.loads(PINNED.read_text()) if PINNED.exists() else {}
    found = pinned_outcome(name, zero_bubble)
    if os.environ.get("MZB_PIN_SCALED_LINES") == "1":  # rewrite the pin (review the diff)
        pinned[key] = found
        PINNED.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
    assert key in pinned, f"no pinned outcome for {key}: run with MZB_PIN_SCALED_LINES=1 and review the diff"
    assert found == pinned[key]


FUNCTIONAL_CONFIGS = Path(__file__).parents[2].parent / "shared" / "megatron-lm" / "functional-configs" / "core_v0.19.0"


def functional_line(folder: str, name: str) -> list[str]:
    """A line of Megatron-LM's functional tests as the campaign reads it (scripts/verify_campaign.py)."""
    from megatron_zb.testing.scripts import load_script

    if not (FUNCTIONAL_CONFIGS / folder / name).is_dir():
        pytest.skip(f"no {FUNCTIONAL_CONFIGS / folder / name}")
    campaign = load_script("verify_campaign")
    return next(line for line in campaign.lines(FUNCTIONAL_CONFIGS / folder) if line.name == name).argv


def test_an_interleaved_line_keeps_more_than_two_stages_without_p2p_overlap(tmp_path: Path) -> None:
    """mixtral_8x7b_tp1pp4ep8vpp8_release: tp 2, pp 4, one layer per virtual stage. At tp 2 four processes hold
    pp 2, where megatron-core's interleaved schedule without P2P overlap (off on CPU) is refused by validate_args:
    the scaled copy gives up tensor parallelism to keep pp 4, and both runs pass validate_args."""
    from megatron_zb.megatron_lm.preflight import validate

    argv = [*functional_line("mixtral", "mixtral_8x7b_tp1pp4ep8vpp8_release"), "--enable-zero-bubble"]
    assert values(argv, "--tensor-model-parallel-size") == ["2"]
    line = scaled(argv, tmp_path)
    assert values(line.argv, "--tensor-model-parallel-size") == ["1"]
    assert "--pipeline-model-parallel-size 4" in line.kept and "--no-overlap-p2p-communication" in line.argv
    why = next(change.why for change in line.changes if change.flag == "--tensor-model-parallel-size")
    assert why.startswith("megatron-core's interleaved schedule without P2P overlap")
    assert values(line.argv, "--expert-model-parallel-size") == ["1"]  # tp 1 x dp 1 leaves no expert parallelism
    assert line.processes == 4 and line.schedule == "zb-1p"
    for run in (line.argv, line.reference_argv):
        validated = validate(PARSER, run, line.processes)
        assert validated.pipeline_model_parallel_size == 4 and validated.virtual_pipeline_model_parallel_size == 8


def test_an_interleaved_line_on_two_stages_gets_three(tmp_path: Path) -> None:
    """pp 2 with a virtual pipeline: Megatron-LM takes it with its default P2P overlap, the scaled copy (overlap off)
    needs a third stage."""
    from megatron_zb.megatron_lm.preflight import validate

    argv = [*example("llama3_8b_core_v0.19.0"), "--pipeline-model-parallel-size", "2"]
    line = scaled([*argv, "--num-virtual-stages-per-pipeline-rank", "2", "--enable-zero-bubble"], tmp_path)
    assert values(line.argv, "--pipeline-model-parallel-size") == ["3"] and line.processes == 3
    for run in (line.argv, line.reference_argv):
        assert validate(PARSER, run, line.processes).virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize("extra, words", [
    ("--context-parallel-size 2", ["--context-parallel-size 2: megatron-core's local layer spec, the one a CPU runs, "
                                   "has no context-parallel attention", "On GPUs megatron-zb's schedules are not run "
                                   "with context parallelism yet", "megatron-core's own schedule runs it"]),
    ("--use-megatron-fsdp", ["--use-megatron-fsdp: Megatron-FSDP keeps its parameter and gradient buffers on CUDA",
                             "--use-distributed-optimizer in its place"]),
])  # fmt: skip
def test_what_needs_gpus_is_refused_by_its_reason_before_any_process(extra: str, words: list[str]) -> None:
    argv = [*example("llama3_8b_core_v0.19.0"), "--enable-zero-bubble", *extra.split()]
    code, out, err = run_main(["--", *argv])
    assert code == 2 and "gloo processes" not in out
    assert "your line, before any scaling: " in err and "validate_args refuses it" not in err
    for word in words:
        assert word in " ".join(err.split()), err


def test_context_parallelism_is_refused_by_the_schedule_checks_on_gpus_too() -> None:
    """Not a CPU limit there: no context-parallel run through megatron-zb's runtime has been checked."""
    from megatron_zb.megatron.args import schedule_settings

    args = PARSER.parse_args([*example("llama3_8b_core_v0.19.0"), "--enable-zero-bubble"])
    args.context_parallel_size, args.data_parallel_size = 2, 1
    words = r"--context-parallel-size > 1 yet \(2 given\), on GPUs either: .* no context-parallel run through it"
    with pytest.raises(ValueError, match=words):
        schedule_settings(args)


PADDED = (
    "--num-layers 14 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --global-batch-size 16 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 128 --pipeline-model-parallel-size 8 --eval-iters 0 --eval-interval 10 --train-iters 3 "
    "--transformer-impl local --no-gradient-accumulation-fusion"
).split()


def test_padded_layers_at_full_size_are_megatron_lms_own_uneven_split() -> None:
    """The reference implementation's 14 layers on pp 8 with --allow-padding-num-layers: Megatron-LM's validate_args
    refuses 14 layers on 8 stages, and takes them with its --account-for-embedding/loss-in-pipeline-split (the
    embedding's and the loss's stages one layer, the others two: the padded split), which megatron-zb sets first."""
    from megatron_zb.megatron_lm.preflight import validate

    with pytest.raises(ValueError, match="Number of layers should be divisible by the pipeline-model-parallel size"):
        validate(PARSER, [*PADDED, "--enable-zero-bubble"], 8)
    validated = validate(PARSER, [*PADDED, "--allow-padding-num-layers", "--enable-zero-bubble"], 8)
    assert validated.account_for_embedding_in_pipeline_split and validated.account_for_loss_in_pipeline_split
    plain = validate(PARSER, [*PADDED, "--allow-padding-num-layers", "--num-layers", "16", "--enable-zero-bubble"], 8)
    assert not plain.account_for_embedding_in_pipeline_split  # an even split needs no padding


@pytest.mark.parametrize("layers, words", [
    ("14", "zb-v: --num-layers 14 does not split evenly into 16 layer blocks"),  # 16 blocks cannot hold 14 + 2
    ("30", "--allow-padding-num-layers: Megatron-LM builds its TransformerConfig with --num-layers split evenly"),
])  # fmt: skip
def test_padded_layers_on_a_v_are_refused_by_megatron_zb_first(layers: str, words: str) -> None:
    from megatron_zb.megatron_lm.preflight import validate

    argv = [*PADDED, "--num-layers", layers, "--allow-padding-num-layers", "--zero-bubble-v-schedule"]
    with pytest.raises(ValueError, match=words):
        validate(PARSER, argv, 8)


def test_modelopt_distillation_is_named() -> None:
    """gpt3_mcore_te_tp2_pp1_modelopt_distill_resume: ModelOpt's flags, which pretrain_gpt.py adds only where the
    nvidia-modelopt package is installed."""
    from megatron_zb.flags.megatron_lm_parser import given_flags
    from megatron_zb.megatron_lm.preflight import modelopt_flags

    pytest.importorskip("megatron.post_training.arguments", reason="a checkout's megatron.post_training")
    argv = [*example("llama3_8b_core_v0.19.0"), "--export-kd-teacher-load", "/teacher", "--export-te-mcore-model"]
    flags, _ = given_flags(PARSER, argv)
    found = modelopt_flags(flags)
    assert found.startswith("--export-kd-teacher-load, --export-te-mcore-model: ModelOpt's knowledge distillation")
    assert modelopt_flags(given_flags(PARSER, example("llama3_8b_core_v0.19.0"))[0]) is None


@pytest.mark.parametrize("extra, words", [
    ("--context-parallel-size 2", "--context-parallel-size 2 cannot run on CPU: megatron-core's local layer spec"),
    ("--use-megatron-fsdp", "--use-megatron-fsdp cannot run on CPU: Megatron-FSDP keeps its buffers on CUDA devices"),
])  # fmt: skip
def test_train_on_cpu_refuses_them_by_the_same_reason(extra: str, words: str) -> None:
    """``megatron-zb train --megatron-lm --cpu``'s check in the launching process (before any rank starts)."""
    from megatron_zb.megatron_lm.preflight import check

    with pytest.raises(ValueError, match=re.escape(words)):
        check([*PADDED, "--pipeline-model-parallel-size", "2", "--num-layers", "4", *extra.split()], 4, False)


def test_a_moe_save_with_a_rank_without_experts_is_left_out_on_cpu(tmp_path: Path) -> None:
    """The first layer dense on pp 2 (one layer per stage): rank 0 holds no expert, and Megatron's distributed
    optimizer on CPU cannot save its empty expert optimizer; the scaled copy saves nothing and says why. With an MoE
    layer on every rank (the V's rank 0 holds layers 0 and 3) the save stays."""
    from megatron_zb.megatron_lm import preflight

    saving = ["--use-distributed-optimizer", "--save", str(tmp_path / "ckpt"), "--save-interval", "100"]
    dense_first = [*example("llama3_8b_core_v0.19.0"), *MOE, *saving]
    line = scaled([*dense_first, "--enable-zero-bubble"], tmp_path)
    why = {change.flag: change.why for change in line.changes}
    assert values(line.argv, "--moe-layer-freq") == ["[0,1]"] and values(line.argv, "--save") is None
    assert why["--save"].startswith("rank 0 of the scaled copy holds only dense layers")
    assert "distrib_optimizer.state_dict" in why["--save"] and why["--save-interval"] == why["--save"]
    preflight.validate(PARSER, line.argv, line.processes)
    v_line = scaled([*dense_first, "--zero-bubble-v-schedule"], tmp_path)
    assert values(v_line.argv, "--moe-layer-freq") == ["[0,1,1,1]"]
    assert values(v_line.argv, "--save") == [str(tmp_path / "checkpoints")]


def test_recomputing_the_expert_activation_goes_with_grouped_gemm_on_cpu(tmp_path: Path) -> None:
    """megatron-core recomputes moe_act with grouped GEMM only; the CPU copy runs the sequential experts, so moe_act
    leaves --recompute-modules with it (the rest stays), and Megatron-LM takes the copy."""
    from megatron_zb.megatron_lm import preflight

    extra = "--moe-grouped-gemm --recompute-granularity selective --recompute-modules moe_act core_attn".split()
    line = scaled([*example("llama3_8b_core_v0.19.0"), *MOE, *extra, "--enable-zero-bubble"], tmp_path)
    why = {change.flag: change.why for change in line.changes}
    assert values(line.argv, "--recompute-modules") == ["core_attn"]
    assert why["--recompute-modules"].startswith("moe_act left out: megatron-core recomputes the experts' activation")
    preflight.validate(PARSER, line.argv, line.processes)
