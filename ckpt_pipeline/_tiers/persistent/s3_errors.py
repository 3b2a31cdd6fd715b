"""What obstore's errors mean: the failure of a request to S3, whether another attempt may
succeed, and for a refused one, what setting to fix."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .retries import TRANSIENT_CODES, Failure, explain_generic

__all__ = ("CREDENTIAL_HINT", "S3Place", "endpoint_hint", "explain_s3", "first_line",
           "refused_hint")

_METADATA = re.compile(r"https?://\S+/latest/(api/token|meta-data/)")  # EC2 instance metadata
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z0-9]+)</Code>")
_MESSAGE = re.compile(r"<Message>(.*?)</Message>", re.S)
_NETWORK = ("error sending request", "connection", "timed out", "timeout", "broken pipe",
            "reset by peer", "incomplete", "unexpected eof", "dns error", "body error",
            "error decoding response")
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_TRANSIENT_KINDS = frozenset(("Connect", "Timeout", "Request", "Interrupted", "Decode"))
CREDENTIAL_HINT = ("give access_key_id and secret_access_key (and session_token) in "
                    "PersistentConfig(options=), or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")


@dataclass(frozen=True, slots=True)
class S3Place:
    """Where the requests went, as the hints name it: the tier's URL, and the endpoint with
    the setting it comes from ("" for AWS's own)."""

    url: str
    endpoint: str
    endpoint_from: str


def explain_s3(exc: BaseException, base_error: type[BaseException], place: S3Place
               ) -> Failure:
    """obstore's errors carry the HTTP status and the store's XML error in their text,
    followed by a debug dump of the request (``Debug source:``) whose words (such as
    ``retry_timeout``) say nothing about this failure: only the kind of HTTP error is
    read from it."""
    if not isinstance(exc, (base_error, FileNotFoundError, PermissionError)):
        return explain_generic(exc)
    text = str(exc)
    summary, _, debug = text.partition("\n\nDebug source:")
    status = _STATUS.search(summary)
    code_match = _CODE.search(summary)
    code = code_match.group(1) if code_match else ""
    missing = code == "NoSuchKey" or (isinstance(exc, FileNotFoundError)
                                      and code != "NoSuchBucket")
    metadata = _METADATA.search(summary) is not None
    if status is not None:
        number = int(status.group(1))
        message = _MESSAGE.search(summary)
        reason = f"HTTP {number} {code}".strip() + (
            f": {message.group(1).strip()}" if message else "")
        transient = number >= 500 or number == 429 or code in TRANSIENT_CODES
        if metadata and not transient:
            return Failure(f"no credentials: the instance metadata service answered "
                           f"{reason}", False, hint=CREDENTIAL_HINT)
        return Failure(reason, transient and not missing, missing,
                       None if transient or missing else refused_hint(place.url, number, code))
    kind = _HTTP_KIND.search(debug)
    line = f"{type(exc).__name__}: {first_line(exc)}"
    if "builder error" in summary.lower() or (kind is not None and kind.group(1) == "Unknown"
                                              and "Builder" in debug):
        return Failure(line, False, hint=endpoint_hint(place))
    if metadata:  # no instance metadata service: this is not an EC2 instance
        return Failure(f"no credentials: the instance metadata service cannot be reached "
                       f"({line})", False, hint=CREDENTIAL_HINT)
    if kind is not None:
        return Failure(line, not missing and kind.group(1) in _TRANSIENT_KINDS, missing)
    lowered = summary.lower()
    transient = not missing and any(word in lowered for word in _NETWORK)
    return Failure(line, transient, missing)

def refused_hint(url: str, status: int, code: str) -> str:
    """What to fix when the store refused a request for good."""
    if code == "NoSuchBucket":
        return f"the bucket of {url} does not exist: create it, or fix the URL"
    if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId",
                                         "SignatureDoesNotMatch", "ExpiredToken"):
        return ("the store refused the credentials or the permission: check "
                "access_key_id, secret_access_key and session_token in PersistentConfig(options=) "
                "(or the AWS_* variables), and that they may read, write and list "
                f"{url}")
    if status == 301 or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
        return "the bucket is in another region: set region in PersistentConfig(options=)"
    return ("the store refused the request: check the URL, the endpoint, the region and "
            "the credentials in PersistentConfig(options=)")

def endpoint_hint(place: S3Place) -> str:
    """What to fix when the HTTP client could not even build a request."""
    where = (f"the endpoint {place.endpoint} (from {place.endpoint_from})"
             if place.endpoint else "the endpoint")
    return (f"the HTTP client could not make a request to {where}: it must be an "
            "http:// or https:// URL, and plain http:// needs client_options="
            "{'allow_http': True} in PersistentConfig(options=) (or AWS_ALLOW_HTTP=true)")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text, at most 400 characters."""
    line = (str(exc).strip().splitlines() or [""])[0]
    return line if len(line) <= 400 else line[:400] + "..."
