"""A host's flags for a job across hosts that the launcher checks itself: its failure domain."""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import UsageError

FAILURE_DOMAIN = "NONSTOP_FAILURE_DOMAIN"  # a scheduler may say the host's rack here
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/=-]{0,127}")


def failure_domain(flag: str | None, env: Any = os.environ) -> str:
    """This host's failure domain: ``--failure-domain``, else ``$NONSTOP_FAILURE_DOMAIN``, else
    "" (the host itself). A label is 1 to 128 letters, digits and ``. _ : / = -``, starting
    with a letter or digit (a rack's name, a switch's, ``zone/rack``); else one line, exit 2."""
    label, where = (flag, "--failure-domain") if flag is not None else (
        env.get(FAILURE_DOMAIN), f"${FAILURE_DOMAIN}")
    if label is None:
        return ""
    if not _LABEL.fullmatch(label):
        raise UsageError(f"{where} {label!r}: a failure domain is 1 to 128 letters, digits and "
                         "'._:/=-', starting with a letter or digit (e.g. rack-3)")
    return label
