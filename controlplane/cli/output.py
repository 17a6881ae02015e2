"""How commands print: a human summary, or one JSON object with ``--json``; errors on one line."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

EXIT_BAD_INPUT = 2


class UsageError(ValueError):
    """A combination of command-line options that does not make sense (exit status 2)."""


def fail(message: str) -> NoReturn:
    """Print ``message`` as one line on stderr and exit with status 2."""
    print(" ".join(str(message).split()), file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def _to_json(value: Any) -> Any:
    # Imported here, not at the top: a command that never made a numpy value (--help, the client
    # commands) does not pay numpy's import, and one that did finds it loaded already.
    import numpy as np

    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite as None: JSON has no infinity and no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def emit(as_json: bool, data: Mapping[str, Any], human: Callable[[], str]) -> int:
    """Print ``data`` as one JSON object, or the human summary; return exit status 0. A figure
    that is not finite (an overflow, an unbounded wait) is ``null`` in the JSON."""
    if as_json:
        try:
            text = json.dumps(data, default=_to_json, allow_nan=False)
        except ValueError:  # a float that is not finite
            plain = json.loads(json.dumps(data, default=_to_json))
            text = json.dumps(_finite(plain), allow_nan=False)
        print(text)
    else:
        print(human())
    return 0


def rate_text(rate_qps: float) -> str:
    """A rate for people, in qps: two decimals from 1 qps up, three significant figures below
    (two decimals wrote a plan for 0.00098 qps "0.00"), never an exponent.

    >>> rate_text(28.84), rate_text(0.5), rate_text(0.00098), rate_text(0.0039), rate_text(0.0)
    ('28.84', '0.500', '0.000980', '0.00390', '0.00')
    """
    if not math.isfinite(rate_qps) or rate_qps == 0.0 or abs(rate_qps) >= 1.0:
        return f"{rate_qps:.2f}"
    # Three significant figures: the first is at decimal -floor(log10 |x|).
    decimals = 2 - math.floor(math.log10(abs(rate_qps)))
    return f"{rate_qps:.{decimals}f}"


def progress(message: str) -> None:
    """A progress line for long work; on stderr so that ``--json`` output stays one object."""
    print(message, file=sys.stderr, flush=True)
