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
    """

    def __init__(self, placement: Placement, layers: list[int], mtp_layers: int = 0):
        if len(layers) != placement.num_stages or any(count < 0 for count in layers):
            raise ValueError(
                f"need a non-negative decoder layer count for each of the {placement.num_stages} blocks "
                f"of the {placement.kind} placement, got {list(layers)}"
            )
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
        base = placement.chunk_base
        self.layout = [[None] * placement.chunks for _ in range(placement.pp)]
        for block, (rank, chunk) in enumerate(placement.blocks):
            self.layout[rank][chunk - base] = list(self.blocks[block])
        self.flatten_layout = [layer for block in self.blocks for layer in block]
        self.pipeline_model_parallel_size = placement.pp
        self.virtual_pipeline_model_parallel_size = placement.chunks
        self.input_data = "|".join("".join(_CHARS[layer] for layer in block) for block in self.blocks)

    def __repr__(self) -> str:
        return f"PlacementLayerLayout({self.placement.kind}, pp={self.placement.pp}, blocks {self.input_data})"

    def block_of(self, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
        """The layer block built on (pp_rank, vp_stage); pp_rank defaults to this process's."""
        if pp_rank is None:
            from megatron.core import parallel_state

            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        if vp_stage is None:
            if self.placement.chunks > 1:
                raise ValueError(
                    f"vp_stage must be given: the {self.placement.kind} placement has "
                    f"{self.placement.chunks} chunks per rank (build each GPTModel with vp_stage=chunk)"
                )
            vp_stage = 0
        return self.placement.stage_of(pp_rank, self.placement.chunk_base + vp_stage)

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
