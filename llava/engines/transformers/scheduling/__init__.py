"""What runs in a step: the scheduler under a token budget, and the pacer that sizes it."""
