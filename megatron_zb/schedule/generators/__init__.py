"""Built-in generators; importing this package registers them."""

from . import (  # noqa: F401
    auto,
    bitpipe,
    breadth_first,
    interleaved,
    one_f_one_b,
    v_auto,
    v_family,
    zb_auto,
    zb_h1,
    zb_h2,
)
