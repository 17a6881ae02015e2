"""Numbers in the texts people read: ``:g``'s six significant digits, never an exponent.

A budget of 1,000,000 USD/hr is allowed (``spec.MAX_BUDGET_USD_PER_HR``) and ``f"{x:g}"`` writes it
``1e+06``; a price of 0.00005 USD/hr ``5e-05``. ``plain`` writes the same digits positionally.
"""

from __future__ import annotations

import numpy as np


def plain(x: float) -> str:
    """``x`` as ``f"{x:g}"`` writes it (six significant digits, no trailing zeros), positional."""
    if not np.isfinite(x):
        return f"{x:g}"
    return str(
        np.format_float_positional(float(x), precision=6, unique=False, fractional=False, trim="-")
    )
