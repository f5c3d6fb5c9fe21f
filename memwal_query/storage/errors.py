"""Classifying object-store errors: one line saying why a Lance I/O error happened.

Lance reports store failures as text (``LanceError(IO): ...`` with the S3 XML body);
:func:`store_error` turns that into a short reason for the typed
:class:`~memwal_query.exceptions.StorageError` messages.
"""

from __future__ import annotations

import re


def store_error(text: str) -> str:
    """One line saying why a Lance I/O error happened (S3 error code first)."""
    code = re.search(r"<Code>([^<]+)</Code>", text)
    status = re.search(r"status code: (\d{3})", text)
    first = (text.split("<?xml", 1)[0].splitlines() or [""])[0]
    first = first.removeprefix("LanceError(IO): ").rstrip(" :")
    if code is not None:
        first = f"{first} ({code.group(1)})"
    if code is not None and code.group(1) == "NoSuchBucket":
        return f"no such bucket: {first}"
    if status is not None and status.group(1) in ("401", "403"):
        return f"access denied (check the credentials): {first}"
    if "error sending request" in text:
        return f"cannot reach the store (check the endpoint): {first}"
    return first
