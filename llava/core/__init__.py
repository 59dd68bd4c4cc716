"""What every layer shares: errors, generation parameters and limits, ids, families, config."""
