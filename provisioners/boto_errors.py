"""The exceptions a boto3 call raises when the call fails, as one tuple to catch.

botocore's ``ResponseParserError`` (an answer that is not the API's XML or JSON: an HTML error
page from a wrong region's endpoint, a proxy, moto asked for a region it lacks) derives from
``Exception``, not ``BotoCoreError``: caught as the other two were, it escaped the provisioner
with a traceback on every reconcile.
"""

from __future__ import annotations

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

__all__ = ["BOTO_ERRORS", "ResponseParserError"]

BOTO_ERRORS: tuple[type[Exception], ...] = (ClientError, BotoCoreError, ResponseParserError)
