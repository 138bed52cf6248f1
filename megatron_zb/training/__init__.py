"""A pretrain_gpt-style training loop on megatron-core (the launcher behind `megatron-zb train`)."""
