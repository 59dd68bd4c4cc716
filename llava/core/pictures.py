"""What the image layer tells engines about a decoded picture, in its Pillow `info`."""

# The bytes a picture was decoded from, set only where Pillow alone decodes them to exactly its
# pixels (an opaque, upright RGB JPEG or PNG): an engine may keep them instead of the pixels,
# rather than encode the pixels again.
SENT_AS = "llava.sent_as"
