"""Megatron-LM's own pretrain() on CPU with megatron-zb's schedules, against a real checkout.

Runs on the Megatron-LM checkout MEGATRON_LM_PATH names, else on the project's shared one for this Python
(``../shared/megatron-lm/core_v0.16.1`` on 3.11, ``core_v0.19.0`` on 3.12: CI's two environments, where the
installed megatron-core must lose to the checkout's in the launcher and in every rank), copied to a temporary
folder (Megatron-LM builds its dataset helpers into the tree); skipped where neither exists. Its pure-Python
dependencies come from ``pip install 'megatron-zb[megatron-lm]'``. Every case is one ``megatron-zb train --megatron-lm
PATH --cpu`` launch (pretrain() owns its process): a tiny GPT (fp32, dropout 0, gradient clipping
on) trains 10 iterations on pp=2 and the losses of each schedule equal megatron-core's 1F1B to
1e-5 relative. V schedules build other layers on each rank than 1F1B does, so Megatron-LM's
per-rank random initialisation differs: they and their 1F1B reference run with
``--zero-bubble-placement-independent-init`` (every weight drawn from the seed and its name).
``MEGATRON_LM_USE_INSTALLED=1`` runs the installed megatron-core's own ``megatron/training`` (the
wheel ships it from 0.17 on) with only the checkout's scripts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from megatron_zb.testing import checkouts

pytestmark = pytest.mark.skipif(not checkouts.available(), reason=checkouts.skip_reason())
EXAMPLES = Path(__file__).parents[1] / "data" / "megatron_lm_examples"

ITERATIONS = 10
MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --pipeline-model-parallel-size 2 --hidden-dropout 0 "
    "--attention-dropout 0 --log-interval 1 --eval-iters 0 --eval-interval 10 --seed 1234 --clip-grad 0.05"
)
SAME_INIT = "--zero-bubble-placement-independent-init"
DROPOUT = "--hidden-dropout 0.1 --attention-dropout 0.1"
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
SELECTIVE = "--recompute-granularity selective"
KEYED = "--zero-bubble-order-independent-dropout"
CASES = {
    "1f1b": "",  # megatron-core's own schedule: the reference
    "zb-1p": "--enable-zero-bubble",
    "zb-2p": "--enable-zero-bubble --zero-bubble-max-pending-backward 4",
    "post-validation": "--enable-zero-bubble --enable-optimizer-post-validation",
    # V: the embedding and the loss on rank 0; reference: megatron-core's 1F1B from the same weights
    "1f1b-same-init": SAME_INIT,
    "zb-v": f"--zero-bubble-v-schedule {SAME_INIT}",
    "v-min": f"--pipeline-schedule v-min {SAME_INIT}",
    "zb-v-post-validation": f"--zero-bubble-v-schedule --enable-optimizer-post-validation {SAME_INIT}",
    # activation recomputation with the B/W split: the recomputed forward's linears defer their W as the plain
    # forward's do, and the replayed dropout masks are the ones drawn in the forward (CPU generator state)
    "1f1b-dropout": DROPOUT,
    "zb-2p-recompute": f"{DROPOUT} --enable-zero-bubble --zero-bubble-max-pending-backward 4 {SELECTIVE}",
    # dropout drawn from (seed, forward, layer): a V, whose rank 0 holds the first and the last layer, draws 1F1B's
    # masks, and full recomputation replays them
    "1f1b-keyed-dropout": f"{DROPOUT} {KEYED} {SAME_INIT}",
    "zb-v-keyed-dropout-recompute": f"--zero-bubble-v-schedule {DROPOUT} {KEYED} {SAME_INIT} {RECOMPUTE}",
    # tensor parallelism: rank 0's loss chunk needs labels on both tensor-parallel ranks
    "1f1b-tp2": f"--tensor-model-parallel-size 2 {SAME_INIT}",
    "zb-v-tp2": f"--tensor-model-parallel-size 2 --zero-bubble-v-schedule {SAME_INIT}",
    # BitPipe: two mirrored V pipes in one model list, each block on two ranks (the copies' gradients summed)
    "bitpipe-zb": f"--pipeline-schedule bitpipe-zb {SAME_INIT}",
}
SAVED = ("zb-1p", "zb-v", "bitpipe-zb")  # saved at iteration 5 (and 10)
# A Mixtral-style MoE line: 4 experts, top-2, the alltoall dispatcher, aux-loss balancing, a shared expert (no biases,
# as megatron-core requires of it); pp 2 x dp 2 with expert parallelism 2 carved from data parallelism (4 gloo
# processes); --moe-grouped-gemm is left out on CPU
MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-shared-expert-intermediate-size 32 "
    "--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
    "--moe-router-dtype fp32 --moe-grouped-gemm --expert-model-parallel-size 2 --disable-bias-linear "
    f"--global-batch-size 8 {SAME_INIT}"
)
MOE_CASES = {"moe-1f1b": "", "moe-zb-1p": "--enable-zero-bubble", "moe-zb-v": "--zero-bubble-v-schedule"}


def launch(flags: str, metrics: Path, *extra: str, processes: int | None = None) -> subprocess.CompletedProcess:
    root = checkouts.checkout(metrics.parent)
    command = [sys.executable, "-m", "megatron_zb.pretrain_gpt", "--megatron-lm", str(root), "--cpu"]
    command += ["--cpu-procs", str(processes)] if processes else []
    command += [*MODEL.split(), *flags.split(), "--metrics-file", str(metrics), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=900)


def metric_rows(metrics: Path) -> dict[int, dict]:
    """The --metrics-file's rows by iteration."""
    return {row["iteration"]: row for row in map(json.loads, metrics.read_text().splitlines())}


