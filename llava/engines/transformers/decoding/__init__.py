"""Choosing tokens: sampling, stacked decode batches, turning tokens into text."""
