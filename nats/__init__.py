"""NAtS-L: token-level hybrid attention search."""
