"""What the image layer tells engines about a decoded picture, in its Pillow `info`."""

# The bytes a picture was decoded from, set only where Pillow alone decodes them to exactly its
# pixels (an opaque, upright RGB JPEG or PNG): an engine may keep them instead of the pixels,
# rather than encode the pixels again.
SENT_AS = "llava.sent_as"

# A progressive JPEG is decoded once per scan over the whole picture, so a few hundred KB of
# repeated scans can hold a decoder for tens of seconds. Bytes kept to be decoded again (on a
# shared thread) have at most this many: real JPEGs have 1 (baseline) to about 10 (progressive),
# plus a thumbnail's or an MPO's second picture.
MAX_JPEG_SCANS = 32


def few_scans(image_format: str | None, data: bytes) -> bool:
    """Whether bytes of `image_format` are within MAX_JPEG_SCANS (a PNG always is). Counts a
    JPEG's start-of-scan markers: never inside scan data, where 0xFF is stuffed; a thumbnail's
    count too, so this errs high."""
    return image_format == "PNG" or data.count(b"\xff\xda") <= MAX_JPEG_SCANS
