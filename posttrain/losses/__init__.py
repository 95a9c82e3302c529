"""Loss functions: pure, tensors in and tensors out, each tested against an independent reference."""
