"""Built-in generators; importing this package registers them."""

from . import interleaved, one_f_one_b, zb_h1, zb_h2  # noqa: F401
