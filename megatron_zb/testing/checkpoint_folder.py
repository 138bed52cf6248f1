"""A checkpoint folder as ``save_checkpoint`` lays it out, without torch, and launcher arguments that match it.

For the tests of what the launcher refuses about ``--load`` before spawning (``training.manifest``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..schedule.placement import linear
from ..training.manifest import (
    MANIFEST,
    TRACKER,
    Layout,
    build_manifest,
    iteration_directory,
    model_shape,
    placement_text,
    write_durably,
)

RANK_FILE = "mp_rank_00/model_optim_rng.pt"


def run_args(tmp_path: Path, **fields) -> argparse.Namespace:
    args = argparse.Namespace(
        load=str(tmp_path / "ckpt"), save=None, exit_on_missing_checkpoint=False, cpu=True, train_iters=10,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1, context_parallel_size=1,
        use_distributed_optimizer=False, placements=(linear(1),), placement=linear(1), optimizer="adam",
        num_layers=4, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=False,
        num_query_groups=1, kv_channels=None, padded_vocab_size=128, max_position_embeddings=16, swiglu=False,
        normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False,
        untie_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
    )  # fmt: skip
    vars(args).update(fields)
    return args


def save(tmp_path: Path, args: argparse.Namespace, iteration: int = 2) -> Path:
    """A checkpoint of ``args`` at ``iteration``, as save_checkpoint commits it."""
    folder = iteration_directory(tmp_path / "ckpt", iteration)
    (folder / RANK_FILE).parent.mkdir(parents=True)
    files = {
        RANK_FILE: write_durably(folder / RANK_FILE, lambda f: f.write(b"weights" * 100)),
        "metadata.json": write_durably(folder / "metadata.json", lambda f: f.write(b"{}\n")),
    }
    layout = Layout(1, 1, 1, 1, False)
    extra = {"placement": placement_text(args.placement), "schedule": "zb-1p", "model": model_shape(args),
             "optimizer": args.optimizer}  # fmt: skip
    (folder / MANIFEST).write_text(json.dumps(build_manifest(iteration, layout, files, extra)))
    (tmp_path / "ckpt" / TRACKER).write_text(f"{iteration}\n")
    return folder
