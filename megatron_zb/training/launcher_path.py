"""Preloaded first by the fork server (``fork_server.ensure``): the launcher's ``sys.path``, before any other import.

Only the fork server imports this module, while ``MEGATRON_ZB_FORK_SERVER_PATH`` holds the path.
"""

import json
import os
import sys

_path = os.environ.get("MEGATRON_ZB_FORK_SERVER_PATH")
if _path is not None:
    sys.path[:] = json.loads(_path)
