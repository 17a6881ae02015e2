"""Numbers in the texts people read: ``:g``'s six significant digits, never an exponent.

A budget of 1,000,000 USD/hr is allowed (``controlplane.spec.MAX_BUDGET_USD_PER_HR``) and
``f"{x:g}"`` writes it ``1e+06``; a price of 0.00005 USD/hr ``5e-05``. :func:`plain` writes the
same digits positionally. (No numpy here: the command line's client commands import this.)
"""

from __future__ import annotations

from decimal import Decimal


def money(usd_per_hr: float) -> float:
    """A sum of prices times counts rounded to 1e-9 USD/hr, the exact sum where every price has at
    most nine decimals (the catalog's have at most six), without the binary float's noise: a plan
    of 2 x 0.149 + 3 x 0.1664 USD/hr costs 0.7972, not 0.7971999999999999.

    >>> 2 * 0.149 + 3 * 0.1664, money(2 * 0.149 + 3 * 0.1664), money(0.526 + 2 * 0.675)
    (0.7971999999999999, 0.7972, 1.876)
    """
    return round(float(usd_per_hr), 9)


def plain(x: float, digits: int = 6) -> str:
    """``x`` as ``f"{x:g}"`` writes it (``digits`` significant digits, six as ``:g``'s, no
    trailing zeros), positional.

    >>> plain(1e6), plain(0.526), plain(5e-5), plain(1 / 3), plain(1.234567e8), plain(2.0)
    ('1000000', '0.526', '0.00005', '0.333333', '123457000', '2')
    >>> plain(1500.0, 3), plain(1949.9, 3), plain(0.000123456, 3), plain(12346.0, 4)
    ('1500', '1950', '0.000123', '12350')
    """
    text = f"{x:.{digits}g}"
    if "e" not in text:  # also inf and nan
        return text
    text = format(Decimal(text), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text
