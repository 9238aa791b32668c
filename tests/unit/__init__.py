"""Fast CPU unit tests: no Ray, no network, no real model."""
