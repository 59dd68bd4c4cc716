"""The shared store's secret: read at start from Secrets Manager (what `deploy` creates), or given.

Without a secret the seal's key would follow from the bucket and prefix alone, so anyone who may
write the prefix could plant a conversation in anyone's session, and the object names (MACs of
the session ids) could be matched against ids: a store never runs without one.
"""

from __future__ import annotations

MIN_SECRET_CHARS = 16


def store_secret(secret: str, secret_id: str) -> str:
    """Return the store's secret: `secret` itself, else the value of the Secrets Manager secret
    `secret_id` (a name, or an ARN, whose region it is read in), read through the instance's
    role; refuse to go on without one."""
    if not secret and secret_id:
        secret = _read(secret_id)
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            "the session store needs a secret of at least "
            f"{MIN_SECRET_CHARS} characters: `python -m llava deploy --session-store` makes "
            "one in Secrets Manager and sets LLAVA_SESSION_STORE_SECRET_ID; elsewhere set "
            "LLAVA_SESSION_STORE_SECRET_ID (a secret's name or ARN) or LLAVA_SESSION_STORE_SECRET"
        )
    return secret


def _read(secret_id: str) -> str:
    import boto3

    parts = secret_id.split(":")
    region = parts[3] if secret_id.startswith("arn:") and len(parts) > 3 else None
    client = boto3.client("secretsmanager", region_name=region)
    try:
        value = client.get_secret_value(SecretId=secret_id).get("SecretString") or ""
    except Exception as exc:
        raise ValueError(
            f"cannot read the session store's secret {secret_id} ({type(exc).__name__}: {exc}): "
            "the instance's role needs secretsmanager:GetSecretValue on it"
        ) from None
    return str(value)
