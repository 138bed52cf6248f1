"""Megatron integration: flags, registration behind get_forward_backward_func, GPT placement."""
