"""The flag surface: megatron-zb's flag table, and Megatron-LM's parser read as the launcher and verify read a line.

``table.py`` is the row (``Flag``) and the parser builder; the rows are in ``zero_bubble.py`` (``add_args``),
``launcher.py`` (megatron-zb train) and ``commands.py`` (plan, compare, verify; ``COMMANDS``: every command's).
``megatron_lm_parser.py`` reads a command line with Megatron-LM's own parser.
"""
