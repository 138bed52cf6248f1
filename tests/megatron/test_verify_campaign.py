"""``scripts/verify_campaign.py``: Megatron-LM's functional-test lines through ``verify --megatron-lm``.

The campaign itself runs for an hour or more (docs/verify_campaign.md holds its table); here its reading of the
configs and of verify's answers is checked, and a drawn line of the recorded table runs again on the shared
checkout for this Python and must end as recorded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron_zb.testing import checkouts
from megatron_zb.testing.scripts import load_script

campaign = load_script("verify_campaign")
RECORDED = Path(__file__).parents[2] / "docs" / "verify_campaign.jsonl"


def test_a_config_becomes_the_line_the_test_runner_passes(tmp_path: Path) -> None:
    config = tmp_path / "gpt" / "gpt3_tiny_pp2" / "model_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(
        "ENV_VARS:\n  NVTE_FUSED_ATTN: 0\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\n"
        "MODEL_ARGS:\n  --num-layers: 12\n  --bf16: true\n  --fp16: false\n  --lr: 1.0e-5\n"
        "  --data-path: ${DATA_PATH}/text/my-gpt3_00_text_document\n  --split: 949,50,1\n"
        "  --dist-ckpt-strictness: log_all # a comment\n  --rampup-batch-size: [32, 32, 65324160]\n"
        '  --step-batch-size-schedule: "0:384 200B:768"\n  --seed: ${REPEAT}\n'
        '  --hierarchical-context-parallel-sizes: "[2 2]"\n  --recompute-modules: "[moe_act]"\n'
        '  --moe-layer-freq: "[1,0]"\n'
        "TEST_TYPE: regular\nMODE: pretraining\n"
    )
    (tmp_path / "gpt" / "gpt3_tiny_pp2_1node").mkdir()
    (tmp_path / "gpt" / "gpt3_tiny_pp2_1node" / "model_config.yaml").write_text(config.read_text())
    inference = tmp_path / "gpt" / "gpt_static_inference" / "model_config.yaml"
    inference.parent.mkdir()
    inference.write_text("MODE: inference\nMODEL_ARGS:\n  --temperature: 1.0\n")
    line, other = campaign.lines(tmp_path / "gpt")
    assert (other.name, other.mode) == ("gpt_static_inference", "inference")
    assert campaign.run(other, None, ["--enable-zero-bubble"], 60)["outcome"] == "not pretraining"
    assert line.name == "gpt3_tiny_pp2" and line.mode == "pretraining"
    assert line.environment == {"NVTE_FUSED_ATTN": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    data = line.argv[line.argv.index("--data-path") + 1]
    assert data.endswith("megatron-zb-campaign/DATA_PATH/text/my-gpt3_00_text_document")
    assert line.argv == [
        *("--num-layers", "12", "--bf16", "--lr", "1e-05", "--data-path", data, "--split", "949,50,1"),
        *("--dist-ckpt-strictness", "log_all", "--rampup-batch-size", "32", "32", "65324160"),
        *("--step-batch-size-schedule", "0:384 200B:768", "--seed", "1", "--hierarchical-context-parallel-sizes"),
        *("2", "2", "--recompute-modules", "moe_act", "--moe-layer-freq", "[1,0]"),
    ]


def test_a_config_without_mode_or_flags_named_as_inference_is_not_pretraining(tmp_path: Path) -> None:
    """gpt_dynamic_inference_tp1_pp1_583m_cuda_graphs_validation gives neither MODE nor MODEL_ARGS: not run (it was
    refused by Megatron-LM's validate_args, a bare assert on the missing --micro-batch-size)."""
    for name, text in (
        ("gpt_dynamic_inference_tp1_cuda_graphs_validation", "ENV_VARS:\n  NCCL_ALGO: Tree\nMODEL_ARGS:\n"),
        ("gpt3_no_flags", "MODEL_ARGS:\n"),  # not named as inference: left to pretrain_gpt (which refuses it)
    ):
        config = tmp_path / "gpt" / name / "model_config.yaml"
        config.parent.mkdir(parents=True)
        config.write_text(text + "TEST_TYPE: regular\n")
    plain, inference = campaign.lines(tmp_path / "gpt")  # sorted by name
    assert (inference.mode, inference.mode_given, plain.mode) == ("inference", False, "pretraining")
    found = campaign.run(inference, None, ["--enable-zero-bubble"], 60)
    assert found["outcome"] == "not pretraining" and found["why"].startswith("no MODE and no MODEL_ARGS: an inference")


@pytest.mark.parametrize(
    "code, out, err, outcome, why",
    [
        (0, "table\nOK: zb-1p matches megatron-core's schedule within 1e-02 relative\n", "", "OK", "OK: zb-1p matches"),
        (2, "", "megatron-zb verify: error: --fp8-format: fp8 needs a GPU\n", "refused", "--fp8-format: fp8 needs"),
        (1, "MISMATCH at iteration 2: the grad norm differs by 2.00e-02 relative\n", "", "mismatch", "MISMATCH at"),
        (1, "", "megatron-zb verify: the run with zb-v failed (exit status 1); the end\nKeyError: 'x'\n", "failed",
         "the run with zb-v failed (exit status 1); the end / KeyError: 'x'"),
    ],
)  # fmt: skip
def test_verifys_answers_are_read_as_outcomes(code: int, out: str, err: str, outcome: str, why: str) -> None:
    found, said = campaign.classify(code, out, err)
    assert found == outcome and said.startswith(why), said


def _recorded() -> dict[str, dict]:
    """The recorded rows of this Python's shared checkout (the table's lines ran on core_v0.19.0)."""
    rows = campaign.read_results(RECORDED) if RECORDED.exists() else {}
    return {name: row for name, row in rows.items() if row.get("checkout") == checkouts.SHARED_CHECKOUT.name}


@pytest.mark.skipif(not checkouts.available() or not campaign.CONFIGS.is_dir(), reason=checkouts.skip_reason())
@pytest.mark.skipif(not _recorded(), reason="no recorded row for this Python's checkout (docs/verify_campaign.jsonl)")
def test_a_drawn_recorded_line_ends_as_recorded(tmp_path: Path) -> None:
    """One line of the table (drawn afresh each run among the OK and refused rows) on this Python's checkout."""
    recorded = {name: row for name, row in _recorded().items() if row["outcome"] in ("OK", "refused")}
    name = random.Random().choice(sorted(recorded))
    [line] = [line for line in campaign.lines(campaign.CONFIGS) if line.name == name]
    found = campaign.run(line, str(checkouts.checkout(tmp_path)), recorded[name]["flag"].split(), 900)
    assert found["outcome"] == recorded[name]["outcome"], (name, json.dumps(found), recorded[name]["why"])