def losses(metrics: Path) -> dict[int, float]:
    return {iteration: row["loss"] for iteration, row in metric_rows(metrics).items()}


@cache
def trained(case: str, tmp: Path) -> dict[int, float]:
    metrics = tmp / f"{case}.jsonl"
    save = ("--save", str(tmp / f"{case}-ckpt"), "--save-interval", "5") if case in SAVED else ()
    done = launch(CASES[case], metrics, "--train-iters", str(ITERATIONS), *save)
    assert done.returncode == 0, done.stderr[-4000:]
    return losses(metrics)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron-lm")


def assert_rows_equal(found: dict[int, dict], reference: dict[int, dict], keys: tuple[str, ...], case: str) -> None:
    """The same iterations, and ``keys`` of each within 1e-5 relative of the reference's."""
    assert sorted(found) == sorted(reference), case
    for iteration, row in reference.items():
        for key in keys:
            assert found[iteration][key] == pytest.approx(row[key], rel=1e-5), (case, key, iteration)


def assert_close(found: dict[int, float], reference: dict[int, float]) -> None:
    assert sorted(found) == sorted(reference)
    for iteration, loss in reference.items():
        assert found[iteration] == pytest.approx(loss, rel=1e-5), (iteration, found, reference)


@pytest.mark.parametrize("case", ["zb-1p", "zb-2p", "post-validation"])
def test_losses_equal_megatron_cores_1f1b(tmp: Path, case: str) -> None:
    reference = trained("1f1b", tmp)
    assert sorted(reference) == list(range(1, ITERATIONS + 1))
    assert reference[ITERATIONS] < reference[1]
    assert_close(trained(case, tmp), reference)


@pytest.mark.parametrize("case", ["zb-v", "v-min", "zb-v-post-validation"])
def test_v_losses_equal_megatron_cores_1f1b_from_the_same_weights(tmp: Path, case: str) -> None:
    reference = trained("1f1b-same-init", tmp)
    assert sorted(reference) == list(range(1, ITERATIONS + 1))
    assert reference[ITERATIONS] < reference[1]
    assert_close(trained(case, tmp), reference)


def test_recomputation_and_dropout_with_the_backward_split_equal_megatron_cores_1f1b(tmp: Path) -> None:
    """zb-2p with selective recomputation and dropout as Megatron-LM draws it (a linear order draws 1F1B's masks);
    zb-v with full recomputation and order-independent dropout, against 1F1B with the same dropout keys."""
    assert_close(trained("zb-2p-recompute", tmp), trained("1f1b-dropout", tmp))
    assert trained("1f1b-dropout", tmp) != trained("1f1b", tmp)  # the dropout is drawn
    assert_close(trained("zb-v-keyed-dropout-recompute", tmp), trained("1f1b-keyed-dropout", tmp))


