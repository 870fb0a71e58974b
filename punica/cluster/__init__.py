"""Multi-GPU serving: placement policy, Ray workers, and a discrete-event simulator."""
