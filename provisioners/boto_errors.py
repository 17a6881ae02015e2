"""The exceptions a boto3 call raises when the call fails, as one tuple to catch.

botocore's ``ResponseParserError`` (an answer that is not the API's XML or JSON: an HTML error
page from a wrong region's endpoint, a proxy, moto asked for a region it lacks) derives from
``Exception``, not ``BotoCoreError``: caught as the other two were, it escaped the provisioner
with a traceback on every reconcile.
"""

from __future__ import annotations

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

__all__ = ["BOTO_ERRORS", "ResponseParserError", "first_line"]

BOTO_ERRORS: tuple[type[Exception], ...] = (ClientError, BotoCoreError, ResponseParserError)


def first_line(error: Exception, limit: int = 200) -> str:
    """``error``'s message as one line of at most ``limit`` characters (a parser's error carries
    the whole page it could not read); its class name when it says nothing."""
    text = str(error)
    return text.splitlines()[0][:limit] if text else type(error).__name__
