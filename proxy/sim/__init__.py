"""The simulated GPU inference backend (`kvgate sim`)."""
