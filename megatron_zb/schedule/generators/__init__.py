"""Built-in generators: importing this package imports each of its modules, which registers them.

A new schedule family is one module here: its ``@register``ed generator, usually a ``search.Recipe``.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
