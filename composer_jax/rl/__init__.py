"""Asynchronous policy-gradient RL: losses (group advantages, truncated IS, k1 KL), fixed-shape batches from the
trajectory queue, and the jitted step with router replay."""
