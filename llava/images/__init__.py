"""Turn image references from requests into normalized RGB images, safely.

This module is the kit's security boundary for images: a request may name an image by
https URL, s3://bucket/key, data: URI or raw base64, and everything about that reference is
hostile until proven otherwise.

- URLs: only https (http if the policy allows). Every address a host resolves to is vetted
  (loopback, private, link-local, multicast, reserved, shared, cloud metadata, and IPv6 forms
  that embed those are refused) on every redirect hop, and the connection goes to the vetted
  address itself, so DNS cannot answer differently between the check and the connect. TLS is
  still verified against the host name. Redirects are followed by hand and re-vetted.
- Limits: connect/read timeouts plus one deadline for the whole fetch; a byte limit enforced
  while streaming; a pixel limit checked from the image header before anything is decoded.
- Content is identified from its bytes, never from Content-Type, and only common raster
  formats are parsed.

This layer is pure: no torch or transformers; boto3 is imported only when s3:// is used.
"""

from __future__ import annotations

from llava.images.decode import to_rgb
from llava.images.loader import ImageLoader
from llava.images.policy import ImagePolicy, check_address
from llava.images.refs import describe_ref

__all__ = ["ImageLoader", "ImagePolicy", "check_address", "describe_ref", "to_rgb"]
