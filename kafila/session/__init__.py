"""A member's session: forming (forming/), the running ring (ring/), weights (weights/), its runtime."""
