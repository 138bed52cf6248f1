"""The schedule core: IR, generators, validator, simulator. Pure Python, never imports torch."""
