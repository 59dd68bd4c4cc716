"""What both engines share (no torch): a conversation's ids as the model's pipeline makes them,
and answer ids as text."""
