"""The validation switch: the one piece of process-wide state in tensorpar.

``VALIDATE[0]`` is True while validation mode is on (`tensorpar.validation`, or
``TENSORPAR_VALIDATE=1`` in the environment at import). A one-element list, so the hot path
reads it without a call; it lives in a module of its own so the lowest layers can read it.
"""

from __future__ import annotations

import os

__all__ = ["VALIDATE"]

VALIDATE = [os.environ.get("TENSORPAR_VALIDATE", "").strip().lower() not in ("", "0", "false")]
