"""A session's state: its conversation and images, its cache's tier, and its snapshot."""
