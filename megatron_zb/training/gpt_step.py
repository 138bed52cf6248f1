"""pretrain_gpt's forward step and loss: only the chunks with the embedding or the loss read a batch."""

from __future__ import annotations

from functools import partial

import torch


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """(sum of masked token losses, token count, {"lm loss": [sum, count]}) as Megatron-LM's pretrain_gpt."""
    losses = output.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.detach().float()])}


def forward_step(data_iterator, model):
    """Read the next microbatch where the chunk needs it: tokens for the embedding and for multi-token
    prediction (which embeds them again on the loss chunk), labels for the loss."""
    from megatron.core.utils import get_attr_wrapped_model

    pre = get_attr_wrapped_model(model, "pre_process")
    post = get_attr_wrapped_model(model, "post_process")
    tokens = pre or get_attr_wrapped_model(model, "mtp_process")
    batch = next(data_iterator) if (pre or post) else None
    output = model(
        batch["tokens"] if tokens else None,
        batch["position_ids"] if tokens else None,
        None,
        labels=batch["labels"] if post else None,
    )
    return output, partial(loss_func, batch["loss_mask"] if post else None)


def reduce_losses(loss_dicts: list[dict], dp_group) -> dict[str, float]:
    """Token-weighted mean of each logged loss over the microbatches and the data-parallel replicas."""
    import torch.distributed as dist

    if not loss_dicts:
        return {}
    found = {}
    for key in loss_dicts[0]:
        total = torch.stack([d[key].float().reshape(-1)[:2] for d in loss_dicts]).sum(dim=0)
        dist.all_reduce(total, group=dp_group)
        found[key] = float(total[0] / total[1].clamp(min=1))
    return found


def mtp_losses(config, microbatches: int) -> list[float] | None:
    """The iteration's multi-token prediction losses, one per MTP layer, as Megatron-LM's training_log logs them
    ("mtp_N loss"); megatron-core's tracker is emptied. None without MTP. Every rank calls it (collectives).

    The loss chunk adds each microbatch's loss to the tracker on its own rank, wherever the placement puts it
    (rank 0 under V): the sum over the pipeline brings it to every rank, then the data-parallel mean.
    """
    layers = getattr(config, "mtp_num_layers", None)
    if not layers:
        return None
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    metrics = hasattr(MTPLossLoggingHelper, "clean_metrics_in_tracker")  # 0.19 tracks accuracy too
    found = MTPLossLoggingHelper.tracker.get("loss_values" if metrics else "values")
    values = torch.zeros(layers) if found is None else found.detach().float().cpu().clone()
    if found is not None:
        (MTPLossLoggingHelper.clean_metrics_in_tracker if metrics else MTPLossLoggingHelper.clean_loss_in_tracker)()
    dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
    values /= parallel_state.get_data_parallel_world_size() * microbatches
    return values.tolist()