def test_v_with_tensor_parallelism_equals_megatron_cores_1f1b(tmp: Path) -> None:
    reference = trained("1f1b-tp2", tmp)
    assert reference[ITERATIONS] < reference[1]
    assert_close(trained("zb-v-tp2", tmp), reference)


@pytest.mark.parametrize(
    "case, reference_case", [("zb-1p", "1f1b"), ("zb-v", "1f1b-same-init"), ("bitpipe-zb", "1f1b-same-init")]
)
def test_resume_from_iteration_5_reproduces_6_to_10(tmp: Path, case: str, reference_case: str) -> None:
    reference = trained(reference_case, tmp)
    trained(case, tmp)  # saved at iteration 5 (and 10)
    checkpoint = tmp / f"{case}-ckpt"
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("5")
    metrics = tmp / f"{case}-resumed.jsonl"
    done = launch(CASES[case], metrics, "--train-iters", str(ITERATIONS), "--load", str(checkpoint))
    assert done.returncode == 0, done.stderr[-4000:]
    assert_close(losses(metrics), {it: loss for it, loss in reference.items() if it > 5})


def test_moe_line_under_zb_1p_and_zb_v_equals_megatron_cores_1f1b(tmp: Path) -> None:
    """MoE layers through Megatron-LM's pretrain(): the losses and grad norms of zb-1p and zb-v equal megatron-core's
    1F1B of the same line from the same weights (the experts' weight gradients deferred to W, the aux loss scaled on
    every stage as megatron-core's schedule scales it, the all-to-alls over expert-parallel ranks). zb-v saves at
    iteration 5: its rank 0 holds the embedding and the tied output copy, which megatron-core's fully parallel save
    over 2 data-parallel ranks would write twice (refused by its sharding check), so the plain save writes it."""
    rows, saved = {}, tmp / "moe-zb-v-ckpt"
    for case, flags in MOE_CASES.items():
        metrics = tmp / f"{case}.jsonl"
        save = ("--save", str(saved), "--save-interval", "5") if case == "moe-zb-v" else ()
        done = launch(f"{MOE} {flags}", metrics, "--train-iters", str(ITERATIONS), *save, processes=4)
        assert done.returncode == 0, done.stderr[-4000:]
        assert "--moe-grouped-gemm left out" in done.stderr and "SequentialMLP" in done.stderr
        assert ("ckpt-fully-parallel-save turned off" in done.stderr) == bool(save), case
        rows[case] = metric_rows(metrics)
    assert (saved / "iter_0000005").is_dir() and (saved / "latest_checkpointed_iteration.txt").read_text() == "10"
    reference = rows["moe-1f1b"]
    assert sorted(reference) == list(range(1, ITERATIONS + 1))
    assert reference[ITERATIONS]["loss"] < reference[1]["loss"]
    for case in ("moe-zb-1p", "moe-zb-v"):
        assert_rows_equal(rows[case], reference, ("loss", "grad_norm"), case)


# A DeepSeek-style MoE line: fine-grained experts (8 of FFN size 16, top-3), a gated shared expert, the first layer
# dense, the allgather dispatcher, the per-sequence aux loss, sigmoid routing with the expert bias Megatron-LM's
# finalize_model_grads updates after each step; expert parallelism 1 on pp 2 (2 gloo processes)
DEEPSEEK = (
    "--num-experts 8 --moe-router-topk 3 --moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 32 "
    "--moe-shared-expert-gate --moe-layer-freq [0]+[1]*3 --moe-token-dispatcher-type allgather "
    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-2 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2 --disable-bias-linear "
    f"--global-batch-size 8 {SAME_INIT}"
)


def test_deepseek_style_moe_line_under_v_auto_equals_megatron_cores_1f1b(tmp: Path) -> None:
    """The second MoE model through pretrain(): v-auto (the planned V, rank 0 holding the dense first layer and the
    last MoE layer) against megatron-core's 1F1B from the same weights, loss and grad norm of every iteration."""
    rows = {}
    for case, flags in {"deepseek-1f1b": "", "deepseek-v-auto": "--pipeline-schedule v-auto"}.items():
        metrics = tmp / f"{case}.jsonl"
        done = launch(f"{DEEPSEEK} {flags}", metrics, "--train-iters", str(ITERATIONS))
        assert done.returncode == 0, done.stderr[-4000:]
        rows[case] = metric_rows(metrics)
    reference, found = rows["deepseek-1f1b"], rows["deepseek-v-auto"]
    assert sorted(reference) == list(range(1, ITERATIONS + 1))
    assert reference[ITERATIONS]["loss"] < reference[1]["loss"]
    assert_rows_equal(found, reference, ("loss", "grad_norm"), "deepseek-v-auto")


