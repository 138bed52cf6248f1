"""The patched pretrain_gpt.py of a real checkout trains a V schedule, equal to megatron-core's 1F1B.

Runs on the checkout MEGATRON_LM_PATH names, else on a copy of the project's shared one for this Python
(``megatron_zb.testing.checkouts``; skipped where neither exists). The checkout is left alone: its
pretrain_gpt.py is copied next to a package_info.py, patched there with patches/apply.sh, and run as
``__main__`` (what ``torchrun pretrain_gpt.py`` does) by two spawned gloo ranks on CPU, with the checkout
on the path for everything else. The reference is
megatron-core's 1F1B through ``megatron-zb train --megatron-lm`` from the same weights
(``--zero-bubble-placement-independent-init``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_zb.testing import checkouts

pytestmark = pytest.mark.skipif(not checkouts.available(), reason=checkouts.skip_reason())

ROOT = Path(__file__).resolve().parents[2]
FLAGS = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --pipeline-model-parallel-size 2 --hidden-dropout 0 "
    "--attention-dropout 0 --log-interval 1 --eval-iters 0 --eval-interval 6 --seed 1234 --clip-grad 0.05 "
    "--train-iters 6 --zero-bubble-placement-independent-init"
)
# Two gloo ranks running the patched script as __main__, as under torchrun, with megatron-zb's CPU shims.
RUNNER = """
import os, runpy, sys

def worker(rank, port, root, script, argv, metrics):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    sys.path[:0] = [os.path.dirname(script), root]
    import multiprocessing
    multiprocessing.set_start_method("fork", force=True)
    import torch.distributed as dist
    from megatron_zb.megatron_lm import cpu as megatron_lm_cpu
    from megatron_zb.megatron_lm import launch, pretrain

    megatron_lm_cpu.enable()
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank,
                            world_size=2)
    from megatron.training import training
    pretrain._write_metrics(training, metrics)
    sys.argv = [script, *launch.cpu_argv(argv)]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise

if __name__ == "__main__":
    import json
    import torch.distributed as dist
    import torch.multiprocessing as mp
    root, script, metrics, argv = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(worker, args=(store.port, root, script, argv, metrics), nprocs=2, join=True)
"""


def losses(metrics: Path) -> dict[int, float]:
    return {row["iteration"]: row["loss"] for row in map(json.loads, metrics.read_text().splitlines())}


def test_patched_script_trains_zb_v_like_megatron_cores_1f1b(tmp_path: Path) -> None:
    real = checkouts.checkout(tmp_path)
    copy = tmp_path / "patched"
    (copy / "megatron" / "core").mkdir(parents=True)
    shutil.copy(real / "pretrain_gpt.py", copy / "pretrain_gpt.py")
    shutil.copy(real / "megatron" / "core" / "package_info.py", copy / "megatron" / "core" / "package_info.py")
    applied = subprocess.run(["bash", str(ROOT / "patches" / "apply.sh"), str(copy)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    shutil.rmtree(copy / "megatron")  # apply.sh read the version there; the run imports the checkout's megatron
    runner = tmp_path / "run_patched.py"
    runner.write_text(textwrap.dedent(RUNNER))
    patched = tmp_path / "zb-v.jsonl"
    argv = json.dumps([*FLAGS.split(), "--zero-bubble-v-schedule"])
    command = [sys.executable, str(runner), str(real), str(copy / "pretrain_gpt.py"), str(patched), argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]

    reference = tmp_path / "1f1b.jsonl"
    command = [sys.executable, "-m", "megatron_zb.pretrain_gpt", "--megatron-lm", str(real), "--cpu", *FLAGS.split()]
    done = subprocess.run([*command, "--metrics-file", str(reference)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    expected = losses(reference)
    assert sorted(expected) == list(range(1, 7)) and expected[6] < expected[1]
    found = losses(patched)
    assert sorted(found) == sorted(expected)
    for iteration, loss in expected.items():
        assert found[iteration] == pytest.approx(loss, rel=1e-5), (iteration, found, expected)
