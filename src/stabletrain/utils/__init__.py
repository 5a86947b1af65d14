"""Small shared helpers: RNG state, atomic file writes."""