# Multi-token prediction (one MTP layer; megatron-core refuses it with learned absolute positions): under the V the
# MTP block and its embedding copy sit on rank 0's loss chunk, and Megatron-LM logs its loss from the last rank.
MTP = f"--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3 --position-embedding-type rope {SAME_INIT}"


def test_mtp_under_zb_v_equals_megatron_cores_1f1b(tmp: Path) -> None:
    """The loss, Megatron-LM's "mtp_1 loss" and the grad norm of zb-v equal megatron-core's 1F1B's, iteration by
    iteration."""
    rows = {}
    for case, flags in {"mtp-1f1b": "", "mtp-zb-v": "--zero-bubble-v-schedule"}.items():
        metrics = tmp / f"{case}.jsonl"
        done = launch(f"{MTP} {flags}", metrics, "--train-iters", str(ITERATIONS))
        assert done.returncode == 0, done.stderr[-4000:]
        rows[case] = metric_rows(metrics)
    reference, found = rows["mtp-1f1b"], rows["mtp-zb-v"]
    assert sorted(reference) == list(range(1, ITERATIONS + 1))
    assert reference[ITERATIONS]["mtp_loss"][0] < reference[1]["mtp_loss"][0]
    assert_rows_equal(found, reference, ("loss", "grad_norm", "mtp_loss"), "mtp-zb-v")


def test_padded_layers_equal_megatron_lms_own_uneven_split(tmp: Path) -> None:
    """--allow-padding-num-layers as the reference implementation's scripts give it (6 layers on pp 4, which
    Megatron-LM's validate_args refuses as such): zb-1p on Megatron-LM's own uneven split (the embedding's and
    the loss's stages one layer, the others two) equals megatron-core's 1F1B given that split by its own flags."""
    sizes = "--num-layers 6 --pipeline-model-parallel-size 4 --global-batch-size 8"
    cases = {
        "padded-1f1b": f"{sizes} --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
        "padded-zb-1p": f"{sizes} --allow-padding-num-layers --enable-zero-bubble",
    }
    rows = {}
    for case, flags in cases.items():
        metrics = tmp / f"{case}.jsonl"
        done = launch(flags, metrics, "--train-iters", "4", processes=4)
        assert done.returncode == 0, done.stderr[-4000:]
        rows[case] = metric_rows(metrics)
    assert "built by Megatron-LM's own --account-for-embedding-in-pipeline-split" in done.stderr
    reference, found = rows["padded-1f1b"], rows["padded-zb-1p"]
    assert sorted(reference) == [1, 2, 3, 4] and reference[4]["loss"] < reference[1]["loss"]
    assert_rows_equal(found, reference, ("loss", "grad_norm"), "zero bubble")


def test_v_with_an_uneven_first_stage_equals_megatron_cores_1f1b(tmp: Path) -> None:
    """--decoder-first-pipeline-num-layers 1 on 7 layers: megatron-core's 1F1B puts 1 layer on rank 0 and 6 on rank 1;
    zb-v gives its first layer block 1 and the three others 2 each (rank 0: blocks 0 and 3). The same model from
    the same weights: the losses and grad norms agree."""
    flags = f"--num-layers 7 --decoder-first-pipeline-num-layers 1 {SAME_INIT}"
    rows = {}
    for case, schedule in {"first-1f1b": "", "first-zb-v": "--zero-bubble-v-schedule"}.items():
        metrics = tmp / f"{case}.jsonl"
        done = launch(f"{flags} {schedule}", metrics, "--train-iters", "4")
        assert done.returncode == 0, done.stderr[-4000:]
        rows[case] = metric_rows(metrics)
    reference, found = rows["first-1f1b"], rows["first-zb-v"]
    assert sorted(reference) == [1, 2, 3, 4] and reference[4]["loss"] < reference[1]["loss"]
    assert_rows_equal(found, reference, ("loss", "grad_norm"), "zero bubble")


