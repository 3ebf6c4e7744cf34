"""Running one experiment: the launcher command, the runner process, the probe in the ranks, measurement, ops, lifeline."""
