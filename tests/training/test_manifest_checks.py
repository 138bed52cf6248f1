"""What the launcher refuses about --load before it spawns anything, from the checkpoint's manifest alone.

No torch here: a checkpoint folder is written the way ``save_checkpoint`` lays it out (rank files, metadata,
a manifest with every file's size and sha256, the model's shape and the optimizer), then ``check_before_spawn``
reads it against this run's flags. With --cpu the launcher holds the files and verifies every hash itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_zb.testing.checkpoint_folder import RANK_FILE, run_args, save
from megatron_zb.training.manifest import CheckpointError, check_before_spawn


def test_an_intact_checkpoint_of_the_same_model_passes(tmp_path: Path) -> None:
    save(tmp_path, run_args(tmp_path))
    check_before_spawn(run_args(tmp_path))


def test_a_flipped_byte_is_refused_by_the_launcher_naming_the_file(tmp_path: Path) -> None:
    folder = save(tmp_path, run_args(tmp_path))
    data = bytearray((folder / RANK_FILE).read_bytes())
    data[10] ^= 1
    (folder / RANK_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{folder / RANK_FILE} does not match its sha256 in manifest.json"):
        check_before_spawn(run_args(tmp_path))
    check_before_spawn(run_args(tmp_path, cpu=False))  # under torchrun each rank verifies what it reads


@pytest.mark.parametrize(
    "change, words",
    [
        ({"hidden_size": 64, "ffn_hidden_size": 256}, "--hidden-size: checkpoint 32, this run 64"),
        (
            {"padded_vocab_size": 256},
            "--vocab-size (or the tokenizer's vocabulary, padded): checkpoint 128, this run 256",
        ),
        ({"swiglu": True}, "--swiglu: checkpoint False, this run True"),
        ({"group_query_attention": True, "num_query_groups": 2}, "--num-query-groups: checkpoint None, this run 2"),
    ],
)
def test_a_model_of_another_shape_is_refused_naming_the_flag(tmp_path: Path, change: dict, words: str) -> None:
    save(tmp_path, run_args(tmp_path))
    with pytest.raises(CheckpointError) as refused:
        check_before_spawn(run_args(tmp_path, **change))
    assert "holds a model of another shape" in str(refused.value) and words in str(refused.value)


def test_an_adam_checkpoint_is_refused_for_sgd(tmp_path: Path) -> None:
    save(tmp_path, run_args(tmp_path))
    with pytest.raises(CheckpointError, match="holds the state of --optimizer adam .* resume with --optimizer adam"):
        check_before_spawn(run_args(tmp_path, optimizer="sgd"))


def test_load_of_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="--load .*model.pt is a file; give the checkpoint folder"):
        check_before_spawn(run_args(tmp_path, load=str(path)))
