"""Which decoder layers each layer block builds, for any placement (V included).

megatron-core maps (pp rank, vp stage) to layers assuming the looping placement: block
``vp * pp + rank``. ``PlacementLayerLayout`` answers the same questions from a Placement, and
is what ``TransformerConfig.pipeline_model_parallel_layout`` takes: ``get_num_layers_to_build``,
``get_transformer_layer_offset`` and the GPT layer specs then delegate to it, so every
TransformerLayer gets its global 1-based ``layer_number``.
"""

from __future__ import annotations

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from ..schedule.placement import Placement
from .layer_split import layers_per_block

_CHARS = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.mtp: "m", LayerType.loss: "L"}


class PlacementLayerLayout(PipelineParallelLayerLayout):
    """megatron-core's custom pipeline layout, with blocks placed by a Placement.

    ``layout[pp_rank][vp_stage]`` holds the layer types of the block on (rank, chunk) and
    ``flatten_layout`` lists every block in layer order (embedding first, loss last), as the
    base class keeps them; only the (rank, vp stage) -> block mapping differs. Multi-token
    prediction layers (``mtp_layers``) sit in the last block, before the loss, where megatron-core
    builds them (``mtp_on_this_rank`` reads this layout): under V that is rank 0's second chunk.

    ``pipes`` (BitPipe: two mirrored placements of the same blocks, on consecutive chunk ids) puts
    every pipe's blocks on its ranks' chunks: vp stage ``c`` is chunk id ``c`` of whichever pipe owns it,
    so one model list of ``sum(chunks)`` chunks holds each block twice, with the same layers.
    """

    def __init__(self, placement: Placement, layers: list[int], mtp_layers: int = 0, pipes: tuple[Placement, ...] = ()):
        if len(layers) != placement.num_stages or any(count < 0 for count in layers):
            raise ValueError(
                f"need a non-negative decoder layer count for each of the {placement.num_stages} blocks "
                f"of the {placement.kind} placement, got {list(layers)}"
            )
        self.placements = _pipes(placement, pipes)
        last = placement.num_stages - 1
        self.placement = placement
        self.layers = tuple(layers)
        self.mtp_layers = mtp_layers
        self.blocks = [
            [LayerType.embedding] * (block == 0)
            + [LayerType.decoder] * count
            + [LayerType.mtp] * (mtp_layers if block == last else 0)
            + [LayerType.loss] * (block == last)
            for block, count in enumerate(layers)
        ]
        base, chunks = placement.chunk_base, sum(pipe.chunks for pipe in self.placements)
        self.layout = [[None] * chunks for _ in range(placement.pp)]
        for pipe in self.placements:
            for block, (rank, chunk) in enumerate(pipe.blocks):
                self.layout[rank][chunk - base] = list(self.blocks[block])
        self.flatten_layout = [layer for block in self.blocks for layer in block]  # one pipe's: the model's layers
        self.pipeline_model_parallel_size = placement.pp
        self.virtual_pipeline_model_parallel_size = chunks
        self.input_data = "|".join("".join(_CHARS[layer] for layer in block) for block in self.blocks)

    def __repr__(self) -> str:
        kinds = " + ".join(pipe.kind for pipe in self.placements)
        return f"PlacementLayerLayout({kinds}, pp={self.placement.pp}, blocks {self.input_data})"

    def pipe_of(self, vp_stage: int | None = None) -> Placement:
        """The placement (pipe) whose chunk is vp stage ``vp_stage``."""
        if vp_stage is None:
            if self.virtual_pipeline_model_parallel_size > 1:
                raise ValueError(
                    f"vp_stage must be given: the {self.placement.kind} placement has "
                    f"{self.virtual_pipeline_model_parallel_size} chunks per rank (build each GPTModel with "
                    "vp_stage=chunk)"
                )
            vp_stage = 0
        return pipe_of(self.placements, vp_stage)

    def block_of(self, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
        """The layer block built on (pp_rank, vp_stage), in its pipe; pp_rank defaults to this process's."""
        if pp_rank is None:
            from megatron.core import parallel_state

            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        pipe = self.pipe_of(vp_stage)
        return pipe.stage_of(pp_rank, self.placement.chunk_base + (vp_stage or 0))

    def get_num_layers_to_build(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None) -> int:
        return self.blocks[self.block_of(vp_stage, pp_rank)].count(layer_type)

    def get_layer_offset(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None) -> int:
        """Layers of ``layer_type`` in all blocks before this one, in layer order."""
        block = self.block_of(vp_stage, pp_rank)
        return sum(earlier.count(layer_type) for earlier in self.blocks[:block])

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: int | None) -> bool:
        if (mtp_num_layers or 0) != self.mtp_layers:
            raise ValueError(
                f"the {self.placement.kind} layout places {self.mtp_layers} multi-token prediction layers but "
                f"--mtp-num-layers is {mtp_num_layers}; build it with layer_layout(..., mtp_layers={mtp_num_layers})"
            )
        if sum(self.layers) != num_layers:
            raise ValueError(
                f"the {self.placement.kind} layout builds {sum(self.layers)} decoder layers {list(self.layers)} "
                f"but --num-layers is {num_layers}; build it with layer_layout({num_layers}, placement)"
            )
        return super().validate_layer_layout(num_layers, mtp_num_layers)


def layer_layout(
    num_layers: int, placement: Placement, pad: bool = False, mtp_layers: int | None = None
) -> PlacementLayerLayout:
    """The layout to set as ``TransformerConfig.pipeline_model_parallel_layout`` for ``placement``."""
    return PlacementLayerLayout(placement, layers_per_block(num_layers, placement, pad), mtp_layers or 0)


def pipe_of(placements: tuple[Placement, ...], vp_stage: int) -> Placement:
    """The pipe holding vp stage ``vp_stage`` (chunk id ``first chunk_base + vp_stage``) of a model list."""
    chunk = placements[0].chunk_base + vp_stage
    for pipe in placements:
        if pipe.chunk_base <= chunk < pipe.chunk_base + pipe.chunks:
            return pipe
    total = sum(pipe.chunks for pipe in placements)
    raise ValueError(f"vp stage {vp_stage} is outside the {total} chunks per rank of {placements[0].kind}")


def _pipes(placement: Placement, pipes: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Every pipe of the layout, ``placement`` first; they must hold the same blocks on consecutive chunk ids."""
    pipes = tuple(pipes) or (placement,)
    if pipes[0] != placement:
        raise ValueError(f"the first pipe must be the layout's placement ({placement.kind}), got {pipes[0].kind}")
    base = placement.chunk_base
    for pipe in pipes:
        if (pipe.pp, pipe.num_stages, pipe.chunk_base) != (placement.pp, placement.num_stages, base):
            raise ValueError(
                f"pipes of one layout need the same ranks and blocks, on consecutive chunk ids: the {pipe.kind} "
                f"placement has pp={pipe.pp}, {pipe.num_stages} blocks and chunks from {pipe.chunk_base}, "
                f"expected pp={placement.pp}, {placement.num_stages} blocks and chunks from {base}"
            )
        base += pipe.chunks
    return pipes
