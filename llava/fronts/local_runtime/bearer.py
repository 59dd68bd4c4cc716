"""Bearer tokens as SageMaker's OpenAI-compatible path takes them, checked as AWS would.

A token (`sagemaker.core.token_generator.generate_token`) is `sagemaker-api-key-` and the base64
of a SigV4 presigned URL of `POST sagemaker.amazonaws.com/?Action=CallWithBearerToken`, made on
the caller's machine from their credentials, valid up to 12 hours. The local runtime recomputes
its signature with the secret of the access key it names (the runtime's own credentials), and
checks its action, region and expiry.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from urllib.parse import parse_qsl

from botocore.auth import SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials

from llava.fronts.local_runtime.errors import Refusal

TOKEN_PREFIX = "sagemaker-api-key-"
HOST = "sagemaker.amazonaws.com"
SERVICE = "sagemaker"
MAX_EXPIRES_S = 43200
MAX_CLOCK_SKEW_S = 300  # a token dated later than this ahead of the clock is refused
_UNSIGNED = ("X-Amz-Signature", "Version")  # Version is appended after signing
_SIGNATURE = re.compile(r"[0-9a-f]{64}")


def check_bearer(
    authorization: str | None, region: str, credentials: Mapping[str, str], now: datetime
) -> str:
    """The access key a valid `Authorization: Bearer` header was signed with; a `Refusal`
    (401 without a token, 403 with one that is not valid here) saying why otherwise."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Refusal(
            401,
            "UnauthorizedException",
            "This path takes a bearer token: send `Authorization: Bearer <token>` with a token "
            "from sagemaker.core.token_generator.generate_token (the openai SDK's api_key).",
        )
    query = _presigned_query(token.strip())
    fields = dict(query)
    if len(fields) != len(query):
        raise _invalid("a field of it is repeated")
    scope = fields.get("X-Amz-Credential", "").split("/")
    if (
        fields.get("Action") != "CallWithBearerToken"
        or fields.get("Version") != "1"
        or len(scope) != 5
        or scope[3:] != [SERVICE, "aws4_request"]
    ):
        raise _invalid("it is not a SageMaker bearer token")
    access_key, day, token_region = scope[0], scope[1], scope[2]
    if token_region != region:
        raise _invalid(f"it was made for {token_region}, this endpoint is in {region}")
    try:
        signed_at = datetime.strptime(fields["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(
            tzinfo=timezone.utc
        )
        expires = int(fields["X-Amz-Expires"])
    except (KeyError, ValueError):
        raise _invalid("its date or expiry is missing") from None
    if day != fields["X-Amz-Date"][:8]:
        raise _invalid("its credential's date is not its own")
    if (signed_at - now).total_seconds() > MAX_CLOCK_SKEW_S:
        raise _invalid("it is dated in the future: check this machine's clock")
    if not 1 <= expires <= MAX_EXPIRES_S:
        raise _invalid(f"its expiry of {expires} s is outside 1-{MAX_EXPIRES_S}")
    if (now - signed_at).total_seconds() > expires:
        raise _invalid("it has expired: generate a new one")
    secret, given = credentials.get(access_key), fields.get("X-Amz-Signature", "")
    if (
        secret is None
        or not _SIGNATURE.fullmatch(given)
        or not hmac.compare_digest(_signature(fields, access_key, secret, region, expires), given)
    ):
        raise _invalid("its signature does not match the credentials it names")
    return access_key


def _presigned_query(token: str) -> list[tuple[str, str]]:
    if not token.startswith(TOKEN_PREFIX):
        raise _invalid(f"it does not start with {TOKEN_PREFIX}")
    try:
        url = base64.b64decode(token[len(TOKEN_PREFIX) :], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise _invalid("it is not base64 of a presigned URL") from None
    host, _, query = url.partition("/?")
    if host != HOST:
        raise _invalid(f"it presigns {host[:100]!r}, not {HOST}")
    return parse_qsl(query, keep_blank_values=True)


def _signature(
    fields: dict[str, str], access_key: str, secret: str, region: str, expires: int
) -> str:
    """SigV4's signature of the presigned request the token holds, by botocore's signer."""
    request = AWSRequest(
        method="POST",
        url=f"https://{HOST}/",
        headers={"host": HOST},
        params={key: value for key, value in fields.items() if key not in _UNSIGNED},
    )
    request.context["timestamp"] = fields["X-Amz-Date"]
    credentials = ReadOnlyCredentials(access_key, secret, fields.get("X-Amz-Security-Token"))
    auth = SigV4QueryAuth(credentials, SERVICE, region, expires=expires)
    canonical = auth.canonical_request(request)
    return str(auth.signature(auth.string_to_sign(request, canonical), request))


def _invalid(why: str) -> Refusal:
    return Refusal(403, "UnauthorizedException", f"The bearer token is not valid: {why}.")
