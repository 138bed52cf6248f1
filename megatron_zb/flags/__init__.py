"""The flag surface: Megatron-LM's parser read as the launcher, verify and Megatron-LM's own runs read a line."""
