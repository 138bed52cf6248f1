"""Running inside Megatron-LM: its own ``pretrain()`` with the zero-bubble flags and schedules.

One module per use, top to bottom: ``launch`` (``megatron-zb train --megatron-lm``: checks, then spawns the gloo
ranks or runs here), ``verify_runs`` (verify's two runs of a scaled line), ``preflight`` (the line through
Megatron-LM's own ``validate_args`` before any process starts), ``pretrain`` (``pretrain()`` in this process),
``validation`` (our checks inside its ``validate_args``), ``checkout`` (which Megatron-LM: a checkout or the
installed wheel's), ``script`` (GPT providers when no checkout gives pretrain_gpt.py), ``cpu`` (what Megatron-LM
assumes of a GPU, shimmed), ``rank_imports`` (what the ranks' fork server imports once).
"""
