"""Training draft heads on data the target generates itself."""
