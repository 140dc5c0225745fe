"""JSON from another process (a push's header, an API's body, a state file), read with one failure: ValueError.

json.loads raises RecursionError, not ValueError, for brackets nested deeper than the interpreter's stack ('[' x
1,000 on CPython 3.11): each reader caught it on its own, and one that did not (the exporter's Stepscope-Bounds
header, 5,000 '[') answered the push 500 with a traceback in the exporter's log instead of 400.
"""

import json
from typing import Any


def loads(raw: str | bytes) -> Any:  # any JSON value, as json.loads
    """The document in `raw`; ValueError (json.JSONDecodeError, UnicodeDecodeError, or nesting too deep) when none."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("brackets nested deeper than the interpreter's stack") from None