def test_megatron_layout_flag_with_a_v_schedule_is_refused_before_pretrain(tmp: Path) -> None:
    flags = "--zero-bubble-v-schedule --pipeline-model-parallel-layout E|t|t|tL"
    done = launch(flags, tmp / "v-layout.jsonl", "--train-iters", "1")
    assert done.returncode != 0
    assert "zb-v places its layer blocks itself" in done.stderr, done.stderr[-4000:]
    assert not (tmp / "v-layout.jsonl").exists()


def test_bitpipe_equals_megatron_cores_1f1b_from_the_same_weights(tmp: Path) -> None:
    """BitPipe through pretrain(): Megatron-LM's get_model builds both pipes' chunks (4 per rank, each block twice,
    on two ranks), the runtime sums the copies' gradients, the grad norm counts each weight once. Loss and grad norm
    of every iteration equal megatron-core's 1F1B's from the same weights; the save writes one copy (resume:
    ``test_resume_from_iteration_5_reproduces_6_to_10``)."""
    trained("1f1b-same-init", tmp)
    trained("bitpipe-zb", tmp)
    reference = metric_rows(tmp / "1f1b-same-init.jsonl")
    assert reference[ITERATIONS]["loss"] < reference[1]["loss"]
    assert_rows_equal(metric_rows(tmp / "bitpipe-zb.jsonl"), reference, ("loss", "grad_norm"), "bitpipe-zb")


def test_bitpipe_without_the_same_init_is_refused_before_pretrain(tmp: Path) -> None:
    """The two copies of a block sit on two ranks, which Megatron-LM initialises from different seeds."""
    done = launch("--pipeline-schedule bitpipe-zb", tmp / "bitpipe.jsonl", "--train-iters", "1")
    assert done.returncode == 2, done.stderr[-4000:]
    assert "add --zero-bubble-placement-independent-init" in done.stderr, done.stderr[-4000:]
    assert not (tmp / "bitpipe.jsonl").exists()


def test_verify_through_the_checkout(tmp: Path) -> None:
    """``megatron-zb verify --megatron-lm <checkout>``, as the README installs it (megatron-core in the venv): the
    checkout's Llama-3 8B example line (bf16, GQA, SwiGLU, distributed optimizer with both overlaps) with zb-v."""
    example = EXAMPLES / f"llama3_8b_{checkouts.SHARED_CHECKOUT.name}.json"
    argv = json.loads(example.read_text())["argv"]
    root = checkouts.checkout(tmp)
    command = [sys.executable, "-m", "megatron_zb", "verify", "--megatron-lm", str(root), "--", *argv]
    done = subprocess.run([*command, "--zero-bubble-v-schedule"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "zb-v against megatron-core's own schedule, through Megatron-LM" in done.stdout
    assert "your checkout's scripts" in done.stdout
    assert "OK: zb-v matches megatron-core's schedule" in done.stdout


def test_v_builds_each_layer_moe_or_dense_by_its_own_number(tmp: Path) -> None:
    """--moe-layer-freq [0,1,0,1] on pp 2 with an MTP layer: megatron's looping mapping gives rank 0's vp 1 layer 3
    (dense), the V gives it layer 4 (MoE). core_v0.16.1's model provider builds each chunk's layer specs from a fresh
    config before the GPTModel (core_v0.19.0's builder shares one config, which the GPTModel hook gives the layout at
    vp 0). zb-v's loss, MTP loss and grad norm of every iteration equal megatron-core's 1F1B's from the same weights."""
    line = DEEPSEEK.replace("[0]+[1]*3", "[0,1,0,1]") + " " + MTP.replace(SAME_INIT, "")
    rows = {}
    for case, flags in {"pattern-1f1b": "", "pattern-zb-v": "--zero-bubble-v-schedule"}.items():
        metrics = tmp / f"{case}.jsonl"
        done = launch(f"{line} {flags}", metrics, "--train-iters", "4")
        assert done.returncode == 0, done.stderr[-4000:]
        rows[case] = metric_rows(metrics)
    reference, found = rows["pattern-1f1b"], rows["pattern-zb-v"]
    assert sorted(reference) == [1, 2, 3, 4] and reference[4]["loss"] < reference[1]["loss"]
    assert_rows_equal(found, reference, ("loss", "grad_norm", "mtp_loss"), "pattern-zb-v")
